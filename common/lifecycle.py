"""Process lifecycle shared by the daemons: signals, parent-death, warm/cold shutdown."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any, Iterable

PR_SET_PDEATHSIG = 1


DUPLICATE_SIGNAL_S = 2.0
"""A second stop signal this soon after the first is the same request delivered twice, not a
user's "now": a batch scheduler signals every process of a job while a supervisor (the Slurm
services job, torchrun for its ranks) passes the signal on too (a second SIGTERM a millisecond
later used to drop a shard's final checkpoint)."""


def install_stop_handlers(stop: threading.Event, *, now: Any = None) -> None:
    """First SIGTERM/SIGINT: graceful stop (``stop`` is set); another one at least
    ``DUPLICATE_SIGNAL_S`` later exits at once (one sooner is a duplicate: ignored)."""
    import time
    clock = now or time.monotonic
    first: list[float] = []

    def handler(signum, _frame):
        if stop.is_set():
            if first and clock() - first[0] < DUPLICATE_SIGNAL_S:
                return
            os._exit(128 + signum)
        first.append(clock())
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """preexec_fn: ask Linux for ``sig`` when the parent dies; exit at once if it already died
    (between fork and prctl). Elsewhere a no-op: the parent's own clean-up is the only guard."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3          # glibc's mallopt parameters
LEARNER_MMAP_THRESHOLD = 64 << 20
LEARNER_MMAP_THRESHOLD_OLD_GLIBC = 32 << 20          # the most glibc < 2.35 accepts on 64-bit
LEARNER_TRIM_THRESHOLD = 512 << 20


def tune_allocator(mmap_threshold: int = LEARNER_MMAP_THRESHOLD,
                   trim_threshold: int = LEARNER_TRIM_THRESHOLD) -> bool:
    """glibc: serve blocks below ``mmap_threshold`` from the heap and keep up to ``trim_threshold``
    of free memory at its top, instead of its defaults, under which a fragment-sized temporary
    (16 MB at 10^8 parameters and 24 fragments) is often a fresh mapping, zero-filled page by page
    on first touch, then handed back when freed. A learner makes several such temporaries per merge
    and per answer, and torch several per training step. Returns whether it was applied: not when
    ``DDLOCO_MALLOC=default``, nor when the operator set glibc's own ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TRIM_THRESHOLD_`` or the same in ``GLIBC_TUNABLES`` (their choice stands), nor where
    there is no glibc ``mallopt``. An older glibc that refuses a threshold above 32 MiB gets 32 MiB."""
    if os.environ.get("DDLOCO_MALLOC", "") == "default":
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) or bool(
        mallopt(M_MMAP_THRESHOLD, min(mmap_threshold, LEARNER_MMAP_THRESHOLD_OLD_GLIBC)))
    trimmed = bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
    return mapped and trimmed


def process_start_time() -> float | None:
    """Wall-clock time this process started (Linux /proc), so boot time (imports) is counted."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat") as fh:
            btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def stop_processes(procs: Iterable[Any], timeout_s: float = 20.0, *, kill_wait_s: float | None = None) -> None:
    """SIGTERM every process still running (a graceful stop), give them ``timeout_s`` together,
    then SIGKILL what is left and reap it (waiting at most ``kill_wait_s`` for each; None: until it
    is gone). ``procs``: ``subprocess.Popen`` or anything with its poll/terminate/wait/kill."""
    import subprocess
    import time
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=kill_wait_s)
            except subprocess.TimeoutExpired:
                pass


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts: not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's process
    return True


def peak_rss_mb() -> float:
    """This process's peak resident memory (MiB), as the kernel counts it (ru_maxrss)."""
    import resource
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def rss_mb() -> float:
    """This process's resident memory now (MiB; /proc/self/statm, 0.0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
