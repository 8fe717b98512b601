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
from typing import Any, Callable, Sequence

import torch

from common.merge import contribution_weights
from common.quant import EncodedVector

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


LEARNER_SAMPLES = 8
"""Recent outer-gradient norms kept per learner and fragment (``NormClipper``)."""
LEARNERS_TRACKED = 1024
"""Learners a fragment's clipper keeps samples of (the least recently seen are forgotten first)."""
ROUND_FACTOR = 1.5
"""In a round of at least ``ROUND_MIN_ANSWERS`` answers, each outer gradient is clipped to this ×
the round's weighted median norm (the norm of an honest answer while fewer than half the weight
is hostile)."""
ROUND_MIN_ANSWERS = 3


@dataclass
class NormClipper:
    """Per fragment: clip outer-gradient norms to ``factor ×`` a reference norm that a minority of
    members cannot drag: the median, over the learners that answered the fragment, of each one's
    median of its last ``LEARNER_SAMPLES`` norms. A hostile learner's norms, however it picks
    them, are one value in that median: fewer than half the learners cannot move it beyond the
    honest ones' range (a pool of everyone's last norms drifted 4 × per window once half the
    answers were hostile). Until ``min_samples`` norms are known there is no reference: an outer
    gradient larger than ``ceiling_factor ×`` the fragment's own norm (``reference``, at least 1)
    is then dropped (scale 0) rather than merged, and the round's own weighted median bounds the
    others (``round_bound``). Not thread-safe, and needs not be: one thread at a time owns a
    fragment's clipper (a shard hands it to the merge worker with the merge and takes it back
    with the result, ``syncer/merging.py``)."""

    factor: float = 4.0
    window: int = LEARNER_SAMPLES
    """Norms kept per learner."""
    min_samples: int = 8
    ceiling_factor: float = 100.0
    by_learner: dict = field(default_factory=dict)
    """learner -> deque of (norm, steps) of its recent answers (insertion order: least recently
    seen first)."""

    @property
    def norms(self) -> list[float]:
        """Every recorded norm (oldest learner first)."""
        return [n for d in self.by_learner.values() for n, _ in d]

    def _samples(self) -> int:
        return sum(len(d) for d in self.by_learner.values())

    _medians: dict = field(default_factory=dict, repr=False, compare=False)
    """learner -> (its deque, its last entry, its length, median norm, median steps or None): each
    learner's medians, recomputed only when its deque changed (a merge asks for the bound once per
    answer; sorting every learner's window each time was most of the robust rules' cost)."""

    def _learner_medians(self) -> list[tuple[float, float | None]]:
        out = []
        for learner, d in self.by_learner.items():
            if not d:
                continue
            c = self._medians.get(learner)
            if c is None or c[0] is not d or c[1] is not d[-1] or c[2] != len(d):
                steps = [s for _, s in d if s is not None]
                c = (d, d[-1], len(d), statistics.median([n for n, _ in d]), statistics.median(steps) if steps else None)
                self._medians[learner] = c
            out.append((c[3], c[4]))
        if len(self._medians) > len(self.by_learner) + LEARNERS_TRACKED:   # learners no longer tracked
            self._medians = {k: v for k, v in self._medians.items() if k in self.by_learner}
        return out

    def reference(self, medians: list[tuple[float, float | None]] | None = None) -> float | None:
        """The median over learners of their median recent norm (None before ``min_samples``)."""
        if self._samples() < self.min_samples:
            return None
        return statistics.median(n for n, _ in (self._learner_medians() if medians is None else medians))

    def _steps_reference(self, medians: list[tuple[float, float | None]]) -> float | None:
        meds = [s for _, s in medians if s is not None]
        return statistics.median(meds) if meds else None

    def bound(self, steps: float | None = None) -> float | None:
        """``factor ×`` the reference norm; for an answer of ``steps`` inner steps, stretched by
        ``steps / the reference steps`` when that is above 1 (a learner that trained on through
        an outage sends the outer gradient of many steps at once: honest, and not cut). Callers
        pass the steps the time since the answer's base allows at most (``steps_in_time``), so a
        claim cannot stretch the bound beyond what the clock does."""
        medians = self._learner_medians()
        ref = self.reference(medians)
        if ref is None:
            return None
        base = self.factor * ref
        ref_steps = self._steps_reference(medians) if steps is not None else None
        if ref_steps is None:
            return base
        return base * max(1.0, steps / max(ref_steps, 1.0))

    def _record(self, learner: str, norm: float, steps: float | None) -> None:
        d = self.by_learner.pop(learner, None)
        if d is None:
            d = deque(maxlen=self.window)
            while len(self.by_learner) >= LEARNERS_TRACKED:
                self.by_learner.pop(next(iter(self.by_learner)))
        d.append((norm, steps))
        self.by_learner[learner] = d        # re-inserted: most recently seen last

    def observe(self, norm: float, reference: float | None = None, steps: float | None = None,
                learner: str = "", limit: float | None = None) -> float:
        """Record an outer gradient's norm (of an answer of ``steps`` inner steps, when known, from
        ``learner``); the factor to scale it by: 1.0 (not clipped), in (0, 1) (clipped to the
        bound, or to ``limit`` when that is lower: the round's own bound), 0.0 (dropped: above the
        warm-up ceiling, or not finite)."""
        bound = self.bound(steps)
        if not math.isfinite(norm):
            return 0.0
        if norm == 0.0:                              # nothing to scale, and no sample: zeros cannot drag the median
            return 1.0
        if bound is None and reference is not None and norm > self.ceiling_factor * max(reference, 1.0):
            return 0.0                               # not recorded: a lie must not shape the median
        cap = min(b for b in (bound, limit) if b is not None) if (bound, limit) != (None, None) else None
        if cap is not None and norm > cap > 0.0:
            # recorded as the reference (or, before there is one, as the cap): a learner's repeated
            # attacks cannot drag its own median up, let alone the fragment's
            ref = self.reference()
            self._record(learner, limit / ROUND_FACTOR if ref is None else ref, steps)
            return cap / norm
        self._record(learner, norm, steps)
        return 1.0

    def clip(self, outer: torch.Tensor, learner: str = "") -> tuple[torch.Tensor, bool]:
        """(the outer gradient, scaled down to the bound if above it; whether it was)."""
        scale = self.observe(float(torch.linalg.vector_norm(outer, dtype=torch.float64)), learner=learner)   # 1e30s: no overflow
        return (outer, False) if scale == 1.0 else (outer * scale, True)


