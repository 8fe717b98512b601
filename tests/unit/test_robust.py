"""Robust merge rules: bounded claims, clipped outer gradients."""
from __future__ import annotations

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
