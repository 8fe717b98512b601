"""common.hostmem: fragment-sized float32 host vectors from malloc (numpy), small ones from torch."""
from __future__ import annotations

import torch

from common import hostmem


def test_large_vectors_come_from_numpy_and_behave_as_torch_tensors() -> None:
    n = hostmem.MIN_BYTES // 4 + 3
    t = hostmem.empty(n)
    assert t.dtype == torch.float32 and t.shape == (n,) and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % 16 == 0                       # the streaming stores' alignment
    t.fill_(2.0)
    assert float((t * 3).sum()) == 6.0 * n


def test_small_vectors_and_other_kinds_keep_torch_s_allocator() -> None:
    small = hostmem.empty(16)
    assert small.dtype == torch.float32 and small.shape == (16,)
    like = hostmem.empty_like(torch.zeros(2, hostmem.MIN_BYTES // 4, dtype=torch.float32))
    assert like.shape == (2, hostmem.MIN_BYTES // 4) and like.dtype == torch.float32
    half = hostmem.empty_like(torch.zeros(hostmem.MIN_BYTES, dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16 and half.shape == (hostmem.MIN_BYTES,)