def weighted_median(values: list[float], weights: list[float]) -> float:
    """The lower weighted median of ``values`` (``common.merge.weighted_median_rows``'s rule: the
    smallest value at which the weight at or below it reaches half the total; the smallest value
    when none does), in plain Python: a round's few answers, once per merge."""
    pairs = sorted(zip(values, weights), key=lambda p: p[0])
    half, cum = 0.5 * float(torch.tensor(weights, dtype=torch.float64).sum()), 0.0   # torch's sum, as the rows'
    for v, w in pairs:
        cum += float(w)
        if cum >= half:
            return float(v)
    return float(pairs[0][0])


def round_bound(norms: list[float], weights: list[float]) -> float | None:
    """The norm no outer gradient of a round may exceed, from the round itself: ``ROUND_FACTOR ×``
    the weighted median of its answers' (finite, non-zero) norms, once it has at least
    ``ROUND_MIN_ANSWERS`` of them (None otherwise). With fewer than half the weight hostile the
    median is an honest answer's norm: bounded from the first round, before any history."""
    kept = [(n, w) for n, w in zip(norms, weights) if math.isfinite(n) and n > 0.0 and w > 0.0]
    if len(kept) < ROUND_MIN_ANSWERS:
        return None
    return ROUND_FACTOR * weighted_median([n for n, _ in kept], [w for _, w in kept])


