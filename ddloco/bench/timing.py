"""Timing helpers of the micro benchmarks (``ddloco bench``): a median over repeats, and the
physical baseline most figures are divided by (a memcpy of the same fp32 values)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0


def memcpy_ms(numel: int, repeats: int) -> float:
    """A copy of ``numel`` fp32 values into a buffer allocated once: the baseline the codec and
    merge figures are divided by (``*_vs_memcpy`` = memcpy time ÷ their time, 1 = as fast)."""
    src, dst = torch.randn(numel), torch.empty(numel)
    return _median_ms(lambda: dst.copy_(src), repeats)
