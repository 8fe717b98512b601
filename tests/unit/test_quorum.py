"""Round policy at fixed `now` values: quorum, grace window, fragment scheduling, EMAs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import pytest

from common.quorum import (
    Decision,
    Ema,
    QuorumPolicy,
    RoundView,
    decide_round,
    due_fragments,
    OpenSchedule,
    grace_window_s,
    period_s,
)

K1 = QuorumPolicy(quorum=1, tau=2, grace_gamma=0.8)
K2 = QuorumPolicy(quorum=2, tau=2, grace_gamma=0.8)
K3 = QuorumPolicy(quorum=3, tau=2, grace_gamma=0.8)       # K = M = 3: lock-step
K1_NO_GRACE = QuorumPolicy(quorum=1, tau=2, grace_gamma=0.8, grace_enabled=False)


@dataclass(frozen=True)
class Case:
    name: str
    now_s: float
    answers: int
    reached_s: float | None
    live: int
    policy: QuorumPolicy
    grace_s: float
    decision: Decision
    reason: str


CASES = [
    Case("no answers yet", 10.0, 0, None, 3, K2, 0.42, Decision.WAIT_QUORUM,
         "waiting for quorum: 0/2 answers, 3 live"),
    Case("one short of quorum", 10.0, 1, None, 3, K2, 0.42, Decision.WAIT_QUORUM,
         "waiting for quorum: 1/2 answers, 3 live"),
    Case("quorum just reached starts grace", 10.0, 2, None, 3, K2, 0.42, Decision.IN_GRACE,
         "in grace window: 0.420s of 0.420s left, 2 answers"),
    Case("still in grace", 10.3, 2, 10.0, 3, K2, 0.42, Decision.IN_GRACE,
         "in grace window: 0.120s of 0.420s left, 2 answers"),
    Case("grace elapsed exactly", 10.42, 2, 10.0, 3, K2, 0.42, Decision.MERGE,
         "grace window 0.420s elapsed with 2 answers"),
    Case("grace long elapsed", 50.0, 1, 10.0, 4, K1, 0.42, Decision.MERGE,
         "grace window 0.420s elapsed with 1 answers"),
    Case("all live answered merges early", 10.01, 3, 10.0, 3, K2, 0.42, Decision.MERGE,
         "all 3 live learners answered"),
    Case("more answers than live heartbeats", 10.0, 2, None, 1, K1, 0.42, Decision.MERGE,
         "all 1 live learners answered"),
    Case("grace disabled merges at quorum", 10.0, 1, None, 3, K1_NO_GRACE, 0.42, Decision.MERGE,
         "quorum 1/1 reached, grace disabled"),
    Case("zero grace merges at quorum", 10.0, 1, None, 3, K1, 0.0, Decision.MERGE,
         "grace window 0.000s elapsed with 1 answers"),
    Case("lock-step waits for every learner", 99.0, 2, None, 3, K3, 0.42, Decision.WAIT_QUORUM,
         "waiting for quorum: 2/3 answers, 3 live"),
    Case("lock-step waits even when a learner is gone", 99.0, 2, None, 2, K3, 0.42,
         Decision.WAIT_QUORUM, "waiting for quorum: 2/3 answers, 2 live"),
    Case("lock-step merges once all answered", 99.0, 3, None, 3, K3, 0.42, Decision.MERGE,
         "all 3 live learners answered"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide_round(case: Case) -> None:
    rnd = RoundView(opened_at_s=9.0, answers=case.answers, quorum_reached_at_s=case.reached_s,
                    live_learners=case.live)
    decision, reason = decide_round(case.now_s, rnd, case.policy, grace_s=case.grace_s)
    assert (decision, reason) == (case.decision, case.reason)


def test_decision_values_are_stable_strings() -> None:
    assert [d.value for d in Decision] == ["wait_quorum", "in_grace", "merge"]


def test_policy_rejects_out_of_range_knobs() -> None:
    with pytest.raises(ValueError, match="quorum"):
        QuorumPolicy(quorum=0, tau=2, grace_gamma=0.8)
    with pytest.raises(ValueError, match="tau"):
        QuorumPolicy(quorum=1, tau=0, grace_gamma=0.8)
    with pytest.raises(ValueError, match="grace_gamma"):
        QuorumPolicy(quorum=1, tau=2, grace_gamma=1.5)


@pytest.mark.parametrize(
    "xi_step,xi_quorum,xi_sync,tau,gamma,expected",
    [
        (1.0, 0.5, 0.2, 2, 0.8, 1.0),           # 0.8 * 1.3 = 1.04 -> clamped to xi_step
        (1.0, 1.2, 0.3, 2, 0.8, 0.4),           # 0.8 * 0.5
        (1.0, 1.5, 0.6, 2, 0.8, 0.0),           # negative slack -> 0
        (0.5, 0.1, 0.1, 1, 0.5, 0.15),          # 0.5 * 0.3
        (1.0, 0.1, 0.1, 2, 0.0, 0.0),           # gamma = 0: no grace
    ],
)
def test_grace_window_is_clamped_to_zero_and_one_step(
    xi_step: float, xi_quorum: float, xi_sync: float, tau: int, gamma: float, expected: float
) -> None:
    got = grace_window_s(xi_step_s=xi_step, xi_quorum_s=xi_quorum, xi_sync_s=xi_sync,
                         tau=tau, gamma=gamma)
    assert got == pytest.approx(expected)


def test_grace_window_rejects_negative_times() -> None:
    with pytest.raises(ValueError, match="xi_step_s"):
        grace_window_s(xi_step_s=-1.0, xi_quorum_s=0.0, xi_sync_s=0.0, tau=2, gamma=0.8)


def test_period_is_h_steps() -> None:
    assert period_s(sync_every_steps=24, xi_step_s=0.5) == 12.0


def _due(now_s: float, **kw: object) -> list[int]:
    args: dict[str, object] = dict(owned=list(range(0, 24, 2)), last_opened_s={}, in_flight=(),
                                   period_s=24.0, tau=2, started_s=100.0, n_fragments=24)
    args.update(kw)
    return due_fragments(now_s, **args)  # type: ignore[arg-type]


def test_never_opened_fragments_are_staggered_across_the_period() -> None:
    # Period 24 s over 24 fragments: fragment p is first due at 100 + p seconds.
    assert _due(99.9) == []
    assert _due(100.0) == [0]
    assert _due(101.5) == [0]                    # shard 0 owns the even fragments only
    assert _due(102.0, tau=24) == [0, 2]
    assert _due(111.0, tau=24) == [0, 2, 4, 6, 8, 10]


def test_due_fragments_respect_tau_most_overdue_first() -> None:
    assert _due(200.0, tau=2) == [0, 2]
    # 2 and 4 first due at 102 and 104; 0 re-due at 174 (or 74 when opened at 50).
    assert _due(200.0, tau=3, owned=[0, 2, 4], last_opened_s={0: 150.0}) == [2, 4, 0]
    assert _due(200.0, tau=3, owned=[0, 2, 4], last_opened_s={0: 50.0}) == [0, 2, 4]
    assert _due(200.0, tau=2, owned=[0, 2, 4], last_opened_s={0: 150.0}) == [2, 4]


def test_in_flight_fragments_are_skipped_and_count_against_tau() -> None:
    assert _due(200.0, tau=2, in_flight={0}) == [2]
    assert _due(200.0, tau=2, in_flight={0, 2}) == []
    assert _due(200.0, tau=3, in_flight={2}) == [0, 4]


def test_fragment_reopens_one_period_after_it_was_opened() -> None:
    last = {p: 100.0 + p for p in range(0, 24, 2)}
    assert _due(123.9, last_opened_s=last) == []
    assert _due(124.0, last_opened_s=last) == [0]
    assert _due(126.0, last_opened_s=last) == [0, 2]
    assert _due(126.0, last_opened_s=last, in_flight={0}) == [2]


def test_due_ties_are_broken_by_index() -> None:
    assert _due(500.0, owned=[5, 3, 1], last_opened_s={1: 0.0, 3: 0.0, 5: 0.0}, tau=3) == [1, 3, 5]


def test_ema_starts_empty_and_follows_observations() -> None:
    ema = Ema(alpha=0.5)
    assert ema.value is None
    assert ema.update(2.0) == 2.0                    # first observation sets the value
    assert ema.update(4.0) == 3.0
    assert ema.update(4.0) == 3.5
    assert ema.value == 3.5


def test_ema_with_initial_value_blends_the_first_observation() -> None:
    ema = Ema(alpha=0.2, initial=1.0)
    assert ema.value == 1.0
    assert ema.update(2.0) == pytest.approx(1.2)


def test_ema_rejects_bad_alpha_and_non_finite_observations() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Ema(alpha=0.0)
    with pytest.raises(ValueError, match="finite"):
        Ema().update(float("nan"))


def test_due_fragments_with_spacing_open_one_at_a_time_evenly() -> None:
    owned = [0, 2, 4, 6]
    last = {0: 0.0, 2: 0.0, 4: 0.0, 6: 0.0}  # bunched: all opened at t=0
    kw = dict(owned=owned, last_opened_s=last, in_flight=(), period_s=8.0, tau=4, started_s=0.0,
              n_fragments=8, min_spacing_s=2.0)
    assert due_fragments(8.0, last_open_any_s=0.0, **kw) == [0]          # all due, only one opens
    assert due_fragments(9.0, last_open_any_s=8.0, **kw) == []           # too soon after the last open
    assert due_fragments(10.0, last_open_any_s=8.0, **{**kw, "last_opened_s": {**last, 0: 8.0}}) == [2]
    assert due_fragments(8.0, last_open_any_s=None, **{**kw, "min_spacing_s": 0.0}) == [0, 2, 4, 6]


def test_lockstep_policy_waits_for_every_live_learner_whatever_the_quorum() -> None:
    lock = QuorumPolicy(quorum=1, tau=2, grace_gamma=0.8, all_live=True)
    view = RoundView(opened_at_s=0.0, answers=2, quorum_reached_at_s=None, live_learners=3)
    assert decide_round(5.0, view, lock, grace_s=0.0) == (Decision.WAIT_QUORUM,
                                                          "waiting for quorum: 2/3 answers, 3 live")
    assert decide_round(5.0, view, K1, grace_s=0.0)[0] is Decision.MERGE
    done = RoundView(opened_at_s=0.0, answers=3, quorum_reached_at_s=1.0, live_learners=3)
    assert decide_round(5.0, done, lock, grace_s=0.0) == (Decision.MERGE, "all 3 live learners answered")


def test_lockstep_waits_for_a_killed_learners_replacement_not_for_one_that_finished() -> None:
    """`up --lockstep` sets K = M. A killed learner (not live, not finished) is waited for: its
    replacement answers. One that sent its final answer and left is not: before, every later round
    waited for it until the others' flushes timed out (30 s, their last steps never merged; seen in
    `ddloco compare --chaos` of lock-step, where kills leave the learners' budgets uneven)."""
    lock = QuorumPolicy(quorum=4, tau=2, grace_gamma=0.8, all_live=True)
    killed = RoundView(opened_at_s=0.0, answers=3, quorum_reached_at_s=None, live_learners=3)
    assert decide_round(5.0, killed, lock, grace_s=0.0) == (Decision.WAIT_QUORUM,
                                                            "waiting for quorum: 3/4 answers, 3 live")
    finished = dataclasses.replace(killed, departed=1)
    assert decide_round(5.0, finished, lock, grace_s=0.0) == (Decision.MERGE, "all 3 live learners answered")
    both = RoundView(opened_at_s=0.0, answers=2, quorum_reached_at_s=None, live_learners=2, departed=1)
    assert decide_round(5.0, both, lock, grace_s=0.0)[0] is Decision.WAIT_QUORUM   # 3 expected: one is dead
    gone = RoundView(opened_at_s=0.0, answers=0, quorum_reached_at_s=None, live_learners=0, departed=4)
    assert decide_round(5.0, gone, lock, grace_s=0.0)[0] is Decision.WAIT_QUORUM   # never K = 0
    assert decide_round(5.0, dataclasses.replace(finished, departed=3), K1, grace_s=0.0)[0] is Decision.MERGE


