"""CPU seconds of a process's threads by name, from ``/proc/self/task``: what libzmq's I/O threads
(named ``ZMQbg/IO/N`` by libzmq) spend moving a member's bytes, which no Python clock sees. A
learner reports it beside its own threads' clocks (``io_cpu_s``), so that ``ddloco bench sync``
counts the whole sync path."""
from __future__ import annotations

import os

ZMQ_IO_PREFIX = "ZMQbg/IO/"
"""How libzmq names its I/O threads (one per context by default)."""

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads_cpu_s(prefix: str = ZMQ_IO_PREFIX, task_dir: str = "/proc/self/task") -> float | None:
    """The CPU seconds (user + system) of this process's live threads whose name starts with
    ``prefix``; None where there is no ``/proc`` (then nothing is counted). A thread that ended is
    no longer counted (libzmq's I/O threads live as long as their context)."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    ticks = 0
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/comm") as f:
                if not f.read().startswith(prefix):
                    continue
            with open(f"{task_dir}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue      # the thread ended meanwhile
        # after the name (in parentheses, which may hold spaces): state is field 3, utime 14, stime 15
        rest = stat.rsplit(")", 1)[1].split()
        ticks += int(rest[11]) + int(rest[12])
    return ticks / _TICKS
