"""Devices the CUDA tests run on: every test runs its CPU case here (so its logic is proven on
the CPU) and its CUDA case where torch sees a GPU (issue 33's GPU machine)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_cuda)]
"""Parametrize a test over ``device``: the CPU case runs everywhere, the CUDA case skips without a GPU."""


SPIN_CYCLES = 400_000_000
"""GPU clock cycles of ``delay``: 0.2-0.4 s on a 1-2 GHz GPU."""


def delay(device: torch.device, stream: Any = None) -> None:
    """Queue a fraction of a second of busy GPU work (``SPIN_CYCLES``) on ``stream`` (the current
    one by default), so that work queued after it is still pending when the host looks; a no-op
    on the CPU."""
    if device.type != "cuda":
        return
    cycles = SPIN_CYCLES
    with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(device)):
        torch.cuda._sleep(cycles)
