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


# --------------------------------------------------------------------------- the round kernels
def _spans(numel: int) -> list[tuple[int, int, str]]:
    """Pieces of every kind, a gap, one piece longer than the kernels' tile, odd lengths."""
    kinds = [(5000, "param"), (7, "param"), (300, "embedding"), (64, "buffer"), (3, "int_buffer"),
             (1, "param"), (2111, "param")]
    spans, at = [], 0
    for i, (length, kind) in enumerate(kinds):
        if i == 3:
            at += 9                       # a gap no piece covers
        spans.append((at, at + length, kind))
        at += length
    assert at == numel
    return spans


NUMEL = 5000 + 7 + 300 + 9 + 64 + 3 + 1 + 2111


def _round(codec: str, seed: int) -> tuple[torch.Tensor, dict[int, torch.Tensor], list[tuple[str, int, object, float]]]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(NUMEL, generator=g)
    bases = {3: theta - 0.01 * torch.randn(NUMEL, generator=g), 4: theta.clone()}
    answers = []
    for i in range(6):
        d = 0.02 * torch.randn(NUMEL, generator=g) * (1 + i)          # growing norms: some get clipped
        if i == 4:
            d[5300:5364] += 50.0                                        # its float buffers move wildly
        frames = quant.encode(d, codec) if codec != "fp32" else None
        delta = quant.encoded(frames, codec, NUMEL) if frames else d
        answers.append((f"l{i}", 3 + i % 2, delta, 24.0))
    return theta, bases, answers


def _merge(theta, bases, answers, *, whole: bool, scratch: bool = False):
    from common.merge import OuterAccumulator
    from common.robust import fold_round
    garbage = (torch.full((NUMEL,), float("nan")), torch.full((NUMEL,), 3.0)) if scratch else None  # a reused merge's leftovers
    acc = OuterAccumulator(NUMEL, _spans(NUMEL), "rda", robust_buffers=True, robust_radius=True, scratch=garbage)
    if not whole:
        acc.round_kernels = lambda *a: False                            # answer by answer, decoded
    clipper = NormClipper(min_samples=2)
    for sender in ("l0", "l1", "l2"):                                   # a history: the bound is known
        clipper.observe(1.0, None, 24.0, learner=sender)
        clipper.observe(1.2, None, 24.0, learner=sender)
    weights = [0.1, 0.25, 0.15, 0.2, 0.1, 0.2]
    scales = fold_round(acc, theta, [(s, bases[b], d, st) for s, b, d, st in answers], weights, clipper,
                        buffer_ceiling=100.0)
    return acc.result().clone(), scales, list(acc.radius), acc.weight_sum, acc.count


