"""CPU seconds of a process's threads by name, from ``/proc/self/task``: what libzmq's I/O threads
(named ``ZMQbg/IO/N`` by libzmq) spend moving a member's bytes, which no Python clock sees. A
learner reports it beside its own threads' clocks (``io_cpu_s``), so that ``ddloco bench sync``
counts the whole sync path."""
from __future__ import annotations

import os
import time

ZMQ_IO_PREFIX = "ZMQbg/IO/"
"""How libzmq names its I/O threads (one per context by default)."""
RESCAN_S = 30.0
"""The threads of a name are looked up again (a listing of every thread) at most this often, or
when one of them has ended; in between only their own stat files are read."""

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ThreadCpu:
    """``threads_cpu_s`` for one name prefix, remembering which threads have it."""

    def __init__(self, prefix: str = ZMQ_IO_PREFIX, task_dir: str = "/proc/self/task") -> None:
        self.prefix, self.task_dir = prefix, task_dir
        self._tids: list[str] | None = None
        self._scanned_at = float("-inf")

    def _scan(self) -> list[str] | None:
        try:
            tids = os.listdir(self.task_dir)
        except OSError:
            return None
        found = []
        for tid in tids:
            try:
                with open(f"{self.task_dir}/{tid}/comm") as f:
                    if f.read().startswith(self.prefix):
                        found.append(tid)
            except OSError:
                continue      # the thread ended meanwhile
        return found

    def seconds(self) -> float | None:
        """The CPU seconds (user + system) of this process's live threads whose name starts with
        the prefix; None where there is no ``/proc``. A thread that ended is no longer counted
        (libzmq's I/O threads live as long as their context)."""
        now = time.monotonic()
        if not self._tids or now - self._scanned_at >= RESCAN_S:   # none found yet: look each time
            self._tids, self._scanned_at = self._scan(), now          # (a new thread names itself late)
            if self._tids is None:
                return None
        ticks = 0
        for tid in self._tids:
            try:
                with open(f"{self.task_dir}/{tid}/stat") as f:
                    stat = f.read()
            except OSError:           # ended: look again at the next reading
                self._scanned_at = float("-inf")
                continue
            # after the name (in parentheses, which may hold spaces): utime and stime are fields 14, 15
            rest = stat.rsplit(")", 1)[1].split()
            ticks += int(rest[11]) + int(rest[12])
        return ticks / _TICKS


def threads_cpu_s(prefix: str = ZMQ_IO_PREFIX, task_dir: str = "/proc/self/task") -> float | None:
    """``ThreadCpu(prefix, task_dir).seconds()``: one reading, every thread listed."""
    return ThreadCpu(prefix, task_dir).seconds()
