"""Round policy of a syncer shard (ALGORITHM.md §4) as pure functions of ``now`` and state.

Nothing here reads a clock: ``now_s`` is always passed in, so tests use fixed times instead of
sleeping. Decisions come with a reason string, which is both the log line and what tests
assert on (after torchft's ``quorum_compute``).

- ``decide_round``: may an open round merge now? (minimum quorum K + adaptive grace window)
- ``grace_window_s``: the grace window of Eq. 3.
- ``due_fragments``: which owned fragments to open now (staggered, at most τ in flight).
- ``Ema``: the moving averages ξ_step, ξ_quorum, ξ_sync those decisions use.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence


class Decision(enum.Enum):
    """What to do with an open round now."""

    WAIT_QUORUM = "wait_quorum"
    """Fewer than K answers: keep the round open."""
    IN_GRACE = "in_grace"
    """Quorum reached, grace window running: keep collecting answers."""
    MERGE = "merge"
    """Merge the answers received so far and close the round."""


@dataclass(frozen=True, kw_only=True)
class RoundView:
    """What the policy needs to know about one open round."""

    opened_at_s: float
    """When the round was opened (seconds, same clock as ``now_s``)."""
    answers: int
    """Valid answers received so far."""
    quorum_reached_at_s: float | None
    """When the answer count first reached K; None if not yet recorded."""
    live_learners: int
    """Learners with a fresh heartbeat."""
    answering: int | None = None
    """Live learners past their join (training, blocked at a barrier, flushing): those that answer
    rounds (None: ``live_learners``)."""
    departed: int = 0
    """Learners that left after their training ended (their budget done): lock-step's K = M no
    longer counts them (it waits for a killed learner's replacement, not for one that finished)."""

    def __post_init__(self) -> None:
        if self.answers < 0 or self.live_learners < 0 or self.departed < 0:
            raise ValueError(
                f"answers, live_learners and departed must be >= 0, got {self.answers}, "
                f"{self.live_learners}, {self.departed}"
            )


@dataclass(frozen=True, kw_only=True)
class QuorumPolicy:
    """The round policy's knobs (see ``AlgoConfig``)."""

    quorum: int
    """K: minimum answers before a round may merge (K = M is lock-step DiLoCo)."""
    tau: int
    """τ: at most τ rounds in flight per shard; the grace budget is τ learner steps."""
    grace_gamma: float
    """γ: fraction of the slack spent in the grace window."""
    grace_enabled: bool = True
    """Off: merge as soon as the quorum is reached."""
    all_live: bool = False
    """Lock-step: a round waits for every live learner and for ``quorum`` answers less the
    learners that finished and left (``RoundView.departed``)."""
    min_answers: int = 1
    """Robust floor: a round merges only with answers from at least min(this, answering learners)
    members, so that no one member fills a quorum (with 3, a hostile answer is never the round's
    median, nor half its weight, while at least 3 learners answer)."""
    min_answers_wait_s: float = math.inf
    """How long a round waits for that floor; then the plain quorum K applies (honest learners
    that cannot answer, not a member's choice, are what keeps a round below it)."""

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {self.quorum}")
        if self.tau < 1:
            raise ValueError(f"tau must be >= 1, got {self.tau}")
        if not 0.0 <= self.grace_gamma <= 1.0:
            raise ValueError(f"grace_gamma must be in [0, 1], got {self.grace_gamma}")
        if self.min_answers < 1:
            raise ValueError(f"min_answers must be >= 1, got {self.min_answers}")


def _check_duration(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")


def grace_window_s(
    *, xi_step_s: float, xi_quorum_s: float, xi_sync_s: float, tau: int, gamma: float
) -> float:
    """Adaptive grace window (Eq. 3): clamp(γ·(τ·ξ_step − ξ_quorum − ξ_sync), 0, ξ_step)."""
    for name, value in (("xi_step_s", xi_step_s), ("xi_quorum_s", xi_quorum_s),
                        ("xi_sync_s", xi_sync_s), ("gamma", gamma)):
        _check_duration(name, value)
    if tau < 1:
        raise ValueError(f"tau must be >= 1, got {tau}")
    slack = tau * xi_step_s - xi_quorum_s - xi_sync_s
    return min(max(gamma * slack, 0.0), xi_step_s)


def decide_round(
    now_s: float, rnd: RoundView, policy: QuorumPolicy, *, grace_s: float
) -> tuple[Decision, str]:
    """Decide whether an open round merges now; returns ``(decision, reason)``.

    K is raised to min(``min_answers``, answering learners) for the first ``min_answers_wait_s``
    of a round (the robust floor). In order: fewer than K answers waits; every live learner answered merges at once; with the
    grace window disabled the quorum merges at once; otherwise merge once ``grace_s`` has passed
    since the quorum was reached (a round whose quorum time is not recorded yet counts as
    reaching it at ``now_s``).
    """
    _check_duration("grace_s", grace_s)
    k = max(policy.quorum - rnd.departed, rnd.live_learners, 1) if policy.all_live else policy.quorum
    if policy.min_answers > 1 and now_s - rnd.opened_at_s < policy.min_answers_wait_s:
        answering = rnd.live_learners if rnd.answering is None else rnd.answering
        k = max(k, min(policy.min_answers, answering))
    if rnd.answers < k:
        return (
            Decision.WAIT_QUORUM,
            f"waiting for quorum: {rnd.answers}/{k} answers, {rnd.live_learners} live",
        )
    if rnd.answers >= rnd.live_learners:
        return Decision.MERGE, f"all {rnd.live_learners} live learners answered"
    if not policy.grace_enabled:
        return Decision.MERGE, f"quorum {rnd.answers}/{k} reached, grace disabled"
    reached_s = now_s if rnd.quorum_reached_at_s is None else rnd.quorum_reached_at_s
    deadline_s = reached_s + grace_s
    if now_s >= deadline_s:
        return (
            Decision.MERGE,
            f"grace window {grace_s:.3f}s elapsed with {rnd.answers} answers",
        )
    return (
        Decision.IN_GRACE,
        f"in grace window: {deadline_s - now_s:.3f}s of {grace_s:.3f}s left, "
        f"{rnd.answers} answers",
    )


def due_fragments(
    now_s: float,
    *,
    owned: Sequence[int],
    last_opened_s: Mapping[int, float],
    in_flight: Collection[int],
    period_s: float,
    tau: int,
    started_s: float,
    n_fragments: int,
    min_spacing_s: float = 0.0,
    last_open_any_s: float | None = None,
) -> list[int]:
    """Owned fragments to open now, most overdue first (ties: lowest index).

    With ``min_spacing_s > 0`` at most one fragment opens per call and none before
    ``last_open_any_s + min_spacing_s``: a shard then opens its fragments round-robin, evenly
    spaced over the period, so late rounds do not bunch up into bursts that stay bunched.

    A fragment never opened is due at ``started_s + period_s * p / n_fragments`` (staggered so
    that about one fragment in the whole model is in motion per ``period_s / n_fragments``);
    afterwards at ``last_opened_s[p] + period_s``. Fragments in flight are skipped, and the
    result is cut so that ``len(in_flight) + len(result) <= tau``.
    """
    _check_duration("period_s", period_s)
    if tau < 1:
        raise ValueError(f"tau must be >= 1, got {tau}")
    if n_fragments < 1:
        raise ValueError(f"n_fragments must be >= 1, got {n_fragments}")
    capacity = tau - len(in_flight)
    if capacity <= 0:
        return []
    if min_spacing_s > 0:
        if last_open_any_s is not None and now_s < last_open_any_s + min_spacing_s:
            return []
        capacity = 1
    due: list[tuple[float, int]] = []
    for p in owned:
        if p in in_flight:
            continue
        if p in last_opened_s:
            due_at_s = last_opened_s[p] + period_s
        else:
            due_at_s = started_s + period_s * p / n_fragments
        if now_s >= due_at_s:
            due.append((due_at_s, p))
    due.sort()
    return [p for _, p in due[:capacity]]


class OpenSchedule:
    """A shard's opening schedule. Opens are spaced from the previous open's *slot* (its place in
    the schedule), not from when the loop got to it: a loop that runs a little late each time (a
    20 ms poll, a busy core) would otherwise push every later open back by its lateness, and the
    delays add up until rounds come less often than every H steps. Up to one spacing of lateness
    (a stall, rounds in flight holding the shard back) is made up, by opens half a spacing apart;
    more is dropped. Two opens are never closer than half a spacing: no bursts."""

    def __init__(self) -> None:
        self.slot_s: float | None = None
        """The slot of the last open."""
        self.last_s: float | None = None
        """When the last open actually happened."""

    def record(self, now_s: float, spacing_s: float) -> None:
        """An open happened at ``now_s``."""
        if self.slot_s is None or spacing_s <= 0:
            self.slot_s = now_s
        else:
            self.slot_s = max(self.slot_s + spacing_s, now_s - spacing_s)
        self.last_s = now_s

    def last_open_any_s(self, spacing_s: float) -> float | None:
        """What ``due_fragments`` takes as ``last_open_any_s``: the next open may come one
        spacing after the slot, but not sooner than half a spacing after the last open."""
        if self.slot_s is None or self.last_s is None:
            return None
        return max(self.slot_s, self.last_s - spacing_s / 2)


def period_s(*, sync_every_steps: int, xi_step_s: float) -> float:
    """Seconds between two rounds of the same fragment: H · ξ_step."""
    if sync_every_steps < 1:
        raise ValueError(f"sync_every_steps must be >= 1, got {sync_every_steps}")
    _check_duration("xi_step_s", xi_step_s)
    return sync_every_steps * xi_step_s


class Ema:
    """Exponential moving average: ``value ← alpha·x + (1 − alpha)·value``.

    ``value`` is None until the first update unless ``initial`` is given; the first update of
    an empty average sets it to ``x``.
    """

    def __init__(self, alpha: float = 0.2, initial: float | None = None) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if initial is not None and not math.isfinite(initial):
            raise ValueError(f"initial must be finite, got {initial}")
        self.alpha = alpha
        self._value: float | None = None if initial is None else float(initial)

    @property
    def value(self) -> float | None:
        """Current average (None before the first update when no initial value was given)."""
        return self._value

    def update(self, x: float) -> float:
        """Fold in one observation and return the new average."""
        if not math.isfinite(x):
            raise ValueError(f"Ema observation must be finite, got {x}")
        if self._value is None:
            self._value = float(x)
        else:
            self._value = self.alpha * float(x) + (1.0 - self.alpha) * self._value
        return self._value

    def __repr__(self) -> str:
        return f"Ema(alpha={self.alpha}, value={self._value})"
