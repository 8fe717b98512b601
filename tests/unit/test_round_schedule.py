"""The shard's round scheduling (syncer/schedule.py) at fixed `now` values: quorum, grace window,
min_answers wait, re-sends, opening schedule, and the round state logged on change."""
from __future__ import annotations

import pytest
import torch

from common.config import AlgoConfig
from common.quorum import Decision, QuorumPolicy
from syncer.schedule import Learners, RoundCall, RoundSchedule, RoundStateLog, xi_step_s
from syncer.state import Answer, OpenRound

pytestmark = pytest.mark.timeout(10)

T0 = 100.0
ALGO = AlgoConfig(fragments=4, sync_every_steps=4, quorum=2, tau=2, grace_gamma=0.5)


def make_schedule(algo: AlgoConfig = ALGO, *, min_answers: int = 1) -> RoundSchedule:
    policy = QuorumPolicy(quorum=algo.quorum, tau=algo.tau, grace_gamma=algo.grace_gamma,
                          grace_enabled=algo.grace_enabled, all_live=algo.lockstep, min_answers=min_answers)
    return RoundSchedule(policy=policy, algo=algo, started_s=T0, initial_step_time_s=0.2,
                         min_answers_wait_periods=2.0, reopen_after_steps=4.0)


def make_round(answers: int, *, quorum_at: float | None = None, attempt: int = 0, round_id: int = 7) -> OpenRound:
    rnd = OpenRound(round_id=round_id, opened_at=T0, attempt=attempt, last_sent_at=T0, quorum_at=quorum_at)
    for i in range(answers):
        rnd.answers[f"l{i}"] = Answer(sender=f"l{i}", base=0, steps=4, tokens=64, delta=torch.zeros(1),
                                      received_at=T0)
    return rnd


def decide_one(schedule: RoundSchedule, now: float, rnd: OpenRound, learners: Learners,
               grace_s: float = 0.3) -> RoundCall:
    (call,) = schedule.decide(now, {3: rnd}, learners, grace_s=grace_s)
    assert call.fragment == 3 and call.round_id == rnd.round_id
    return call


FAST = Learners(live=3, answering=3, step_times_s=(0.1,))


def test_a_round_below_its_quorum_waits_and_says_why() -> None:
    call = decide_one(make_schedule(), T0 + 0.3, make_round(1), FAST)
    assert (call.decision, call.reason) == (Decision.WAIT_QUORUM, "waiting for quorum: 1/2 answers, 3 live")
    assert not call.reopen                       # 0.3 s < 4 steps x 0.1 s since the open was sent


def test_an_unanswered_open_is_sent_again_with_exponential_backoff() -> None:
    schedule = make_schedule()
    assert decide_one(schedule, T0 + 0.41, make_round(1), FAST).reopen                 # 4 x 0.1 s
    assert not decide_one(schedule, T0 + 0.7, make_round(1, attempt=1), FAST).reopen    # 8 x 0.1 s now
    assert decide_one(schedule, T0 + 0.81, make_round(1, attempt=1), FAST).reopen
    assert decide_one(schedule, T0 + 3.21, make_round(1, attempt=9), FAST).reopen        # backoff capped at 2^3
    assert not decide_one(schedule, T0 + 9.0, make_round(2, quorum_at=T0), FAST).reopen  # quorum: never re-sent


def test_a_round_past_its_quorum_waits_out_the_grace_window_then_merges() -> None:
    schedule, rnd = make_schedule(), make_round(2, quorum_at=T0 + 1.0)
    call = decide_one(schedule, T0 + 1.2, rnd, FAST)
    assert (call.decision, call.reason) == (Decision.IN_GRACE, "in grace window: 0.100s of 0.300s left, 2 answers")
    call = decide_one(schedule, T0 + 1.3, rnd, FAST)
    assert (call.decision, call.reason) == (Decision.MERGE, "grace window 0.300s elapsed with 2 answers")


def test_a_round_every_live_learner_answered_merges_at_once() -> None:
    call = decide_one(make_schedule(), T0 + 0.01, make_round(3, quorum_at=T0), FAST)
    assert (call.decision, call.reason) == (Decision.MERGE, "all 3 live learners answered")


def test_min_answers_holds_a_round_for_its_wait_then_the_quorum_applies() -> None:
    """min_answers = 3 of 3 answering learners, K = 1: a round with 2 answers waits 2 periods
    (2 x H x the slowest step: 0.8 s), then merges on K (its grace window long over)."""
    schedule = make_schedule(AlgoConfig(fragments=4, sync_every_steps=4, quorum=1, tau=2, grace_gamma=0.5),
                             min_answers=3)
    learners = Learners(live=4, answering=3, step_times_s=(0.1, 0.05))
    rnd = make_round(2, quorum_at=T0 + 0.1)
    call = decide_one(schedule, T0 + 0.79, rnd, learners)
    assert (call.decision, call.reason) == (Decision.WAIT_QUORUM, "waiting for quorum: 2/3 answers, 4 live")
    call = decide_one(schedule, T0 + 0.81, rnd, learners)
    assert (call.decision, call.reason) == (Decision.MERGE, "grace window 0.300s elapsed with 2 answers")


