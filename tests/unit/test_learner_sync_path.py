"""The learner's sync path in one pass per fragment (issue "The sync path at the memory limit"):
an answer's codes of snapshot − base, a broadcast update added to the base as it is decoded, and
the carry made on the model's tensors in place, each bit-identical to the unfused expressions
they replace (learners and shards must hold bit-identical replicas), with the C kernels and with
the torch fallback (``impl``)."""
from __future__ import annotations

import os
import queue
import threading
from typing import Any

import numpy as np
import pytest
import torch

from common import boundary, quant, wire
from common.fragments import TensorSpec, gather, model_plan, plan_fragments, state_tensors
from common.merge import Contribution, carry_local_steps, carry_local_steps_, receive_merged
from learner.exchange import Exchange, carry_into
from learner.messages import FragmentArrived, RoundOpened
from learner.receipt import Carry, Receipt

pytestmark = pytest.mark.timeout(60)

_BUILT = quant._kernels
SIZES = [1, 5, 63, 64, 65, 1000, 4096, 4097, 3 * 4096 + 77]   # 4096 values: one chunk of the C kernels


@pytest.fixture(autouse=True, params=["c", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the C kernels, then with the torch implementation."""
    if request.param == "c":
        if _BUILT is None or not hasattr(_BUILT, "encode_diff"):
            pytest.skip("common._qkernels (with the learner's kernels) is not built here")
        monkeypatch.setattr(quant, "_kernels", _BUILT)
    else:
        monkeypatch.setattr(quant, "_kernels", None)
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _pair(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(θ, Θ_base): a base whose blocks differ in magnitude by orders, θ a few steps away, a zero
    block (θ = base) and a block of underflowing differences."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g).float()
    theta = base + 1e-3 * torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 2, (n,), generator=g).float()
    theta[64:128] = base[64:128]
    theta[128:192] = base[128:192] + 1e-39
    return theta, base


@pytest.mark.parametrize("codec", ["int4", "int8"])
@pytest.mark.parametrize("n", SIZES)
def test_an_answer_is_quantised_as_it_is_subtracted_to_the_same_bytes(codec: str, n: int, impl: str) -> None:
    theta, base = _pair(n, n)
    old = quant.encode(theta - base, codec)
    new = quant.encode_diff(theta, base, codec)
    if impl == "torch":
        assert new is None         # the caller subtracts and encodes
        return
    assert [bytes(f) for f in new] == [bytes(f) for f in old]


@pytest.mark.parametrize("a, b", [(float("nan"), 0.0), (0.0, float("inf")), (3e38, -3e38)],
                         ids=["nan", "inf", "overflow"])
def test_a_non_finite_difference_is_refused_by_the_one_pass_encoder(a: float, b: float, impl: str) -> None:
    theta, base = torch.zeros(130), torch.zeros(130)
    theta[70], base[70] = a, b
    with pytest.raises(quant.NonFiniteError):
        quant.encode(theta - base, "int4")
    if impl == "c":
        with pytest.raises(quant.NonFiniteError):
            quant.encode_diff(theta, base, "int4")


@pytest.mark.parametrize("codec", ["int4", "int8"])
@pytest.mark.parametrize("n", SIZES)
def test_an_update_is_added_to_the_base_as_it_is_decoded_to_the_same_bits(codec: str, n: int, impl: str) -> None:
    theta, base = _pair(n, n + 1)
    frames = [bytes(f) for f in quant.encode(theta - base, codec)]
    old = base + quant.decode(frames, codec, n)
    new = quant.decode_add(frames, codec, n, base)
    if impl == "torch":
        assert new is None
    else:
        assert torch.equal(_bits(new), _bits(old))
    msg = wire.decode(wire.encode(kind=wire.FRAG, run="r", sender="s", fragment=0, encoded=(frames, n), codec=codec,
                                  version=2, base=1))
    out = torch.empty(n)
    assert msg.values_added_to(base, out=out) is out and torch.equal(_bits(out), _bits(old))
    assert torch.equal(_bits(msg.values_added_to(base)), _bits(old))


def test_an_update_whose_scales_would_overflow_is_refused_and_nothing_is_written(impl: str) -> None:
    base = torch.ones(64)
    big = np.array([0x7F7F], dtype=np.uint16).view(np.int16).tobytes()      # bf16 ~3.4e38: 7 × it overflows
    frames = [b"\x77" * 32, big]
    out = torch.full((64,), 5.0)
    msg = wire.decode(wire.encode(kind=wire.FRAG, run="r", sender="s", fragment=0, encoded=(frames, 64),
                                  codec="int4", version=2, base=1))
    with pytest.raises(wire.NonFinitePayload):
        msg.values_added_to(base, out=out)
    assert torch.equal(out, torch.full((64,), 5.0))


@pytest.mark.parametrize("n", SIZES)
def test_the_carry_in_place_gives_the_bits_of_the_carry_on_a_copy(n: int, impl: str) -> None:
    theta, ref = _pair(n, 3)
    merged = ref + torch.randn(n) * 1e-2
    old = carry_local_steps(merged, theta, ref)
    local = theta.clone()
    assert carry_local_steps_(local, merged, ref) is local
    assert torch.equal(_bits(local), _bits(old))


@pytest.mark.parametrize("n", [quant.STREAM_MIN_BYTES // 4 - 1, quant.STREAM_MIN_BYTES // 4 + 3])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_a_large_snapshot_copy_gives_the_same_values_aligned_or_not(n: int, offset: int, impl: str) -> None:
    """The snapshot's copy (streaming stores from 1 MiB on, a tail that is not a multiple of 4, a
    destination that is not 16-byte aligned) writes exactly the source, as gather always did."""
    src = torch.randn(n + offset)[offset:]
    dst = torch.full((n + 1,), float("nan"))[offset:offset + n]
    served = quant.copy_into(dst, src)
    assert served == (impl == "c" and 4 * n >= quant.STREAM_MIN_BYTES)
    if served:
        assert torch.equal(_bits(dst), _bits(src))
    (frag,) = plan_fragments([TensorSpec("w", (n,)), TensorSpec("x", (3,))], 1, align=64)
    flat = gather({"w": src.clone(), "x": torch.ones(3)}, frag)
    assert torch.equal(_bits(flat[:n]), _bits(src)) and torch.equal(flat[frag.spans[1][0]:], torch.ones(3))


@pytest.mark.parametrize("codec", quant.CODECS)
@pytest.mark.parametrize("n", [65, 4097])
def test_the_network_thread_sends_the_same_answer_payload_for_every_codec(codec: str, n: int, impl: str) -> None:
    from learner.network import NetworkThread
    net = NetworkThread.__new__(NetworkThread)
    net.codec, net._delta = codec, None
    theta, base = _pair(n, 7)
    assert [bytes(f) for f in net._encode_delta(theta, base)] == [bytes(f) for f in quant.encode(theta - base, codec)]


class _Model(torch.nn.Module):
    """Pieces of lengths that are not multiples of the block (alignment gaps in the fragments), a
    float buffer, and an int buffer (its fragment takes the gather/scatter path)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(37, 129, generator=g))
        self.b = torch.nn.Parameter(torch.randn(1001, generator=g))
        self.c = torch.nn.Parameter(torch.randn(70, 70, generator=g))
        self.register_buffer("mean", torch.randn(333, generator=g))
        self.register_buffer("count", torch.tensor([7], dtype=torch.int64))


