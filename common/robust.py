"""Robust merge (ALGORITHM §5, "Robust merge"): what one answer may claim and move.

A shard checks every answer before it can weigh in a merge:

- its decoded delta is finite (one bad answer is dropped, never the round);
- its step claim is clamped to ``max_steps_claim``: the larger of ``max_steps_factor × H ×
  (versions since its base + 1)`` and the steps the learner could have taken since its base was
  merged at its observed step time (× ``TIME_SLACK``, + H), so an honest learner that trained on
  while a shard or the broker was away is never cut; its token claim to ``c_steps ×
  tokens_per_step_bound`` (the run's tokens per inner step: the task's batch ×
  ``inner_grad_accum``, × 2 for batches that vary in size): clamped, not refused, and a lie weighs
  no more than that;

and at the merge, each contributor's outer gradient Δ_m is clipped to ``factor ×`` the median
norm of the fragment's last ``window`` accepted outer gradients (after ``min_samples``), so a
finite but huge delta (1e30) moves Θ no more than a few ordinary rounds do. The norm is the one of
the fragment's *parameters* only: buffers (BatchNorm statistics, integer counters such as
``num_batches_tracked``) move by their own rule (common.merge) and take no part in the bound, nor
are they scaled by it. Zero norms (a fragment of buffers only, or a learner that sends nothing)
are not recorded: they cannot drag the median down.

Rejections and cuts are counted by reason (``REASONS``); the counts go to Redis and the report.
A claim cut by at most ``CLAMP_TOLERANCE ×`` is reported as ``claims_clamped`` (timing noise of an
honest member), apart from rejections of hostile input.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

REASONS = ("nonfinite_delta", "tokens_claim", "steps_claim", "clipped")
TIME_SLACK = 1.5
"""Steps an answer may claim per step time of the learner since its base was merged (a learner's
step-time EMA lags its current speed; 1.5 leaves room for a 50 % speed-up)."""
STEP_TIME_FLOOR_OF_MEDIAN = 0.25
"""The step time a claim is checked against is the learner's own EMA, but never below this × the
median of the live learners' (what a learner reports about itself cannot buy it more than 4 ×
the steps of a typical member)."""
STEP_TIME_UNKNOWN_S = 0.001
"""The step time of a learner whose own is not known yet (before its first heartbeats, the first
second of a run) when no other learner's is either: 1,000 steps a second, faster than any training
step worth distributing, so no honest first answer is cut; in that first second a member's claim
may reach that rate (the fastest step time known takes over as soon as there is one)."""
CLAMP_TOLERANCE = 2.0
"""A claim at most this × its bound is counted as clamped (an honest member's timing), not rejected."""


def steps_in_time(*, elapsed_s: float, step_s: float, sync_every_steps: int) -> float:
    """The inner steps a learner stepping every ``step_s`` can take in ``elapsed_s``, with
    ``TIME_SLACK`` and one period H on top (inf when its step time is unknown)."""
    if not (math.isfinite(elapsed_s) and math.isfinite(step_s) and step_s > 0):
        return math.inf
    return math.ceil(TIME_SLACK * max(elapsed_s, 0.0) / step_s) + sync_every_steps


def claims_reference(seen: tuple[int, float, float] | None, round_id: int, now: float,
                     joined: float) -> tuple[float, tuple[int, float, float]]:
    """When the steps of a learner's answer to round ``round_id`` of a fragment started counting,
    and its record afterwards. ``seen`` = (round, reference, last) of its previous answers to that
    fragment (None: none; then ``joined``, when it was first seen). A new round counts from its
    last answer (the learner subtracts what it answered once the merge arrives); an answer to the
    same round again (a re-sent open) from the same point as the first one."""
    if seen is not None and seen[0] == round_id:
        reference = seen[1]
    else:
        reference = seen[2] if seen is not None else joined
    return reference, (round_id, reference, now)


def max_steps_claim(*, versions_since_base: int, sync_every_steps: int, factor: int, elapsed_s: float,
                    step_s: float) -> int:
    """The most inner steps an answer on a base ``versions_since_base`` versions old, merged
    ``elapsed_s`` seconds ago, may weigh as, for a learner stepping every ``step_s`` seconds:
    ``factor × H × (versions + 1)`` while rounds run, and what that learner could train in the
    elapsed time when they did not (an outage of a shard or the broker: versions stop, learners
    go on)."""
    by_versions = factor * sync_every_steps * (max(versions_since_base, 0) + 1)
    by_time = steps_in_time(elapsed_s=elapsed_s, step_s=step_s, sync_every_steps=sync_every_steps)
    return by_versions if math.isinf(by_time) else max(by_versions, by_time)


def bound_claims(*, steps: int, tokens: int, tokens_per_step_bound: float,
                 max_steps: int) -> tuple[int, int, list[str]]:
    """(steps, tokens) as an answer may weigh in the merge, and the reasons they were cut.

    Claims are clamped, not refused: a learner that legitimately kept training while its rounds
    stalled (a shard down) still contributes, with the weight of ``max_steps`` steps at most, and
    a lie buys no more than that. A cut of at most ``CLAMP_TOLERANCE ×`` is named
    ``claims_clamped`` (an honest member's timing), a larger one by the claim it cut."""
    cut = []

    def reason(claimed: float, bound: float, name: str) -> str:   # a mild excess is timing, not a lie
        return "claims_clamped" if claimed <= CLAMP_TOLERANCE * bound else name
    tokens = max(int(tokens), 0)
    bound = int(steps * tokens_per_step_bound)
    if tokens > bound:                       # more tokens than the steps it claims could hold
        tokens, cut = bound, cut + [reason(tokens, bound, "tokens_claim")]
    if steps > max_steps:                    # more steps than a learner can take in that time:
        tokens = int(tokens * max_steps / steps)   # weigh as max_steps of the same kind
        steps, cut = max_steps, cut + [reason(steps, max_steps, "steps_claim")]
    return steps, tokens, cut


@dataclass
class NormClipper:
    """Per fragment: clip outer-gradient norms to ``factor ×`` the median of recent ones. Until
    ``min_samples`` norms are known there is no median: an outer gradient larger than
    ``ceiling_factor ×`` the fragment's own norm (``reference``, at least 1) is then dropped
    (scale 0) rather than merged; an honest one is at most a few times that norm even in the first
    rounds."""

    factor: float = 4.0
    window: int = 32
    min_samples: int = 8
    ceiling_factor: float = 100.0
    norms: deque = field(default_factory=lambda: deque(maxlen=32))
    steps: deque = field(default_factory=lambda: deque(maxlen=32))
    """The inner steps behind each recorded norm (an answer given ``steps``; else none)."""

    def __post_init__(self) -> None:
        self.norms = deque(self.norms, maxlen=self.window)
        self.steps = deque(self.steps, maxlen=self.window)

    def bound(self, steps: float | None = None) -> float | None:
        """``factor ×`` the median recent norm; for an answer of ``steps`` inner steps, stretched by
        ``steps / the median recent steps`` when that is above 1 (a learner that trained on through
        an outage sends the outer gradient of many steps at once: honest, and not cut). Callers
        pass the steps the time since the answer's base allows at most (``steps_in_time``), so a
        claim cannot stretch the bound beyond what the clock does."""
        if len(self.norms) < self.min_samples:
            return None
        base = self.factor * statistics.median(self.norms)
        if steps is None or not self.steps:
            return base
        return base * max(1.0, steps / max(statistics.median(self.steps), 1.0))

    def observe(self, norm: float, reference: float | None = None, steps: float | None = None) -> float:
        """Record an outer gradient's norm (of an answer of ``steps`` inner steps, when known); the
        factor to scale it by: 1.0 (not clipped), in (0, 1) (clipped to the bound), 0.0 (dropped:
        above the warm-up ceiling, or not finite)."""
        bound = self.bound(steps)
        if not math.isfinite(norm):
            return 0.0
        if norm == 0.0:                              # nothing to scale, and no sample: zeros cannot drag the median
            return 1.0
        if bound is None:
            if reference is not None and norm > self.ceiling_factor * max(reference, 1.0):
                return 0.0                           # not recorded: a lie must not shape the median
        elif norm > bound > 0.0:
            # recorded as the medians: repeated attacks cannot drag them up
            self.norms.append(statistics.median(self.norms))
            if steps is not None and self.steps:
                self.steps.append(statistics.median(self.steps))
            return bound / norm
        self.norms.append(norm)
        if steps is not None:
            self.steps.append(steps)
        return 1.0

    def clip(self, outer: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the outer gradient, scaled down to the bound if above it; whether it was)."""
        scale = self.observe(float(torch.linalg.vector_norm(outer, dtype=torch.float64)))   # 1e30s: no overflow
        return (outer, False) if scale == 1.0 else (outer * scale, True)