def _simulate(tick: Callable[[], float], *, round_s: Callable[[], float] | None = None,
              tau: int = 2, horizon_s: float = 600.0) -> tuple[list[float], float]:
    """Opens of a shard owning 6 of 12 fragments (period 6 s: one open per second) whose loop
    ticks every ``tick()`` seconds; rounds last ``round_s()`` (None: they end at once). Returns
    the opens' times and the spacing."""
    owned, period, n = [0, 2, 4, 6, 8, 10], 6.0, 12
    spacing = period / len(owned)
    last: dict[int, float] = {}
    ends: dict[int, float] = {}
    sched = OpenSchedule()
    opens: list[float] = []
    now = 0.0
    while now < horizon_s:
        now += tick()
        for p in [p for p, t in ends.items() if t <= now]:
            del ends[p]
        for p in due_fragments(now, owned=owned, last_opened_s=last, in_flight=tuple(ends), period_s=period,
                               tau=tau, started_s=0.0, n_fragments=n, min_spacing_s=spacing,
                               last_open_any_s=sched.last_open_any_s(spacing)):
            last[p] = now
            if round_s is not None:
                ends[p] = now + round_s()
            sched.record(now, spacing)
            opens.append(now)
    return opens, spacing


def test_a_loop_that_runs_late_keeps_the_opening_schedule() -> None:
    """A shard's loop reaches each open a little late (its poll, a busy core). Spaced from the
    previous open's slot, the opens keep their rate: rounds still come every H steps. (Spaced
    from when each open happened, the lateness adds up: here 4 % fewer opens.)"""
    import random
    rng = random.Random(0)
    opens, spacing = _simulate(lambda: 0.02 + rng.uniform(0.0, 0.1))   # a 20 ms poll + up to 100 ms of work
    assert len(opens) >= 0.99 * 600.0 / spacing
    gaps = [b - a for a, b in zip(opens, opens[1:])]
    assert min(gaps) >= spacing / 2 and max(gaps) < 2 * spacing   # no bursts, no holes