def fair_weights(c_tokens: list[float], c_steps: list[float]) -> tuple[torch.Tensor, list[int]]:
    """The round's contribution weights (``common.merge.contribution_weights``: tokens² / steps,
    normalised) with no answer above a fair share: each raw weight is capped at the lower median
    of the round's positive raw weights, so no member, whatever it claims, weighs more than a
    typical one (with M answers of which f < M / 2 hostile, together at most f / M' of the
    round, M' the answers at or above the median). Returns (ŵ [M] float32, the indices capped)."""
    raw = contribution_weights(c_tokens, c_steps).to(torch.float64)       # proportional to tokens² / steps
    positive = sorted(float(w) for w in raw if w > 0)
    if len(positive) < 2:
        return raw.to(torch.float32), []
    cap = positive[(len(positive) - 1) // 2]                              # the lower median
    capped = [i for i, w in enumerate(raw.tolist()) if w > cap]
    raw = raw.clamp(max=cap)
    return (raw / raw.sum()).to(torch.float32), capped


def fold_round(acc: Any, theta: torch.Tensor, answers: Sequence[tuple[str, torch.Tensor, torch.Tensor, float | None]],
               weights: Sequence[float], clipper: NormClipper, *, buf: torch.Tensor | None = None,
               buffer_ceiling: float | None = None) -> list[float]:
    """The robust merge of one round into ``acc`` (a ``common.merge.OuterAccumulator``).
    ``answers``: (learner, its base value, its δ_m, the steps that may stretch its bound) with
    ŵ ``weights``. Two passes over the answers, as many as a plain merge makes: first every
    Δ_m = Θ − (base + δ_m) is measured (its norm over the parameter pieces); then each is scaled
    to the lower of the clipper's bound (history) and the round's own (``round_bound``) and
    folded in. An answer moving float buffers beyond ``buffer_ceiling`` is left out. Returns
    each answer's scale (1: as sent; 0: left out)."""
    whole = acc.round_kernels(theta, [(base, delta) for _, base, delta, _ in answers])
    if not whole:   # answer by answer: the deltas decoded
        answers = [(s, base, d.decode() if isinstance(d, EncodedVector) else d, st) for s, base, d, st in answers]
    within = [buffer_ceiling is None or acc.buffers_within(theta, base, delta, buffer_ceiling)
              for _, base, delta, _ in answers]
    if whole:
        kept = [(base, delta) for (_, base, delta, _), ok in zip(answers, within) if ok]
        it = iter(acc.measure_round(theta, kept))
        measured = [next(it) if ok else None for ok in within]
    else:
        measured = [acc.measure(theta, base, delta, buf=buf) if ok else None
                    for (_, base, delta, _), ok in zip(answers, within)]
    limit = round_bound([m.norm if m is not None else math.nan for m in measured], list(weights))
    reference: list[float] = []   # the fragment's own norm: only the clipper's warm-up needs it
    scales, folds = [], []
    for (sender, base, delta, steps), w, m in zip(answers, weights, measured):
        if m is None:
            scales.append(0.0)
            continue
        if clipper.reference() is None and not reference:
            reference.append(acc.bounded_norm(theta))
        scale = clipper.observe(m.norm, reference[0] if reference else None, steps, learner=sender, limit=limit)
        if scale != 0.0:
            folds.append((base, delta, float(w), scale, m))
        scales.append(scale)
    if whole:
        acc.fold_round(theta, folds)
    else:
        for base, delta, w, scale, m in folds:
            acc.fold(theta, base, delta, w, scale, m, buf=buf)
    return scales


def choose_copy(copies: dict[str, tuple[int, int]], *, own_version: int, lone_limit: float,
                distance: Callable[[tuple[int, int]], float] | None = None) -> tuple[int, int] | None:
    """The (version, digest) of the learners' copies of a fragment a recovering shard adopts, or
    None (keep its own). ``copies``: learner -> (version, digest of the values) of each one's copy.
    Honest replicas of one version are bit-identical, so agreement is exact. A version newer
    than the shard's is adopted when at least two learners hold the same copy of it (the newest
    such, the most held on a tie). When no two agree on a newer copy, a copy only one learner holds
    is adopted only if its version is at most ``lone_limit`` (the run's record, written by shards,
    never by learners; or what the merges since the shard's checkpoint allow); of several such at
    one version, the nearest to the shard's own value (``distance``): a lone member cannot put an
    invented version, nor outvote a replica, into the global model."""
    groups: dict[tuple[int, int], int] = {}
    for version, digest in copies.values():
        if version > own_version:
            groups[(version, digest)] = groups.get((version, digest), 0) + 1
    agreed = [(key[0], n, key) for key, n in groups.items() if n >= 2]
    if agreed:
        return max(agreed)[2]
    alone = [key for key in groups if key[0] <= lone_limit]
    if not alone:
        return None
    best = max(v for v, _ in alone)
    tied = [key for key in alone if key[0] == best]
    return min(tied, key=distance) if distance is not None and len(tied) > 1 else tied[0]
