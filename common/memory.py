"""The process's allocator policy for large, short-lived tensors (a shard's merges).

Every merge allocates its results afresh (a fragment's value is never changed in place, so a
checkpoint or a reply can hold the old one). glibc serves an allocation above its mmap threshold
with a new mapping, and each first touch of its pages is a page fault: at 10^6 values per
fragment those faults cost as much as the merge's own arithmetic. ``keep_freed_memory`` makes
glibc serve them from its heap, where freed fragments are reused without faults, and keep up to
``trim_bytes`` of freed memory instead of returning it at once. The peak RSS is unchanged (the
same tensors exist at the peak); between peaks the process keeps up to that much freed memory.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX / 2): larger allocations stay mappings."""


def keep_freed_memory(trim_bytes: int = 1 << 30) -> bool:
    """Allocations up to ``MMAP_THRESHOLD_MAX`` from the heap, freed memory kept up to
    ``trim_bytes``; True where applied (glibc on Linux), False elsewhere (nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))