def test_stalls_are_made_up_but_never_by_opens_closer_than_half_a_spacing() -> None:
    """Every few seconds the loop stalls for 0.5-0.9 spacings: the time lost is made up (the rest,
    here 2 %, is each stalled fragment's own next round coming later; spaced from when each open
    happened, 6 % of the opens are lost)."""
    import random
    rng = random.Random(2)
    opens, spacing = _simulate(lambda: 0.02 + (rng.uniform(0.5, 0.9) if rng.random() < 0.005 else 0.0))
    assert len(opens) >= 0.98 * 600.0 / spacing
    assert min(b - a for a, b in zip(opens, opens[1:])) >= spacing / 2


def test_rounds_in_flight_holding_a_shard_back_do_not_make_it_open_in_pairs() -> None:
    """τ = 2 rounds in flight, each lasting 1.5-3.5 spacings: the cap holds opens back. Two rounds
    that end close together must not be followed by two opens back to back."""
    import random
    rng = random.Random(1)
    opens, spacing = _simulate(lambda: 0.02, round_s=lambda: rng.uniform(1.5, 3.5))
    assert min(b - a for a, b in zip(opens, opens[1:])) >= spacing / 2


def test_the_schedule_keeps_its_slot_makes_up_one_spacing_and_waits_half_a_spacing() -> None:
    s = OpenSchedule()
    assert s.last_open_any_s(1.0) is None
    s.record(5.0, 1.0)
    assert (s.slot_s, s.last_open_any_s(1.0)) == (5.0, 5.0)
    s.record(6.05, 1.0)                  # 50 ms late: the slot is kept, the next open due at 7.0
    assert (s.slot_s, s.last_open_any_s(1.0)) == (6.0, 6.0)
    s.record(17.0, 1.0)                  # 10 s late (a stall): one spacing of it made up, no more
    assert s.slot_s == 16.0 and s.last_open_any_s(1.0) == 16.5    # the next open at 17.5, not at once
    s.record(3.0, 0.0)                   # no spacing (lock-step): now
    assert s.slot_s == 3.0
