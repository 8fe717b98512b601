"""The shard's merge path (issue "The sync path at the memory limit"): finiteness answered by the
decoder and the broadcast's encoder instead of passes of their own."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from common import quant, wire
from common.config import AlgoConfig
from common.fragments import Fragment, Piece, TensorSpec
from common.robust import NormClipper, fair_weights
from syncer import merging
from syncer.state import Answer, MergeInput

_BUILT = quant._kernels


@pytest.fixture(params=["c", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "c" and _BUILT is None:
        pytest.skip("common._qkernels is not built here")
    monkeypatch.setattr(quant, "_kernels", _BUILT if request.param == "c" else None)
    return request.param


def _bf16_bits(x: float) -> int:
    return int(torch.tensor([x]).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_a_finite_scale_whose_codes_would_overflow_is_refused_by_the_decoder(codec: str, impl: str) -> None:
    """A bf16 scale is finite up to 3.4e38, but 8 × (int4) or 128 × (int8) that is inf: such a
    payload is refused as non-finite (the shard no longer checks decoded values itself), while
    the largest scale whose codes all stay finite decodes."""
    top = 8 if codec == "int4" else 128
    limit = float(np.finfo(np.float32).max) / top
    n = 64
    values_nbytes, _ = quant._frame_nbytes(n, codec)
    codes = bytes([0x88] * values_nbytes) if codec == "int4" else bytes([0x80] * values_nbytes)  # q = -8 / -128
    below = torch.tensor([limit]).to(torch.bfloat16)
    if float(below) > limit:                       # rounded up: the next bf16 below it
        below = (below.view(torch.int16) - 1).view(torch.bfloat16)
    ok = quant.decode([codes, below.view(torch.int16).numpy().tobytes()], codec, n)
    assert bool(torch.isfinite(ok).all()) and float(ok.abs().max()) > 1e37
    for big in (float((below.view(torch.int16) + 1).view(torch.bfloat16)), 3.3e38, -3.3e38):
        scale = np.array([_bf16_bits(big)], dtype=np.uint16).view(np.int16).tobytes()
        with pytest.raises(quant.NonFiniteError):
            quant.decode([codes, scale], codec, n)
        frames = wire.encode(kind=wire.UPDATE, run="r", sender="l", fragment=0, codec=codec,
                             encoded=([codes, scale], n), round=1, base=0, steps=1, tokens=1)
        with pytest.raises(wire.NonFinitePayload):
            wire.decode(frames).values()


def _job(n: int, downlink: str, answers: int = 3) -> MergeInput:
    per = n // 4
    spec = Fragment(0, tuple(Piece(TensorSpec(f"w{i}", (per,)), 0, per) for i in range(4)))
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(per * 4, generator=g)
    ans = tuple(Answer(sender=f"l{i}", base=0, steps=12, tokens=12 * 64, delta=0.01 * torch.randn(per * 4, generator=g),
                       received_at=0.0, clip_steps=12.0) for i in range(answers))
    w, _ = fair_weights([a.tokens for a in ans], [a.steps for a in ans])
    return MergeInput(spec=spec, theta=theta, master=None, momentum=torch.zeros(per * 4), bases={0: theta.clone()},
                      answers=ans, weights=w, clipper=NormClipper(), algo=dataclasses.replace(AlgoConfig(), downlink_codec=downlink),
                      version=0, epoch=1, run_id="r", sender="s", scratch=threading.local(), largest_numel=per * 4)


@pytest.mark.parametrize("downlink", ["fp32", "bf16", "int4"])
def test_a_merge_whose_outer_step_is_not_finite_is_dropped_not_broadcast(downlink: str, impl: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The broadcast's encoder is what checks the new Θ (in the pass that encodes it): a NaN or
    inf from the outer step drops the merge (no value, no frames) in every downlink codec."""
    good = merging.compute_merge(_job(256, downlink))
    assert good.frames and good.replica is not None and bool(torch.isfinite(good.replica).all())
    step = merging.outer_step
    for bad in (float("nan"), float("inf")):
        def poisoned(*args, **kw):
            theta, momentum = step(*args, **kw)
            theta = theta.clone()
            theta[17] = bad
            return theta, momentum
        monkeypatch.setattr(merging, "outer_step", poisoned)
        res = merging.compute_merge(_job(256, downlink))
        assert res.replica is None and res.frames == [], (downlink, bad)
