"""Large float32 host vectors from ``malloc`` (numpy's allocator) instead of torch's.

torch's CPU allocator asks glibc for 64-byte-aligned blocks (``posix_memalign``). A freed block
of exactly a fragment's size can be too small for the next aligned request of the same size (it
needs the alignment's slack on top); glibc then carves the new one from fresh memory, zero-filled
page by page on first touch (16 MB: 4,096 page faults), and reuses the freed blocks only once they
coalesce. ``malloc`` of the same size reuses a freed block of that size at once. A learner makes
such a vector at every merge it receives (the new base) and every answer (the snapshot); a shard
at every merge (the new replica). Measured (session 7, docs/results/scale.md): alone, one thread,
eight 16 MB allocations with three kept alive, ``posix_memalign`` took fresh pages every time and
``malloc`` none after the first four (``python docs/results/alloc_reuse.py``); in ``ddloco bench sync --params 1e8`` the learners' network
threads took 299 page faults per merge in one run (a temporary instrumentation; most of that
decode's CPU in the kernel) and ~114 faults in 10 s in another: how often torch's blocks get reused depends on the order of the
allocations, and this module takes that out of it. The values and every torch operation on the
tensor are the same; the alignment is malloc's 16 bytes (the C kernels need 4, their streaming
stores 16)."""
from __future__ import annotations

import numpy as np
import torch

MIN_BYTES = 1 << 20
"""Smaller vectors come from torch's allocator as before (its small blocks are reused)."""


def empty(numel: int) -> torch.Tensor:
    """An uninitialised 1-D float32 CPU tensor of ``numel`` values."""
    if 4 * numel < MIN_BYTES:
        return torch.empty(numel, dtype=torch.float32)
    return torch.from_numpy(np.empty(numel, dtype=np.float32))


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """``empty(t.numel())`` shaped like ``t`` where ``t`` is a float32 CPU tensor, else
    ``torch.empty_like(t)``."""
    if t.device.type != "cpu" or t.dtype != torch.float32:
        return torch.empty_like(t)
    return empty(t.numel()).view(t.shape)