@pytest.mark.parametrize("codec", ["int4", "int8", "fp32"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_round_kernels_merge_bit_identically_to_the_answer_by_answer_path(codec: str, seed: int) -> None:
    """measure_round / fold_round (every answer tile by tile, int8/int4 decoded a tile at a time)
    against measure / fold of each decoded answer, as the shard merged before: the same merged
    outer gradient to the bit, the same clip scales (some < 1, one answer left out for its
    buffers), radii and weights; also into scratch buffers left over from another merge (NaN),
    which the first answer overwrites instead of a zeroing pass."""
    if _BUILT is None:
        pytest.skip("common._qkernels is not built here")
    theta, bases, answers = _round(codec, seed)
    old = _merge(theta, bases, answers, whole=False)
    for scratch in (False, True):    # fresh zeros, or scratch buffers the first answer overwrites
        new = _merge(theta, bases, answers, whole=True, scratch=scratch)
        assert new[1] == old[1] and any(0 < s < 1 for s in new[1]) and 0.0 in new[1], (new[1], old[1])
        assert torch.equal(new[0].view(torch.int32), old[0].view(torch.int32)), \
            (scratch, float((new[0] - old[0]).abs().max()))
        assert new[2:] == old[2:]


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_the_fused_update_encoder_writes_the_bytes_and_values_of_the_two_step_one(codec: str) -> None:
    if _BUILT is None:
        pytest.skip("common._qkernels is not built here")
    g = torch.Generator().manual_seed(5)
    for n in (1, 63, 64, 65, 1000, 4095, 4096, 4097, 70001):
        replica = torch.randn(n, generator=g)
        master = replica + 0.01 * torch.randn(n, generator=g)
        out, frames = quant.encode_update(master, replica, codec)
        ref_frames = quant.encode(master - replica, codec)
        ref = replica + quant.decode(ref_frames, codec, n)
        assert [bytes(f) for f in frames] == [bytes(f) for f in ref_frames], n
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), n
    master[3] = float("nan")
    with pytest.raises(quant.NonFiniteError):
        quant.encode_update(master, replica, codec)


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_an_encoded_vector_decodes_any_slice_as_the_whole_decode_does(codec: str) -> None:
    if _BUILT is None:
        pytest.skip("common._qkernels is not built here")
    n = 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    vec = quant.encoded(quant.encode(x, codec), codec, n)
    whole = vec.decode()
    for a, b in ((0, n), (0, 1), (63, 65), (64, 128), (100, 999), (999, 1000), (500, 500), (960, 1000)):
        assert torch.equal(vec[a:b], whole[a:b]), (a, b)


@pytest.mark.parametrize("downlink", ["int4", "fp32"])
def test_compute_merge_on_encoded_answers_equals_it_on_decoded_ones(downlink: str) -> None:
    """The shard's merge of int4 answers kept encoded (as intake now hands them over) and of the
    same answers decoded: the same replica, master and broadcast bytes."""
    if _BUILT is None:
        pytest.skip("common._qkernels is not built here")
    job = _job(4096 * 3 + 40, downlink, answers=5)
    encoded = tuple(dataclasses.replace(a, delta=quant.encoded(quant.encode(a.delta, "int4"), "int4", a.delta.numel()))
                    for a in job.answers)
    decoded = tuple(dataclasses.replace(a, delta=a.delta.decode()) for a in encoded)
    res = [merging.compute_merge(dataclasses.replace(job, answers=ans, clipper=NormClipper(), scratch=threading.local()))
           for ans in (encoded, decoded)]
    assert torch.equal(res[0].replica.view(torch.int32), res[1].replica.view(torch.int32))
    assert (res[0].master is None) == (res[1].master is None)
    if res[0].master is not None:
        assert torch.equal(res[0].master.view(torch.int32), res[1].master.view(torch.int32))
    assert [bytes(memoryview(f)) for f in res[0].frames[2:]] == [bytes(memoryview(f)) for f in res[1].frames[2:]]


def test_the_outer_step_without_momentum_takes_one_pass_and_the_values_of_clone_then_step() -> None:
    from common.merge import outer_nesterov_step, outer_step
    g = torch.Generator().manual_seed(9)
    for n, lr in ((1, 1.0), (1000, 0.7), (100_003, 0.123456789)):
        theta, grad = torch.randn(n, generator=g), 1e-3 * torch.randn(n, generator=g)
        spans = [(0, n, "param")]
        algo = dataclasses.replace(AlgoConfig(), outer_lr=lr, outer_momentum=0.0)
        new, momentum = outer_step(theta, torch.zeros(1).expand(n), grad, spans, algo, merges_done=10_000)
        ref = theta.clone()
        outer_nesterov_step(ref, torch.zeros(n), grad, lr=lr, momentum_coef=0.0)
        assert torch.equal(new.view(torch.int32), ref.view(torch.int32)) and new.data_ptr() != theta.data_ptr()


def test_a_checkpoint_file_is_checked_against_its_values_digests(tmp_path) -> None:
    """Written without torch.save's zip CRC (which torch.load never checks: a flipped byte loaded
    silently before), with a digest of each fragment's values that loading checks: one changed
    byte in a value is refused naming the fragment; a checkpoint from before digests still loads."""
    import torch as t
    from syncer.checkpoints import CheckpointMismatch, load_checkpoint_file, save_checkpoint_file
    state = {"fragments": {p: {"theta": t.randn(50_000), "master": t.randn(50_000), "version": 7} for p in (0, 2)}}
    path = tmp_path / "c.pt"
    nbytes = save_checkpoint_file(state, path)
    assert nbytes == path.stat().st_size
    back = load_checkpoint_file(path)
    assert all(t.equal(back["fragments"][p]["theta"], state["fragments"][p]["theta"]) for p in (0, 2))
    data = bytearray(path.read_bytes())
    at = data.find(state["fragments"][2]["master"][1000:1004].numpy().tobytes())   # a value of fragment 2's master
    assert at > 0
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointMismatch, match="damaged: fragment 2/master"):
        load_checkpoint_file(path)
    t.save(state, tmp_path / "old.pt")                  # written before digests existed
    assert load_checkpoint_file(tmp_path / "old.pt")["fragments"][0]["version"] == 7