class _Host(Exchange):
    """The part of a learner that applies merged fragments, on the host, with one process."""

    def __init__(self, model: torch.nn.Module, n_fragments: int) -> None:
        self.model = model
        self.tensors = state_tensors(model)
        self.plan = model_plan(model, (), n_fragments)
        self.receipt = Receipt(n_fragments, carry=True)
        self._staging = self.group = self._gathered = None
        self._deferring = False
        self._outbox = queue.SimpleQueue()
        self.device = torch.device("cpu")


def _apply_a_round(in_place: bool) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """Join, train, answer fragment 0, train more, receive a merge of every fragment: the model's
    state after it, and whether each fragment took the in-place carry."""
    host = _Host(_Model(), 3)
    rc, plan = host.receipt, host.plan
    for p, f in enumerate(plan):
        host._apply(FragmentArrived(p, 1, 5, gather(host.tensors, f), True), joining=True)
    g = torch.Generator().manual_seed(1)

    def train() -> None:
        with torch.no_grad():
            for t in host.tensors.values():
                t.add_(torch.randn(t.shape, generator=g) * 1e-3 if t.is_floating_point() else 1)
        rc.count_step(16)

    train()
    rc.on_open(RoundOpened(0, 1, round=1, attempt=0, version=5), 0.0)
    for o in rc.rounds_to_answer(1):
        rc.contribute(o, host._local_values(o.fragment))
    train()
    host._carries_in_place = (lambda p: Exchange._carries_in_place(host, p)) if in_place else (lambda p: False)
    taken = [host._carries_in_place(p) for p in range(len(plan))]
    for p, f in enumerate(plan):
        merged = gather(host.tensors, f) + torch.randn(f.numel, generator=g) * 1e-2
        host._apply(FragmentArrived(p, 1, 6, merged, False))
    return {k: v.detach().clone() for k, v in host.tensors.items()}, taken


def test_a_learner_applies_a_merge_in_place_to_the_bits_of_the_gathered_path(impl: str) -> None:
    new, taken = _apply_a_round(in_place=True)
    old, _ = _apply_a_round(in_place=False)
    assert taken.count(True) == 2 and taken.count(False) == 1, taken   # the int buffer's fragment is copied
    for name in old:
        assert torch.equal(new[name].view(-1).view(torch.int32) if new[name].is_floating_point() else new[name],
                           old[name].view(-1).view(torch.int32) if old[name].is_floating_point() else old[name]), name


