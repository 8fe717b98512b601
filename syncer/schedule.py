"""The shard's round scheduling (ALGORITHM §4): which open rounds merge or are re-sent, which
fragments open next, and the log of each round's state, with no socket, Redis or clock inside.

Every method takes ``now`` and plain state; ``tests/unit/test_round_schedule.py`` drives it at
fixed times. The shard's loop (``Shard._advance_rounds``) is the I/O around it.

Ownership: a ``RoundSchedule`` and a ``RoundStateLog`` belong to the shard's loop thread (their
mutable state, the opening schedule and the last state logged per fragment, is changed only by
its calls).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

from common.config import AlgoConfig
from common.quorum import (Decision, OpenSchedule, QuorumPolicy, RoundView, decide_round, due_fragments,
                           grace_window_s)

from syncer.state import OpenRound


@dataclass(frozen=True, kw_only=True)
class Learners:
    """What the schedule knows of the learners: the shard's last read of Redis."""

    live: int
    """Learners with a fresh heartbeat."""
    answering: int
    """Live learners that hold a copy of every fragment (training, blocked, flushing): those that answer."""
    step_times_s: tuple[float, ...] = ()
    """The live learners' step-time EMAs (plausible ones only)."""
    finishing: bool = False
    """A live learner sent its final answer (its steps are done): rounds open back to back."""
    departed: int = 0
    """Learners no longer live that left after their training ended: done, not dead."""


@dataclass(frozen=True)
class RoundCall:
    """The decision on one open round now."""

    fragment: int
    decision: Decision
    reason: str
    """``decide_round``'s reason: the log line and what tests assert."""
    reopen: bool = False
    """Still waiting for its quorum and unanswered long enough: send the open again."""
    round_id: int = 0


def xi_step_s(step_times_s: Sequence[float], *, slowest: bool, initial_s: float) -> float:
    """ξ_step: the slowest (grace window, re-sends) or the median (period) learner step time;
    ``initial_s`` before any learner reported one."""
    if not step_times_s:
        return initial_s
    return max(step_times_s) if slowest else statistics.median(step_times_s)


class RoundSchedule:
    """When rounds merge, are re-sent and open, for one shard's fragments."""

    def __init__(self, *, policy: QuorumPolicy, algo: AlgoConfig, started_s: float, initial_step_time_s: float,
                 min_answers_wait_periods: float, reopen_after_steps: float) -> None:
        self.policy = policy
        self.algo = algo
        self.started_s = started_s
        self.initial_step_time_s = initial_step_time_s
        self.min_answers_wait_periods = min_answers_wait_periods
        self.reopen_after_steps = reopen_after_steps
        self.opens = OpenSchedule()
        """Where the opening schedule stands (common/quorum.py)."""

    def xi_step_s(self, learners: Learners, *, slowest: bool) -> float:
        return xi_step_s(learners.step_times_s, slowest=slowest, initial_s=self.initial_step_time_s)

    def grace_s(self, learners: Learners, *, xi_quorum_s: float, xi_sync_s: float) -> float:
        """The adaptive grace window now (Eq. 3), from the slowest learner's step time."""
        return grace_window_s(xi_step_s=self.xi_step_s(learners, slowest=True), xi_quorum_s=xi_quorum_s,
                              xi_sync_s=xi_sync_s, tau=self.algo.tau, gamma=self.algo.grace_gamma)

    def reopen_after_s(self, attempt: int, xi_step: float) -> float:
        """Re-send an unanswered open (it may have been lost) with exponential backoff, so a
        round that simply waits for slow learners does not make fast ones re-answer often."""
        return self.reopen_after_steps * xi_step * (2 ** min(attempt, 3))

    def decide(self, now: float, rounds: Mapping[int, OpenRound], learners: Learners, *,
               grace_s: float) -> list[RoundCall]:
        """The decision on every open round (``common.quorum.decide_round``), in fragment order."""
        xi_step = self.xi_step_s(learners, slowest=True)
        policy = dataclasses.replace(self.policy, min_answers_wait_s=self.min_answers_wait_periods
                                     * self.algo.sync_every_steps * xi_step)
        calls = []
        for p, rnd in rounds.items():
            view = RoundView(opened_at_s=rnd.opened_at, answers=len(rnd.answers), quorum_reached_at_s=rnd.quorum_at,
                             live_learners=learners.live, answering=learners.answering,
                             departed=learners.departed)
            decision, reason = decide_round(now, view, policy, grace_s=grace_s)
            reopen = (decision is Decision.WAIT_QUORUM
                      and now - rnd.last_sent_at >= self.reopen_after_s(rnd.attempt, xi_step))
            calls.append(RoundCall(p, decision, reason, reopen, rnd.round_id))
        return calls

    def due(self, now: float, *, ready: Sequence[int], last_opened_s: Mapping[int, float],
            in_flight: Collection[int], owned: int, learners: Learners) -> list[int]:
        """The fragments to open now (``common.quorum.due_fragments``), recorded as opened."""
        algo = self.algo
        if algo.lockstep:
            period, tau = 0.0, owned
        elif learners.finishing:
            # a learner took its last step and waits for its final answers to merge: no period to
            # keep (its steps are done), rounds back to back, τ in flight (the end of a run: no
            # learner idles a whole period of rounds, ~8 % of a 3 s run)
            period, tau = 0.0, algo.tau
        else:
            period, tau = algo.sync_every_steps * self.xi_step_s(learners, slowest=False), algo.tau
        spacing = period / owned
        due = due_fragments(now, owned=ready, last_opened_s=last_opened_s, in_flight=in_flight, period_s=period,
                            tau=tau, started_s=self.started_s, n_fragments=algo.fragments, min_spacing_s=spacing,
                            last_open_any_s=self.opens.last_open_any_s(spacing))
        for _ in due:
            self.opens.record(now, spacing)
        return due


class RoundStateLog:
    """Each open round's state, logged on change (torchft's ``log_if_changed``): one line when the
    (decision, reason) of a fragment's round changes, so a stuck round says why ("waiting for
    quorum: 1/3 answers, 4 live"), and a waiting one says nothing more until something changes.
    In the grace window only the decision counts: its reason counts down at every poll, and the
    round merges when the window ends whatever comes in meanwhile."""

    def __init__(self, emit: Callable[..., Any]) -> None:
        """``emit(event, **fields)``: a structlog logger's ``info``."""
        self._emit = emit
        self._last: dict[int, tuple[Any, ...]] = {}
        """Fragment -> the state last logged."""

    def observe(self, call: RoundCall) -> bool:
        """Log ``call`` when its state differs from the last one logged for its fragment; True if logged."""
        key: tuple[Any, ...] = ((call.round_id, call.decision) if call.decision is Decision.IN_GRACE
                                else (call.round_id, call.decision, call.reason))
        if self._last.get(call.fragment) == key:
            return False
        self._last[call.fragment] = key
        self._emit("syncer.round_state", fragment=call.fragment, round=call.round_id, decision=call.decision.value,
                   reason=call.reason)
        return True
