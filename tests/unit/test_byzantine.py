"""Byzantine-bounded merge (issue: a compromised learner does no more than one learner's share):
fair weights, a norm reference a minority cannot drag, the round's own bound from the first round,
and a robust floor of answers per round. Pure functions at fixed inputs."""
from __future__ import annotations

import math

import pytest
import torch

from common.merge import OuterAccumulator, contribution_weights
from common.quorum import Decision, QuorumPolicy, RoundView, decide_round
from common.robust import NormClipper, fair_weights, fold_round, round_bound


def test_a_maximum_claim_weighs_no_more_than_the_median_answer():
    # 4 honest answers of 24 steps x 1,024 tokens, one claiming 8 H steps at the per-step bound
    tokens = [24 * 1024.0] * 4 + [96 * 2048.0]
    steps = [24.0] * 4 + [96.0]
    plain = contribution_weights(tokens, steps)
    assert float(plain[-1]) > 0.75                     # before: the liar takes 80 % of the round
    fair, capped = fair_weights(tokens, steps)
    assert capped == [4]
    assert float(fair[-1]) == pytest.approx(0.2) and float(fair.sum()) == pytest.approx(1.0)
    # honest answers keep their relative weights below the median
    fair, capped = fair_weights([100.0, 200.0, 300.0], [1.0, 1.0, 1.0])
    assert capped == [2] and fair.tolist() == pytest.approx([1 / 9, 4 / 9, 4 / 9])
    # one answer: nothing to compare with
    assert fair_weights([5.0], [1.0])[0].tolist() == [1.0]


def _honest(rng: torch.Generator) -> float:
    return float(1.0 + 0.2 * torch.rand(1, generator=rng))


@pytest.mark.parametrize("hostile", [1, 2])
def test_the_norm_reference_is_not_dragged_by_a_minority_answering_just_under_the_bound(hostile):
    """3 honest learners with norms ~1, ``hostile`` learners always answering at 0.99 x the current
    bound, 200 rounds: the bound stays a few times the honest norm (a pool of everyone's last
    norms went from 4 to 13,770 with half the answers hostile)."""
    rng = torch.Generator().manual_seed(0)
    c = NormClipper()
    for _ in range(200):
        for h in range(3):
            c.observe(_honest(rng), learner=f"honest{h}")
        for a in range(hostile):
            b = c.bound()
            assert c.observe(0.99 * b if b else 50.0, reference=1.0, learner=f"evil{a}") == 1.0
    assert c.bound() <= 4.0 * 1.2 + 1e-9


def test_zero_and_tiny_answers_of_a_free_rider_do_not_drag_the_bound_down():
    rng = torch.Generator().manual_seed(1)
    c = NormClipper()
    for _ in range(100):
        for h in range(3):
            c.observe(_honest(rng), learner=f"honest{h}")
        c.observe(0.0, learner="rider")
        c.observe(1e-12, learner="rider2")
    assert c.bound() >= 4.0


def test_the_round_bounds_an_answer_from_the_first_round_before_any_history():
    # 3 honest norms ~1 and one 99 x the fragment's norm: no history yet, the round's median bounds it
    assert round_bound([1.0, 1.1, 0.9, 99.0], [0.25] * 4) == pytest.approx(1.5)
    assert round_bound([1.0, 99.0], [0.5, 0.5]) is None           # two answers: no majority to trust
    c = NormClipper()
    assert c.observe(99.0, reference=2.0, learner="evil", limit=2.0) == pytest.approx(2.0 / 99.0)


