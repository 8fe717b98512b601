"""Merge math: contribution weights, radial-directional averaging, outer Nesterov step."""
from __future__ import annotations

import copy
import math
import threading

import pytest
import torch

from common.config import AlgoConfig
from common.merge import (
    carry_local_steps,
    contribution_weights,
    outer_lr_at,
    outer_update,
    merge_outer_gradients,
    outer_nesterov_step,
    radial_directional_average,
    weighted_average,
)


def test_weights_are_tokens_squared_over_steps_normalised() -> None:
    w = contribution_weights([100, 200, 300], [10, 20, 10])
    raw = torch.tensor([100**2 / 10, 200**2 / 20, 300**2 / 10], dtype=torch.float64)
    assert w.dtype == torch.float32 and w.shape == (3,)
    assert torch.allclose(w.double(), raw / raw.sum(), rtol=1e-6)
    assert w.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_learner_with_zero_steps_gets_zero_weight() -> None:
    w = contribution_weights([100, 0, 100], [10, 0, 10])
    assert w.tolist() == pytest.approx([0.5, 0.0, 0.5])
    w = contribution_weights([100, 50], [10, 0])          # tokens without steps: still 0
    assert w.tolist() == [1.0, 0.0]


def test_all_zero_weights_return_zeros() -> None:
    w = contribution_weights([0, 0], [0, 0])
    assert torch.equal(w, torch.zeros(2))
    assert contribution_weights([], []).shape == (0,)


def test_weights_reject_negative_or_mismatched_counts() -> None:
    with pytest.raises(ValueError, match="c_tokens"):
        contribution_weights([-1, 5], [1, 1])
    with pytest.raises(ValueError, match="c_steps"):
        contribution_weights([1, 5], [1, -1])
    with pytest.raises(ValueError, match="2 token counts but 3"):
        contribution_weights([1, 5], [1, 1, 1])


def test_rda_of_orthogonal_equal_norm_vectors_keeps_the_norm() -> None:
    m, n = 4, 16
    vectors = 3.0 * torch.eye(n)[:m]                      # orthogonal, norm 3
    weights = torch.full((m,), 1 / m)
    rda = radial_directional_average(vectors, weights)
    avg = weighted_average(vectors, weights)
    assert torch.linalg.vector_norm(rda).item() == pytest.approx(3.0, rel=1e-6)
    assert torch.linalg.vector_norm(avg).item() == pytest.approx(3.0 / math.sqrt(m), rel=1e-6)
    # Same direction as the plain average.
    assert torch.allclose(rda / rda.norm(), avg / avg.norm(), atol=1e-6)


def test_rda_of_identical_vectors_is_that_vector() -> None:
    v = torch.randn(50, generator=torch.Generator().manual_seed(1))
    vectors = v.expand(3, 50).clone()
    rda = radial_directional_average(vectors, torch.tensor([0.2, 0.3, 0.5]))
    assert torch.allclose(rda, v, rtol=1e-5, atol=1e-6)


def test_rda_norm_is_the_weighted_mean_norm() -> None:
    vectors = torch.tensor([[2.0, 0.0], [0.0, 6.0]])
    rda = radial_directional_average(vectors, torch.tensor([0.75, 0.25]))
    assert rda.norm().item() == pytest.approx(0.75 * 2 + 0.25 * 6, rel=1e-6)
    # Direction: 0.75*(1,0) + 0.25*(0,1), normalised.
    assert torch.allclose(rda / rda.norm(), torch.tensor([0.75, 0.25]) / math.hypot(0.75, 0.25))


def test_rda_falls_back_to_the_average_for_opposite_vectors() -> None:
    v = torch.tensor([1.0, -2.0, 3.0])
    vectors = torch.stack([v, -2.0 * v])                  # unit directions cancel
    weights = torch.tensor([0.5, 0.5])
    rda = radial_directional_average(vectors, weights)
    assert torch.allclose(rda, -0.5 * v)
    assert torch.equal(rda, weighted_average(vectors, weights))


