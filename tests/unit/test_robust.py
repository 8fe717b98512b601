"""Robust merge rules: bounded claims, clipped outer gradients."""
from __future__ import annotations

import math

import pytest
import torch

from common.robust import NormClipper, bound_claims


def test_claims_within_the_bounds_are_kept():
    assert bound_claims(steps=24, tokens=24 * 1024, tokens_per_step_bound=2048, max_steps=96) == (24, 24 * 1024, [])


def test_absurd_claims_are_cut_to_the_bounds_and_named():
    steps, tokens, cut = bound_claims(steps=10**9, tokens=2**64 - 1, tokens_per_step_bound=2048, max_steps=96)
    assert (steps, tokens) == (96, 96 * 2048)
    assert cut == ["tokens_claim", "steps_claim"]
    # an honest learner whose rounds stalled: weighed as max_steps of the same kind, tokens not blamed
    assert bound_claims(steps=200, tokens=200 * 1024, tokens_per_step_bound=2048, max_steps=96) == \
        (96, 96 * 1024, ["steps_claim"])
    assert bound_claims(steps=24, tokens=-5, tokens_per_step_bound=2048, max_steps=96)[1] == 0


def test_clipper_passes_ordinary_norms_and_cuts_an_outlier_to_factor_times_the_median():
    c = NormClipper(factor=4.0, window=32, min_samples=8)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):                              # no bound before min_samples: nothing clipped
        _, clipped = c.clip(torch.randn(100, generator=g))
        assert not clipped
    _, clipped = c.clip(torch.randn(100, generator=g))
    assert not clipped
    b0 = c.bound()
    huge, clipped = c.clip(torch.full((100,), 1e30))
    assert clipped and float(torch.linalg.vector_norm(huge)) <= b0 * 1.001
    for _ in range(40):                             # a sustained attack does not drag the bound up
        _, clipped = c.clip(torch.full((100,), 1e30))
        assert clipped
    assert c.bound() <= b0 * 1.05


def test_before_the_median_exists_a_delta_far_larger_than_the_fragment_is_dropped_unrecorded():
    c = NormClipper(factor=4.0, min_samples=8, ceiling_factor=100.0)
    assert c.observe(50.0, reference=2.0) == 1.0                 # below 100 × the fragment's norm
    assert c.observe(3e31, reference=2.0) == 0.0                 # a 1e30-sized lie: dropped
    assert c.observe(150.0, reference=0.0) == 0.0                # reference at least 1: ceiling 100
    assert c.observe(float("inf"), reference=2.0) == 0.0
    assert list(c.norms) == [50.0]                               # the lies did not shape the median
    assert c.observe(3e31) == 1.0                                # no reference: no ceiling (as before)
    for _ in range(8):
        c.observe(1.0, reference=2.0)
    assert c.bound() is not None and 0.0 < c.observe(3e31, reference=2.0) < 1e-29   # then: clipped to the bound


def test_a_step_claim_may_follow_the_time_since_its_base_when_rounds_stalled():
    from common.robust import max_steps_claim
    # rounds running: factor × H × (versions since base + 1)
    assert max_steps_claim(versions_since_base=0, sync_every_steps=12, factor=8, elapsed_s=0.5, step_s=0.01) == 96
    # a 20 s broker outage at 10 ms steps: 2,000 honest steps on one base; the bound follows the time
    bound = max_steps_claim(versions_since_base=0, sync_every_steps=12, factor=8, elapsed_s=20.5, step_s=0.01)
    assert bound >= 2050 and bound == math.ceil(1.5 * 20.5 / 0.01) + 12
    assert bound_claims(steps=2050, tokens=2050 * 32, tokens_per_step_bound=64, max_steps=bound)[2] == []
    # no step time known: the versions bound
    assert max_steps_claim(versions_since_base=2, sync_every_steps=12, factor=8, elapsed_s=20.0, step_s=0.0) == 288


def test_a_mild_excess_is_counted_as_clamped_and_a_lie_as_a_rejection():
    assert bound_claims(steps=150, tokens=150 * 32, tokens_per_step_bound=64, max_steps=96)[2] == ["claims_clamped"]
    assert bound_claims(steps=24, tokens=24 * 100, tokens_per_step_bound=64, max_steps=96)[2] == ["claims_clamped"]
    assert bound_claims(steps=193, tokens=193 * 32, tokens_per_step_bound=64, max_steps=96)[2] == ["steps_claim"]
    assert bound_claims(steps=24, tokens=24 * 129, tokens_per_step_bound=64, max_steps=96)[2] == ["tokens_claim"]