def _round(theta: torch.Tensor, honest_dir: torch.Tensor, rng: torch.Generator, attack: torch.Tensor | None,
           clipper: NormClipper, rule: str) -> torch.Tensor:
    """One merged outer gradient Δ of 4 honest answers (around ``honest_dir``) and an attacker's."""
    n = theta.numel()
    answers, tokens, steps = [], [], []
    for h in range(4):
        outer = honest_dir + 0.5 * torch.randn(n, generator=rng) / math.sqrt(n)   # Δ_m, norm ~1.1
        answers.append((f"h{h}", theta, -outer, 24.0))                   # base Θ, δ_m = −Δ_m
        tokens.append(24 * 1024.0)
        steps.append(24.0)
    if attack is not None:
        answers.append(("evil", theta, -attack, 24.0))
        tokens.append(96 * 2048.0)
        steps.append(96.0)
    w, _ = fair_weights(tokens, steps)
    acc = OuterAccumulator(n, [(0, n, "param")], rule, robust_buffers=True, robust_radius=True)
    fold_round(acc, theta, answers, w.tolist(), clipper)
    return acc.result().clone()


@pytest.mark.parametrize("rule", ["rda", "mean"])
@pytest.mark.parametrize("scale", [-8.0, -1e6])
def test_a_sign_flipped_answer_among_four_honest_ones_does_not_turn_the_merge_backwards(rule, scale):
    n = 512
    rng = torch.Generator().manual_seed(2)
    theta = torch.randn(n, generator=rng)
    honest_dir = torch.randn(n, generator=rng)
    honest_dir /= torch.linalg.vector_norm(honest_dir)
    clipper = NormClipper()
    for _ in range(20):                                   # history: a few clean rounds
        _round(theta, honest_dir, rng, None, clipper, rule)
    for _ in range(20):
        merged = _round(theta, honest_dir, rng, scale * honest_dir, clipper, rule)
        along = float(merged @ honest_dir)
        # an honest round moves ~1.0 along it. RDA: the flipped unit vector weighs 1/5 of the
        # direction, its norm (clipped to 1.5 x the round's median) only lengthens the step; mean: the
        # flipped answer subtracts at most 1/5 x 1.5 x an honest norm
        assert along > (0.9 if rule == "rda" else 0.25)
        assert float(torch.linalg.vector_norm(merged)) < 1.2 * (1 + 0.2 * 1.5)


def test_a_round_waits_for_three_answers_while_three_learners_answer_then_falls_back_to_k():
    robust = QuorumPolicy(quorum=1, tau=2, grace_gamma=0.8, min_answers=3, min_answers_wait_s=10.0)
    two = RoundView(opened_at_s=0.0, answers=2, quorum_reached_at_s=0.0, live_learners=5, answering=5)
    assert decide_round(1.0, two, robust, grace_s=0.0)[0] is Decision.WAIT_QUORUM
    three = RoundView(opened_at_s=0.0, answers=3, quorum_reached_at_s=0.0, live_learners=5, answering=5)
    assert decide_round(1.0, three, robust, grace_s=0.0)[0] is Decision.MERGE
    # two learners answering: two answers do
    pair = RoundView(opened_at_s=0.0, answers=2, quorum_reached_at_s=0.0, live_learners=3, answering=2)
    assert decide_round(1.0, pair, robust, grace_s=0.0)[0] is Decision.MERGE
    # honest learners that cannot answer: after the wait the plain quorum K applies
    assert decide_round(10.5, two, robust, grace_s=0.0)[0] is Decision.MERGE
    one = RoundView(opened_at_s=0.0, answers=1, quorum_reached_at_s=0.0, live_learners=5, answering=5)
    assert decide_round(1.0, one, QuorumPolicy(quorum=1, tau=2, grace_gamma=0.8), grace_s=0.0)[0] is Decision.MERGE