def test_a_carry_in_place_keeps_the_counters_of_the_steps_not_answered(impl: str) -> None:
    rc = Receipt(1, carry=True)
    base = torch.zeros(4)
    rc.receive(FragmentArrived(0, 1, 3, base, True), now=0.0, local=lambda p: base, joining=True)
    rc.count_step(8)
    rc.count_step(8)
    rc.on_open(RoundOpened(0, 1, round=1, attempt=0, version=3), 0.0)
    (o,) = rc.rounds_to_answer(1)
    snapshot = torch.full((4,), 0.5)
    rc.contribute(o, snapshot)
    rc.count_step(8)
    got = rc.receive(FragmentArrived(0, 1, 4, torch.ones(4), False), now=0.0, local=None, carry_in_place=True)
    assert isinstance(got, Carry) and got.reference is snapshot and torch.equal(got.merged, torch.ones(4))
    assert (int(rc.c_steps[0]), int(rc.c_tokens[0])) == (1, 8)
    value, steps, tokens = receive_merged(torch.ones(4), torch.full((4,), 0.7), base, Contribution(snapshot, 2, 16),
                                          3, 24, carry=True)
    assert (steps, tokens) == (1, 8)
    theta = torch.full((4,), 0.7)
    carry_into({"x": theta}, plan_fragments([TensorSpec("x", (4,))], 1)[0], got)
    assert torch.equal(theta, value)


@pytest.mark.parametrize("threads", ["1", "3", "8"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_the_boundary_passes_split_over_threads_give_the_same_bits(threads: str, offset: int, impl: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot's copy and the carry, split in slices over ``DDLOCO_BOUNDARY_THREADS`` threads
    (a many-core learner's idle training threads at a step boundary), write what one pass writes,
    into destinations aligned for streaming stores or not."""
    if impl == "torch":
        pytest.skip("the split runs the C kernels")
    monkeypatch.setenv("DDLOCO_BOUNDARY_THREADS", threads)
    n = 8 * boundary.SPLIT_MIN_BYTES // 4 + 37                  # room for 8 slices, and a tail
    theta, ref = _pair(n + offset, 11)
    theta, ref = theta[offset:], ref[offset:]
    merged = ref + 1e-2
    want = carry_local_steps(merged, theta, ref)
    before = boundary._SPLITTER.split_calls
    got = torch.empty(n + offset)[offset:]
    got.copy_(theta)
    carry_local_steps_(got, merged, ref)
    dst = torch.full((n + 1,), float("nan"))[offset:offset + n]
    assert quant.copy_into(dst, theta)
    assert boundary._SPLITTER.split_calls - before == (0 if threads == "1" else 2)
    assert threads == "1" or boundary._SPLITTER._workers >= int(threads) - 1
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(dst), _bits(theta))


def test_a_split_pass_refuses_mismatched_vectors_whole_and_waits_for_every_slice(impl: str,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if impl == "torch":
        pytest.skip("the split runs the C kernels")
    monkeypatch.setenv("DDLOCO_BOUNDARY_THREADS", "4")
    n = 4 * boundary.SPLIT_MIN_BYTES // 4
    dst = np.full(n, 7.0, dtype=np.float32)
    with pytest.raises(ValueError):
        boundary.split_run(quant._kernels.copy, dst, np.zeros(n - 16, dtype=np.float32))
    assert (dst == 7.0).all()                                   # nothing written
    done: list[int] = []
    failed = threading.Event()

    def kernel(out: Any, src: Any) -> None:   # the main thread's slice fails; the others go on after it
        if out.__array_interface__["data"][0] == dst.ctypes.data:
            failed.set()
            raise ValueError("first slice")
        assert failed.wait(30)
        quant._kernels.copy(out, src)
        done.append(len(out))

    with pytest.raises(ValueError, match="first slice"):
        boundary.split_run(kernel, dst, np.ones(n, dtype=np.float32))
    assert sum(done) == n - len(dst[:n // 4 // 16 * 16])        # the other slices finished before it raised
    assert (dst[n // 4 // 16 * 16:] == 1.0).all()


def test_a_forked_process_makes_its_own_boundary_threads(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hot spare is forked from a factory that may have split a pass already: the pool it inherits
    has no threads, so the spare makes its own (else its first split pass would wait forever)."""
    import multiprocessing
    if impl == "torch":
        pytest.skip("the split runs the C kernels")
    monkeypatch.setenv("DDLOCO_BOUNDARY_THREADS", "2")
    n = boundary.SPLIT_MIN_BYTES // 2
    src = torch.randn(n)
    assert quant.copy_into(torch.empty(n), src) and boundary._SPLITTER._pool is not None

    def child(q: Any) -> None:   # numpy only: torch's OpenMP pool may not be usable after a fork
        dst, values = np.empty(n, dtype=np.float32), src.numpy()
        boundary.split_run(quant._kernels.copy, dst, values)
        q.put(bool(np.array_equal(dst, values)) and boundary._SPLITTER._pid == os.getpid())

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    assert q.get(timeout=30) is True
    p.join(30)
    assert p.exitcode == 0
