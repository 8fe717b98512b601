"""Large float32 host vectors from ``malloc`` (numpy's allocator) instead of torch's.

torch's CPU allocator asks glibc for 64-byte-aligned blocks (``posix_memalign``). A freed block
of a fragment's size is then too small for the next aligned request of the same size (which
needs the alignment's slack on top), so glibc carves each new one from fresh memory, zero-filled
page by page on first touch, and the freed ones pile up until they coalesce. A learner makes such a
vector at every merge it receives (the new base) and every answer (the snapshot); a shard at every
merge (the new replica). Measured at 10^8 parameters in ``ddloco bench sync`` (session 7,
docs/results/scale.md): the network thread's decode of a merge took 4.3 ms of CPU, 70 % of it in
the kernel's page faults (299 faults per merge), against 1.6 ms from ``malloc``, whose freed block
of the same size is simply reused (13 faults per merge). The values and every torch operation on
the tensor are the same; the alignment is malloc's 16 bytes (the C kernels need 4, their
streaming stores 16)."""
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