def test_zero_norms_are_not_recorded_so_they_cannot_drag_the_bound_down():
    c = NormClipper(factor=4.0, min_samples=8)
    for _ in range(8):
        c.observe(2.0)
    for _ in range(100):                         # a free rider, or a fragment's buffers-only answers
        assert c.observe(0.0) == 1.0
    assert c.bound() == 8.0 and list(c.norms) == [2.0] * 8


def test_an_integer_counter_jump_takes_no_part_in_the_first_rounds_bound_and_merges_to_the_largest_value():
    """A fragment of small conv weights and BatchNorm's num_batches_tracked: the counter jumps by
    150 before the fragment's first round. Only the weights are measured against the bound, so the
    answer is merged (not dropped as far larger than the fragment), and the counter merges to the
    largest learner value, unscaled."""
    from common.merge import OuterAccumulator
    spans = [(0, 72, "param"), (128, 129, "int_buffer"), (192, 200, "buffer")]
    theta = torch.zeros(200)
    theta[:72] = 0.05                             # ‖weights‖ = 0.42: the warm-up ceiling is 100 × max(0.42, 1)
    acc = OuterAccumulator(200, spans, "mean")
    clipper = NormClipper()
    reference = acc.bounded_norm(theta)
    assert reference == pytest.approx(0.05 * math.sqrt(72))
    for counter in (150.0, 151.0):                # two learners' answers: Δ = Θ − (base + δ)
        delta = torch.zeros(200)
        delta[:72], delta[128], delta[192:200] = 0.01, counter, 3.0
        assert acc.add_answer(theta, theta, delta, 0.5, clip=lambda n: clipper.observe(n, reference)) == 1.0
    new = theta - acc.result()
    assert new[128] == 151.0 and torch.allclose(new[192:200], torch.full((8,), 3.0))
    assert list(clipper.norms) == [pytest.approx(0.01 * math.sqrt(72))] * 2   # only the weights were measured


def test_claims_count_from_the_last_answer_to_an_earlier_round_also_when_a_round_is_answered_twice():
    from common.robust import claims_reference
    ref, seen = claims_reference(None, 0, now=10.0, joined=9.0)        # first answer: since it joined
    assert (ref, seen) == (9.0, (0, 9.0, 10.0))
    ref, seen = claims_reference(seen, 1, now=10.5, joined=0.0)        # next round: since its last answer
    assert (ref, seen) == (10.0, (1, 10.0, 10.5))
    ref, seen = claims_reference(seen, 1, now=10.6, joined=0.0)        # round 1 again (a re-sent open):
    assert (ref, seen) == (10.0, (1, 10.0, 10.6))                      # same start, not 0.1 s ago
    ref, seen = claims_reference(seen, 2, now=11.0, joined=0.0)        # then from the latest answer
    assert ref == 10.6


def test_an_answer_that_moves_float_buffers_absurdly_is_left_out_and_honest_statistics_merge():
    """Buffers take no part in the norm bound, but a 1e30 running variance is no statistic: an
    answer whose float buffers move by more than the ceiling is left out; an honest one merges."""
    from common.merge import OuterAccumulator
    spans = [(0, 64, "param"), (64, 72, "buffer")]
    theta = torch.zeros(72)
    theta[64:72] = 1.0                                  # running_var initialised to ones
    acc = OuterAccumulator(72, spans, "mean")
    ceiling = 100.0 * max(acc.float_buffer_norm(theta), 1.0)
    honest, lie = torch.zeros(72), torch.zeros(72)
    honest[:64], honest[64:72] = 0.01, 2.5              # a real variance of 3.5
    lie[:64], lie[64:72] = 0.01, 1e30
    assert acc.add_answer(theta, theta, lie, 1.0, buffer_ceiling=ceiling) == 0.0 and acc.count == 0
    assert acc.add_answer(theta, theta, honest, 1.0, buffer_ceiling=ceiling) == 1.0 and acc.count == 1
    assert torch.allclose((theta - acc.result())[64:72], torch.full((8,), 3.5))


def test_the_rounds_weighted_median_is_the_buffers_rule_exactly():
    """``robust.weighted_median`` (plain Python, once per merge) picks the value
    ``merge.weighted_median_rows`` (the buffers' coordinate-wise rule) picks, ties included."""
    import random
    from common.merge import weighted_median_rows
    from common.robust import weighted_median
    rng = random.Random(7)
    for trial in range(500):
        m = rng.randint(1, 12)
        values = [float(rng.choice([1, 2, 2, 3, 5, 8])) if trial % 2 else rng.uniform(0, 10) for _ in range(m)]
        weights = [rng.choice([0.5, 1.0, 1.0, 2.0]) if trial % 3 else rng.uniform(0.01, 1) for _ in range(m)]
        rows = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
        expected = float(weighted_median_rows(rows, torch.tensor(weights, dtype=torch.float64))[0])
        assert weighted_median(values, weights) == expected, (values, weights)