def test_a_recovering_shard_adopts_a_copy_two_learners_agree_on_not_a_lone_members_invention():
    from common.robust import choose_copy
    honest = {"a": (10, 111), "b": (10, 111), "c": (9, 222)}
    # a member claiming a far newer version with its own values: outvoted by two identical replicas
    assert choose_copy({**honest, "evil": (10**6, 999)}, own_version=5, lone_limit=10) == (10, 111)
    # the same version as the replicas but other values: the replicas agree, the lone copy does not
    assert choose_copy({**honest, "evil": (10, 999)}, own_version=5, lone_limit=10) == (10, 111)
    # one honest learner and the member: no agreement; the lone copy within the run's record wins,
    # one beyond it is refused
    assert choose_copy({"a": (10, 111), "evil": (10**6, 999)}, own_version=5, lone_limit=10) == (10, 111)
    # a tie at one version: the copy nearest the shard's own value
    near = {(10, 111): 0.5, (10, 999): 1e9}
    assert choose_copy({"a": (10, 111), "evil": (10, 999)}, own_version=5, lone_limit=10,
                       distance=near.__getitem__) == (10, 111)
    # nothing newer than the shard's own: keep it
    assert choose_copy({"a": (4, 1), "b": (4, 1)}, own_version=5, lone_limit=10) is None
    # one learner, one copy within the limit: adopted (the only source there is)
    assert choose_copy({"a": (8, 3)}, own_version=5, lone_limit=10) == (8, 3)


def test_buffers_take_the_median_so_a_flipped_answer_cannot_drive_a_running_variance_below_zero():
    """A BatchNorm fragment: weights, a running variance and the batch counter. One answer of five
    flips its update 8 x (running variance to -7, the counter to 2^31): the merged variance stays
    the honest learners' and positive, the counter an honest one."""
    spans = [(0, 8, "param"), (8, 12, "buffer"), (12, 13, "int_buffer")]
    theta = torch.zeros(13)
    theta[8:12], theta[12] = 1.0, 100.0                       # Θ: variance 1, counter 100
    answers = []
    for h, var in enumerate((1.05, 1.1, 0.95, 1.0)):          # learners' values θ_m; δ_m = θ_m − base
        value = theta.clone()
        value[:8] += 0.01
        value[8:12], value[12] = var, 110.0 + h
        answers.append((f"h{h}", theta, value - theta, 12.0))
    evil = theta.clone()
    evil[8:12], evil[12] = -7.0, 2.0 ** 31
    answers.append(("evil", theta, evil - theta, 12.0))
    w, _ = fair_weights([1.0] * 5, [1.0] * 5)
    acc = OuterAccumulator(13, spans, "rda", robust_buffers=True)
    fold_round(acc, theta, answers, w.tolist(), NormClipper(), buffer_ceiling=None)
    new = theta - acc.result()
    assert bool((new[8:12] >= 0.95).all()) and bool((new[8:12] <= 1.1).all()), new[8:12]
    assert 110.0 <= float(new[12]) <= 113.0
    plain = OuterAccumulator(13, spans, "rda")                # the average and the largest value
    fold_round(plain, theta, answers, w.tolist(), NormClipper(), buffer_ceiling=None)
    old = theta - plain.result()
    assert float(old[8:12].min()) < 0.0 and float(old[12]) == 2.0 ** 31


def test_a_free_riders_zeros_do_not_shorten_the_step():
    """RDA with the robust radius: the step's length is the weighted median of the answers' norms,
    so zero answers at a quarter of the weight leave it as the honest answers make it (the
    weighted mean shortened it by that quarter)."""
    n = 256
    rng = torch.Generator().manual_seed(5)
    theta = torch.randn(n, generator=rng)
    honest = [torch.randn(n, generator=rng) for _ in range(3)]
    answers = [(f"h{i}", theta, -d, 12.0) for i, d in enumerate(honest)] + [("rider", theta, torch.zeros(n), 12.0)]
    w = [0.25] * 4
    lengths = {}
    for robust in (False, True):
        acc = OuterAccumulator(n, [(0, n, "param")], "rda", robust_radius=robust)
        fold_round(acc, theta, answers, w, NormClipper())
        lengths[robust] = float(torch.linalg.vector_norm(acc.result()))
    honest_mean = sum(float(torch.linalg.vector_norm(d)) for d in honest) / 3
    assert lengths[False] == pytest.approx(0.75 * honest_mean, rel=1e-4)
    assert 0.9 * honest_mean < lengths[True] < 1.1 * honest_mean
