"""A CPU learner's step-boundary passes over its idle torch threads: the snapshot's copy
(``common.quant.copy_into``) and the carry (``common.carry.carry_local_steps_``), elementwise C
kernels, each split in slices over a pool of worker threads (the kernels release the GIL). One core
does not reach a many-core host's memory bandwidth, and training's threads wait at a boundary."""
from __future__ import annotations

import os
import threading
from typing import Any

import torch

SPLIT_MIN_BYTES = 2 << 20
"""The learner's step-boundary passes (a snapshot's copy, ``common.quant.copy_into``; the carry,
``common.carry.carry_local_steps_``) are split in slices of at least this many bytes over as many
threads as the process's torch threads (``boundary_threads``): training's threads are idle at a
step boundary, and one core alone does not reach a many-core host's memory bandwidth."""


def boundary_threads() -> int:
    """Threads a boundary pass may use: ``DDLOCO_BOUNDARY_THREADS`` where set (1: one thread),
    else the process's torch threads (``learner --threads``; ``up`` gives each learner its share of
    the cores)."""
    env = os.environ.get("DDLOCO_BOUNDARY_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    return max(1, torch.get_num_threads())


class _Splitter:
    """A pool of worker threads (made at first use, again after a fork: a forked hot spare's copy
    of its parent's pool has no threads) that runs a C kernel over slices of its arrays; the kernels
    release the GIL."""

    def __init__(self) -> None:
        self._pool: Any = None
        self._workers = 0
        self._pid = 0
        self._lock = threading.Lock()
        self.split_calls = 0

    def _get(self, workers: int) -> Any:
        with self._lock:
            if self._pool is None or self._pid != os.getpid() or self._workers < workers:
                from concurrent.futures import ThreadPoolExecutor
                # a smaller pool is dropped, not shut down: a caller that holds it still submits to
                # it; its threads end once it is collected
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ddloco-boundary")
                self._workers, self._pid = workers, os.getpid()
            return self._pool

    def run(self, kernel: Any, *arrays: Any) -> None:
        n = len(arrays[0])
        parts = max(1, min(boundary_threads(), 4 * n // SPLIT_MIN_BYTES))
        if parts == 1 or any(len(a) != n for a in arrays):
            kernel(*arrays)       # (arrays of other lengths: the kernel refuses them whole, writing nothing)
            return
        from concurrent.futures import wait
        # slice bounds at multiples of 16 values (64 bytes): every slice keeps its start's alignment (16 bytes from
        # common.hostmem, 64 from torch: enough for the streaming stores either way)
        bounds = [0, *(n * i // parts // 16 * 16 for i in range(1, parts)), n]
        pool = self._get(parts - 1)
        futures: list[Any] = []
        self.split_calls += 1
        try:
            for i in range(1, parts):
                futures.append(pool.submit(kernel, *(a[bounds[i]:bounds[i + 1]] for a in arrays)))
            kernel(*(a[:bounds[1]] for a in arrays))
        finally:
            wait(futures)         # every slice done before this returns or raises
        for f in futures:
            f.result()


_SPLITTER = _Splitter()


def split_run(kernel: Any, *arrays: Any) -> None:
    """``kernel(*arrays)`` (an elementwise C kernel over numpy vectors of one length: ``copy``,
    ``carry``), split over ``boundary_threads`` where the vectors are large (``SPLIT_MIN_BYTES`` a
    slice); the same values either way."""
    _SPLITTER.run(kernel, *arrays)