def test_the_grace_window_follows_the_slowest_learner_and_the_initial_step_time_before_any() -> None:
    schedule = make_schedule()
    # clamp(γ (τ ξ_step − ξ_quorum − ξ_sync), 0, ξ_step) = 0.5 (2 × 0.3 − 0.1 − 0.05)
    assert schedule.grace_s(Learners(live=2, answering=2, step_times_s=(0.1, 0.3)), xi_quorum_s=0.1,
                            xi_sync_s=0.05) == pytest.approx(0.225)
    assert schedule.grace_s(Learners(live=0, answering=0), xi_quorum_s=0.1,
                            xi_sync_s=0.05) == pytest.approx(0.125)          # ξ_step = 0.2 s (initial)
    assert xi_step_s((0.1, 0.3, 0.2), slowest=False, initial_s=9.0) == pytest.approx(0.2)


def test_fragments_open_staggered_one_spacing_apart_at_most_tau_in_flight() -> None:
    """Period H x the median step = 0.4 s over 4 fragments: one open per 0.1 s, fragment p due
    at start + 0.1 p; never more than τ = 2 in flight."""
    schedule, learners = make_schedule(), FAST
    owned, last = [0, 1, 2, 3], {}

    def due(now: float, in_flight: list[int]) -> list[int]:
        got = schedule.due(now, ready=owned, last_opened_s=last, in_flight=in_flight, owned=4, learners=learners)
        last.update({p: now for p in got})
        return got

    assert due(T0, []) == [0]
    assert due(T0 + 0.05, [0]) == []             # half a spacing later: not yet
    assert due(T0 + 0.1, [0]) == [1]
    assert due(T0 + 0.2, [0, 1]) == []           # τ rounds in flight
    assert due(T0 + 0.2, [1]) == [2]
    assert schedule.due(T0 + 5.0, ready=[0, 1], last_opened_s=last, in_flight=[], owned=4,
                        learners=learners) == [0]   # a fragment still recovering (not ready) never opens


def test_lockstep_opens_every_fragment_at_once_and_a_finishing_learner_opens_tau_back_to_back() -> None:
    lockstep = make_schedule(AlgoConfig(fragments=4, sync_every_steps=4, quorum=1, lockstep=True))
    assert lockstep.due(T0, ready=[0, 1, 2, 3], last_opened_s={}, in_flight=[], owned=4, learners=FAST) == [0, 1, 2, 3]
    finishing = Learners(live=3, answering=3, step_times_s=(0.1,), finishing=True)
    schedule = make_schedule()
    assert schedule.due(T0 + 60, ready=[0, 1, 2, 3], last_opened_s={p: T0 + 59.99 for p in range(4)}, in_flight=[],
                        owned=4, learners=finishing) == [0, 1]


def test_a_round_state_is_logged_once_per_change_of_decision_or_reason() -> None:
    lines: list[dict] = []
    log = RoundStateLog(lambda event, **kw: lines.append({"event": event, **kw}))
    wait0 = RoundCall(3, Decision.WAIT_QUORUM, "waiting for quorum: 0/2 answers, 3 live", round_id=7)
    wait1 = RoundCall(3, Decision.WAIT_QUORUM, "waiting for quorum: 1/2 answers, 3 live", round_id=7)
    assert log.observe(wait0) and not log.observe(wait0) and not log.observe(wait0)
    assert log.observe(RoundCall(5, Decision.WAIT_QUORUM, wait0.reason, round_id=2))   # each fragment its own
    assert log.observe(wait1) and not log.observe(wait1)
    grace = [RoundCall(3, Decision.IN_GRACE, f"in grace window: {left:.3f}s of 0.300s left, {n} answers", round_id=7)
             for left, n in ((0.3, 2), (0.2, 2), (0.1, 3))]
    assert [log.observe(c) for c in grace] == [True, False, False]      # the countdown is no change
    assert log.observe(RoundCall(3, Decision.MERGE, "grace window 0.300s elapsed with 3 answers", round_id=7))
    assert log.observe(RoundCall(3, Decision.WAIT_QUORUM, wait0.reason, round_id=8))  # the next round
    assert [(line["fragment"], line["round"], line["decision"]) for line in lines] == [
        (3, 7, "wait_quorum"), (5, 2, "wait_quorum"), (3, 7, "wait_quorum"), (3, 7, "in_grace"), (3, 7, "merge"),
        (3, 8, "wait_quorum")]
    assert {line["event"] for line in lines} == {"syncer.round_state"}
    assert lines[2]["reason"] == "waiting for quorum: 1/2 answers, 3 live"
