"""Does glibc reuse a freed fragment-sized block? ``posix_memalign`` (torch's CPU allocator)
against ``malloc`` (numpy's; ``common.hostmem``), with the learner's allocator settings
(``common.lifecycle.tune_allocator``): eight 16 MB blocks, three kept alive, each one filled;
the minor page faults of each allocation and its address. Run: ``python docs/results/alloc_reuse.py``
(docs/results/scale.md, session 7)."""
from __future__ import annotations

import ctypes
import resource
import subprocess
import sys

from common.lifecycle import tune_allocator

SIZE = 16 << 20


def measure(how: str) -> list[int]:
    """The page faults of each of eight 16 MB blocks taken with ``how``, three kept alive."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    kept: list[int] = []
    faults = []
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if how == "malloc":
            p = libc.malloc(SIZE)
        else:
            out = ctypes.c_void_p()
            libc.posix_memalign(ctypes.byref(out), 64, SIZE)
            p = out.value
        libc.memset(p, 1, SIZE)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        kept.append(p)
        if len(kept) > 3:
            libc.free(kept.pop(0))
    return faults


def main() -> None:
    if len(sys.argv) == 2:           # one allocator in a fresh process (the other's free blocks would serve it)
        print("learner allocator settings applied:", tune_allocator(), file=sys.stderr)
        print(f"{sys.argv[1]:15s} page faults per 16 MB block: {measure(sys.argv[1])}")
        return
    for how in ("posix_memalign", "malloc"):
        subprocess.run([sys.executable, __file__, how], check=True)


if __name__ == "__main__":
    main()