def test_rda_treats_a_zero_vector_as_having_no_direction() -> None:
    vectors = torch.tensor([[0.0, 0.0], [4.0, 0.0]])
    rda = radial_directional_average(vectors, torch.tensor([0.5, 0.5]))
    assert not bool(torch.isnan(rda).any())
    assert torch.allclose(rda, torch.tensor([2.0, 0.0]))
    zeros = radial_directional_average(torch.zeros(2, 3), torch.tensor([0.5, 0.5]))
    assert torch.equal(zeros, torch.zeros(3))


def test_merge_uses_average_for_embeddings_and_rda_elsewhere() -> None:
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(3, 30, generator=g)
    weights = torch.tensor([0.5, 0.3, 0.2])
    spans = [(0, 10, True), (10, 22, False), (22, 30, False)]
    merged = merge_outer_gradients(grads, weights, spans)
    assert merged.dtype == torch.float32 and merged.shape == (30,)
    assert torch.equal(merged[0:10], weighted_average(grads[:, 0:10], weights))
    assert torch.equal(merged[10:22], radial_directional_average(grads[:, 10:22], weights))
    assert torch.equal(merged[22:30], radial_directional_average(grads[:, 22:30], weights))
    # Per tensor, not over the whole fragment.
    whole = radial_directional_average(grads[:, 10:30], weights)
    assert not torch.allclose(merged[10:30], whole)


def test_merge_of_a_single_contributor_is_its_outer_gradient() -> None:
    grad = torch.randn(1, 20, generator=torch.Generator().manual_seed(2))
    merged = merge_outer_gradients(grad, torch.tensor([1.0]), [(0, 5, True), (5, 20, False)])
    assert torch.allclose(merged, grad[0], rtol=1e-6, atol=1e-7)


def test_merge_rejects_overlapping_or_overlong_spans_and_keeps_gaps_zero() -> None:
    grads, weights = torch.ones(2, 10), torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match="cover 12"):
        merge_outer_gradients(grads, weights, [(0, 12, "param")])
    with pytest.raises(ValueError, match="in order and disjoint"):
        merge_outer_gradients(grads, weights, [(0, 6, "param"), (5, 10, "param")])
    merged = merge_outer_gradients(grads, weights, [(0, 4, "param"), (8, 10, "param")])  # alignment gap
    assert torch.equal(merged[4:8], torch.zeros(4)) and torch.allclose(merged[:4], torch.ones(4))
    with pytest.raises(ValueError, match=r"\[M\]"):
        merge_outer_gradients(grads, torch.tensor([1.0]), [(0, 10, False)])


@pytest.mark.parametrize("lr,mu", [(0.7, 0.9), (0.1, 0.5), (1.0, 0.0), (0.3, 0.99)])
def test_outer_step_matches_torch_sgd_nesterov_bit_for_bit(lr: float, mu: float) -> None:
    g = torch.Generator().manual_seed(42)
    start = torch.randn(257, generator=g)
    theta = start.clone()
    momentum = torch.zeros_like(theta)
    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=lr, momentum=mu, nesterov=mu > 0)
    for step in range(25):
        grad = torch.randn(257, generator=g) * (0.5 + step)
        outer_nesterov_step(theta, momentum, grad, lr=lr, momentum_coef=mu)
        reference.grad = grad.clone()
        sgd.step()
        assert torch.equal(theta, reference.detach()), f"diverged at step {step}"
    if mu > 0:
        assert torch.equal(momentum, sgd.state[reference]["momentum_buffer"])


def test_outer_step_rejects_bad_arguments() -> None:
    theta, b = torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        outer_nesterov_step(theta, b, torch.zeros(4), lr=0.7, momentum_coef=0.9)
    with pytest.raises(ValueError, match="momentum_coef"):
        outer_nesterov_step(theta, b, torch.zeros(3), lr=0.7, momentum_coef=1.0)
    with pytest.raises(ValueError, match="lr"):
        outer_nesterov_step(theta, b, torch.zeros(3), lr=0.0, momentum_coef=0.9)


def test_plain_momentum_matches_torch_sgd_without_nesterov() -> None:
    g = torch.Generator().manual_seed(3)
    start = torch.randn(64, generator=g)
    theta, momentum = start.clone(), torch.zeros(64)
    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.5, momentum=0.6, nesterov=False)
    for step in range(10):
        grad = torch.randn(64, generator=g)
        outer_nesterov_step(theta, momentum, grad, lr=0.5, momentum_coef=0.6, nesterov=False)
        reference.grad = grad.clone()
        sgd.step()
        assert torch.equal(theta, reference.detach()), f"diverged at step {step}"


def test_mean_rule_averages_where_rda_keeps_the_radius() -> None:
    grads = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    w = torch.tensor([0.5, 0.5])
    mean = merge_outer_gradients(grads, w, [(0, 2, False)], "mean")
    rda = merge_outer_gradients(grads, w, [(0, 2, False)], "rda")
    assert mean.tolist() == [0.5, 0.5]
    assert float(rda.norm()) == pytest.approx(1.0) and float(mean.norm()) == pytest.approx(math.sqrt(0.5))
    with pytest.raises(ValueError, match="merge rule"):
        merge_outer_gradients(grads, w, [(0, 2, False)], "median")


def test_outer_lr_warms_up_linearly_over_merges() -> None:
    assert [outer_lr_at(1.0, k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert outer_lr_at(0.7, 0, 0) == 0.7


def test_outer_update_leaves_its_inputs_alone_and_a_unit_step_lands_on_the_learner() -> None:
    theta, momentum = torch.tensor([1.0, 2.0]), torch.zeros(2)
    learner = torch.tensor([0.5, 2.5])
    new_theta, new_mom = outer_update(theta, momentum, (theta - learner).unsqueeze(0), torch.tensor([1.0]),
                                      [(0, 2, False)], AlgoConfig(outer_lr=1.0, outer_momentum=0.0))
    assert theta.tolist() == [1.0, 2.0] and momentum.tolist() == [0.0, 0.0]
    assert torch.allclose(new_theta, learner)


def test_carry_keeps_the_steps_after_the_reference() -> None:
    merged, local, ref = torch.tensor([1.0, 1.0]), torch.tensor([0.3, 0.7]), torch.tensor([0.1, 0.2])
    assert torch.allclose(carry_local_steps(merged, local, ref), torch.tensor([1.2, 1.5]))
    assert torch.equal(carry_local_steps(merged, ref, ref), merged)   # nothing since: overwrite


def test_buffers_take_the_learners_weighted_average_and_counters_the_largest_value() -> None:
    from common.config import AlgoConfig
    from common.merge import outer_update
    theta = torch.tensor([1.0, 1.0, 5.0, 10.0])
    momentum = torch.tensor([0.3, 0.3, 0.3, 0.3])
    learners = torch.tensor([[0.0, 2.0, 7.0, 14.0],     # each learner's value: base + delta
                             [2.0, 4.0, 9.0, 12.0]])
    outer = theta - learners                             # Δ_m = Θ − value_m
    weights = torch.tensor([0.75, 0.25])
    spans = [(0, 2, "param"), (2, 3, "buffer"), (3, 4, "int_buffer")]
    algo = AlgoConfig(outer_lr=0.7, outer_momentum=0.9, merge_rule="mean")
    new, mom = outer_update(theta, momentum, outer, weights, spans, algo)
    assert new[2].item() == pytest.approx(0.75 * 7 + 0.25 * 9)      # no outer lr, no momentum
    assert new[3].item() == 14.0                                     # the largest learner value
    assert torch.equal(mom[2:], torch.zeros(2))
    assert not torch.allclose(new[:2], weights @ learners[:, :2])   # parameters still take the outer step


def test_inner_learning_rate_follows_the_run_schedule_on_global_tokens() -> None:
    from common.config import AlgoConfig
    from learner.inner import lr_at, schedule_factor
    cos = AlgoConfig(inner_lr=1e-3, lr_schedule="cosine", lr_warmup_tokens=100, lr_decay_tokens=1100,
                     lr_min_ratio=0.1, inner_warmup_steps=1)
    assert schedule_factor(cos, 0) == 0.0 and schedule_factor(cos, 50) == pytest.approx(0.5)
    assert schedule_factor(cos, 100) == pytest.approx(1.0)
    assert schedule_factor(cos, 600) == pytest.approx(0.1 + 0.9 * 0.5)          # half-way: cos(pi/2) = 0
    assert schedule_factor(cos, 1100) == pytest.approx(0.1) == schedule_factor(cos, 5000)
    lin = AlgoConfig(lr_schedule="linear", lr_decay_tokens=1000, lr_min_ratio=0.0)
    assert schedule_factor(lin, 250) == pytest.approx(0.75)
    assert schedule_factor(AlgoConfig(), 10**9) == 1.0                           # constant by default
    ramp = AlgoConfig(inner_lr=1e-3, inner_warmup_steps=4)                       # per-life ramp (fresh AdamW)
    assert [lr_at(ramp, 10**6, s) for s in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    from common.config import ConfigError
    with pytest.raises(ConfigError, match="lr_decay_tokens must exceed"):
        AlgoConfig(lr_schedule="cosine", lr_warmup_tokens=10, lr_decay_tokens=5)


def test_apply_step_clips_the_gradient_norm() -> None:
    from common.config import AlgoConfig
    from learner.inner import apply_step, make_inner_optimizer
    model = torch.nn.Linear(4, 4)
    opt, sched = make_inner_optimizer(model.parameters(), AlgoConfig(inner_grad_clip=0.5, inner_warmup_steps=1))
    (model(torch.ones(2, 4)) * 1000).sum().backward()
    apply_step(model, opt, sched, AlgoConfig(inner_grad_clip=0.5))
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert norm == pytest.approx(0.5, rel=1e-4)


def test_rda_falls_back_to_the_average_when_the_directions_nearly_cancel() -> None:
    v = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    noise = 1e-9 * torch.randn(1000, generator=torch.Generator().manual_seed(4))
    vectors = torch.stack([v, -v + noise])            # opposite up to rounding-size noise
    weights = torch.tensor([0.5, 0.5])
    merged = radial_directional_average(vectors, weights)
    # rescaling the tiny residual direction to the full radius would invent a step of norm ~|v|
    assert torch.allclose(merged, weighted_average(vectors, weights), atol=1e-6)
    assert torch.linalg.vector_norm(merged) < 1e-6


@pytest.fixture(params=["c", "torch"])
def accumulate_impl(request, monkeypatch):
    """The accumulator with the C kernel (common/_qkernels.c), then with torch."""
    from common import quant
    if request.param == "c" and quant._kernels is None:
        pytest.skip("common._qkernels is not built here")
    if request.param == "torch":
        monkeypatch.setattr(quant, "_kernels", None)
    return request.param


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_the_accumulator_merges_one_contributor_at_a_time_like_the_stacked_rows(rule, accumulate_impl) -> None:
    from common.merge import OuterAccumulator
    gen = torch.Generator().manual_seed(3)
    spans = [(0, 10, "param"), (12, 30, "embedding"), (30, 40, "param"), (40, 44, "int_buffer"), (44, 50, "buffer")]
    rows = torch.randn(5, 52, generator=gen)
    rows[:, 40:44] = torch.randint(-3, 3, (5, 4), generator=gen).float()
    rows[2, 30:40] = 0.0                                                 # a zero piece: no direction
    weights = torch.rand(5, generator=gen)
    weights /= weights.sum()
    for vectors, w in ((rows, weights), (torch.stack([rows[0], -rows[0]]), torch.tensor([0.5, 0.5]))):
        acc = OuterAccumulator(52, spans, rule)
        zero = torch.zeros(52)
        for m in range(vectors.shape[0]):   # the shard's call: Δ_m = Θ − (base + δ) with Θ = row, base = δ = 0
            acc.add_answer(vectors[m].contiguous(), zero, zero, float(w[m]))
        torch.testing.assert_close(acc.result(), merge_outer_gradients(vectors, w, spans, rule), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no contributors"):
        OuterAccumulator(52, spans, rule).result()


def test_the_c_accumulation_matches_torch_on_a_fragment_with_gaps_and_every_kind_of_piece(monkeypatch) -> None:
    """The shard's hot loop: the C kernel and the torch code give the same merged Δ (to fp32
    rounding: the norms are summed in another order) on a 24-piece fragment with gaps."""
    from common import quant
    from common.merge import OuterAccumulator
    if quant._kernels is None:
        pytest.skip("common._qkernels is not built here")
    gen = torch.Generator().manual_seed(5)
    kinds = ["param", "embedding", "buffer", "int_buffer"]
    spans, at = [], 3
    for i in range(24):
        size = int(torch.randint(0, 900, (1,), generator=gen))
        spans.append((at, at + size, kinds[i % 4] if i % 5 else "param"))
        at += size + (7 if i % 3 == 0 else 0)                     # gaps between some pieces
    numel = at + 11
    rows = torch.randn(6, numel, generator=gen) * torch.logspace(-3, 2, 6).unsqueeze(1)
    rows[3, spans[0][0]:spans[0][1]] = 0.0
    for rule in ("rda", "mean"):
        results = []
        for kernels in (quant._kernels, None):
            monkeypatch.setattr(quant, "_kernels", kernels)
            acc = OuterAccumulator(numel, spans, rule)
            zero = torch.zeros(numel)
            for m in range(rows.shape[0]):
                acc.add_answer(rows[m].contiguous(), zero, zero, 1.0 / (m + 2))
            results.append((acc.result().clone(), list(acc.radius)))
        (c, c_radius), (t, t_radius) = results
        # fp32 rounding of sums taken in another order: relative to the summands' size, not to
        # the (possibly cancelled) result
        weights = torch.tensor([1.0 / (m + 2) for m in range(rows.shape[0])]).unsqueeze(1)
        scale = torch.maximum((weights * rows.abs()).sum(0), t.abs())
        assert bool(((c - t).abs() <= 1e-5 * scale).all()), float(((c - t).abs() / scale).max())
        assert c_radius == pytest.approx(t_radius, rel=1e-6)
        assert bool((c[:3] == 0).all()) and bool((c[-11:] == 0).all())     # gaps stay zero


def test_add_answer_is_building_clipping_and_adding_the_outer_gradient(accumulate_impl) -> None:
    """The shard's per-answer call: Δ_m = Θ − (base + δ_m), its parameter pieces scaled by
    clip(‖Δ_m's parameters‖), folded in: the same as building Δ_m by hand, clipping it and
    ``add``-ing it; a 1e30 delta is clipped to the bound and leaves the result finite; the integer
    buffer is neither measured nor scaled."""
    from common.merge import OuterAccumulator
    from common.robust import NormClipper
    gen = torch.Generator().manual_seed(11)
    spans = [(0, 300, "param"), (300, 700, "embedding"), (705, 1500, "param"), (1500, 1504, "int_buffer")]
    numel = 1510
    theta, base = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    deltas = [torch.randn(numel, generator=gen) * 0.1 for _ in range(10)]
    deltas.append(torch.full((numel,), 1e30))                           # a lie: clipped, not merged as is
    for d in deltas:
        d[1500:1504] = torch.randint(-3, 3, (4,), generator=gen).float()
    fused, by_hand = OuterAccumulator(numel, spans, "rda"), OuterAccumulator(numel, spans, "rda")
    clip_fused, clip_hand = NormClipper(), NormClipper()
    scales = []
    for m, d in enumerate(deltas):
        w = 1.0 / (m + 1)
        scales.append(fused.add_answer(theta, base, d, w, clip=clip_fused.observe, buf=torch.empty(numel)))
        outer = theta - (base + d)
        pieces = (outer[:300], outer[300:700], outer[705:1500])         # the norm bound sees parameters only
        scale = clip_hand.observe(math.sqrt(sum(float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2
                                                for x in pieces)))
        outer[:1500] *= scale                                          # ... and scales only them
        by_hand.add(outer, w)
    assert scales[:8] == [1.0] * 8 and scales[-1] < 1e-20               # only the lie was scaled
    got, want = fused.result(), by_hand.result()
    assert bool(torch.isfinite(got).all())
    if accumulate_impl == "torch":
        assert torch.equal(got, want)
    else:   # norms summed in another order (and in double: the lie's norm is finite, not inf)
        torch.testing.assert_close(got[:1500], want[:1500], rtol=1e-4, atol=1e-5)
        assert torch.equal(got[1500:], want[1500:])


def test_a_tiny_clip_scale_or_a_dropped_answer_leaves_the_merge_finite_and_honest(accumulate_impl) -> None:
    """A lie of 3e38 on one tensor gets a clip scale near 1e-40; the other tensor's unit vector
    must not become inf (w / (scale·n) overflows float). A scale of 0 leaves the answer out."""
    from common.merge import OuterAccumulator
    spans = [(0, 1000, "embedding"), (1000, 1100, "param")]
    theta, base = torch.zeros(1100), torch.zeros(1100)
    gen = torch.Generator().manual_seed(2)
    honest = [torch.randn(1100, generator=gen) for _ in range(3)]
    lie = torch.full((1100,), -1e-3)
    lie[:1000] = -3e38
    acc = OuterAccumulator(1100, spans, "rda")
    for d in honest:
        acc.add_answer(theta, base, d, 0.25)
    assert acc.add_answer(theta, base, lie, 0.25, clip=lambda n: 1.0 / n) == pytest.approx(1.0 / 3.3e39, rel=0.1)
    merged = acc.result()
    assert bool(torch.isfinite(merged).all())
    assert acc.add_answer(theta, base, lie, 0.25, clip=lambda n: 0.0) == 0.0 and acc.count == 4
    assert torch.equal(acc.result(), merged)                     # the dropped answer changed nothing


def test_without_momentum_the_outer_step_neither_copies_nor_changes_the_momentum() -> None:
    """μ = 0 (the default): the momentum is never read, so no copy of it is made per merge (a shard
    would allocate one fragment's worth of memory at every merge for nothing); with μ > 0 the
    caller's momentum is left alone and a new one is returned."""
    from common.config import AlgoConfig
    from common.merge import outer_step
    theta, grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, -0.5, 1.0])
    spans = [(0, 2, "param"), (2, 3, "buffer")]
    momentum = torch.zeros(3)
    new, mom = outer_step(theta, momentum, grad, spans, AlgoConfig(outer_lr=1.0, outer_momentum=0.0))
    assert mom is momentum and momentum.tolist() == [0.0, 0.0, 0.0]
    assert new.tolist() == [0.5, 2.5, 2.0] and theta.tolist() == [1.0, 2.0, 3.0]
    new, mom = outer_step(theta, momentum, grad, spans, AlgoConfig(outer_lr=1.0, outer_momentum=0.5))
    assert mom is not momentum and momentum.tolist() == [0.0, 0.0, 0.0] and mom.tolist() == [0.5, -0.5, 0.0]


def test_a_shard_merges_every_fragment_with_one_set_of_buffers_per_thread() -> None:
    """The merge scratch is per merging thread and as long as the largest fragment, not per
    fragment: a shard owning many fragments holds 3 × the largest of them per thread."""
    from types import SimpleNamespace

    from syncer.shard import Shard
    shard = Shard.__new__(Shard)            # only what _merge_scratch reads
    shard._scratch = threading.local()
    shard.frags = {p: SimpleNamespace(spec=SimpleNamespace(numel=n)) for p, n in enumerate((10, 30, 20))}
    first = shard._merge_scratch(10)
    assert [b.numel() for b in first] == [10, 10, 10]
    for p, f in shard.frags.items():
        bufs = shard._merge_scratch(f.spec.numel)
        assert [b.numel() for b in bufs] == [f.spec.numel] * 3
        assert [b.data_ptr() for b in bufs] == [b.data_ptr() for b in first]   # the same memory
        assert len({b.untyped_storage().data_ptr() for b in bufs}) == 3        # three distinct buffers
    other: list[int] = []
    t = threading.Thread(target=lambda: other.extend(b.data_ptr() for b in shard._merge_scratch(30)))
    t.start()
    t.join()
    assert not set(other) & {b.data_ptr() for b in first}                      # its own set


def test_the_inner_adamw_runs_the_fused_kernel_and_matches_the_reference_loop() -> None:
    """Plain CPU parameters get PyTorch's fused AdamW (one pass, no model-sized temporaries); its
    trajectory equals the default loop's to float rounding. Parameters on a device the fused
    kernel does not serve keep PyTorch's default."""
    from learner.inner import fused_supported, make_inner_optimizer
    algo = AlgoConfig(inner_lr=3e-3, inner_weight_decay=0.1, inner_warmup_steps=1)
    torch.manual_seed(0)
    start = [torch.randn(30, 20), torch.randn(20)]
    grads = [[torch.randn_like(t) * 1e-2 for t in start] for _ in range(30)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt, sched = make_inner_optimizer(ours, algo)
    assert opt.defaults["fused"] is True
    ref_opt = torch.optim.AdamW(ref, lr=3e-3, betas=(algo.inner_beta1, algo.inner_beta2), weight_decay=0.1)
    for g in grads:
        for p, q, gg in zip(ours, ref, g):
            p.grad, q.grad = gg.clone(), gg.clone()
        opt.step()
        sched.step()
        ref_opt.step()
    for p, q, t in zip(ours, ref, start):
        assert not torch.equal(p, t)
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert not fused_supported([torch.nn.Parameter(torch.empty(3, device="meta"))])
    assert not fused_supported([])


def test_bench_adamw_times_the_three_implementations_on_the_asked_size() -> None:
    """``ddloco bench adamw``: one row per AdamW implementation, over the parameters asked for,
    each timed (the fused row is the one the learners run)."""
    from ddloco.bench.micro import bench_adamw
    rows = bench_adamw(5000, 2)
    assert [r["impl"] for r in rows] == ["default", "foreach", "fused"]
    for r in rows:
        assert r["numel"] == 5000 - 5000 % 64
        assert r["step_ms"] > 0 and r["first_step_ms"] > 0 and r["step_vs_memcpy"] > 0


def test_a_peers_adamw_state_is_loaded_without_its_kernel_flags() -> None:
    """A learner bootstrapped from a peer whose AdamW ran another kernel (older code, another
    device) keeps its own fused kernel, with the peer's moments and step count."""
    from learner.inner import load_optimizer_state, make_inner_optimizer
    torch.manual_seed(0)
    theirs_p = [torch.nn.Parameter(torch.randn(8, 4))]
    theirs = torch.optim.AdamW(theirs_p, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)   # the default loop
    for _ in range(3):
        theirs_p[0].grad = torch.randn(8, 4)
        theirs.step()
    ours_p = [torch.nn.Parameter(theirs_p[0].detach().clone())]
    ours, _ = make_inner_optimizer(ours_p, AlgoConfig(inner_warmup_steps=1))
    load_optimizer_state(ours, copy.deepcopy(theirs.state_dict()))   # as received: no tensor shared
    assert ours.param_groups[0]["fused"] is True
    assert torch.equal(ours.state[ours_p[0]]["exp_avg"], theirs.state[theirs_p[0]]["exp_avg"])
    assert float(ours.state[ours_p[0]]["step"]) == 3.0
    g = torch.randn(8, 4)
    ours_p[0].grad, theirs_p[0].grad = g.clone(), g.clone()
    ours.step()
    theirs.step()
    torch.testing.assert_close(ours_p[0], theirs_p[0], rtol=1e-6, atol=1e-7)
