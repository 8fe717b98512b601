"""The shard's state: what a fragment, an open round, an answer, a recovery and the counters hold.

Ownership (STYLE "Shells"): every object here is created, changed and read by the shard's loop
thread (the thread that calls ``Shard.poll_once``), with two exceptions, both handed over as
messages: a ``MergeInput`` goes to a merge worker and its ``MergeResult`` comes back
(``syncer/merging.py``); a checkpoint's state dict goes to the writer thread
(``syncer/checkpoints.py``). ``/metrics`` reads a ``ShardSnapshot`` the loop publishes
(``syncer/readings.py``), never these.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import Any

import torch

from common import metrics
from common.config import AlgoConfig
from common.counters import declare
from common.fragments import Fragment
from common.robust import NormClipper
CONTROL_REFRESH_S = 0.5
REQUEST_DEDUPE_S = 5.0
"""A requester asking again for the fragment version it was sent less than this long ago is
ignored (the reply is on its way; a large fragment takes longer than a client's retry)."""
MERGE_WORKERS = 2
"""Worker threads for merges: a fragment merges once at a time, two fragments may merge together
(torch releases the GIL), and a slow merge never stops the socket loop."""
BEHIND_FACTOR = 1.2
"""A fragment whose merges come more than this many times H learner steps apart is behind schedule."""
RECOVERY_QUIET_S = 3.0
RECOVERY_COPIES = 64
"""Distinct copies (and learners) a recovering fragment keeps: bounded whatever members send."""
"""A restarted shard that is not behind the run's record starts merging when no learner holding
copies has been live for this long (after a Redis restart, learners come back within a heartbeat)."""
HOLDING = ("training", "blocked", "flushing")
"""Learner statuses that hold a copy of every fragment (recovery waits for their answers)."""


@dataclass
class Answer:
    """One learner's answer to an open round, dequantized."""

    sender: str
    base: int
    steps: int
    tokens: int
    delta: Any
    """δ_m: a flat fp32 tensor, or its int8/int4 payload still encoded (``common.quant.EncodedVector``)."""
    received_at: float
    clip_steps: float | None = None
    """Its steps as far as the time since its base allows: what may stretch the norm bound (common.robust)."""


@dataclass
class OpenRound:
    round_id: int
    opened_at: float
    attempt: int = 0
    last_sent_at: float = 0.0
    answers: dict[str, Answer] = field(default_factory=dict)
    quorum_at: float | None = None
    timed: bool = True
    """Some learner was past its join (training, blocked at the lock-step barrier, flushing) when
    the round opened: its open-to-quorum time measures the
    path (ξ_quorum). A round opened before any learner trained (shard start, learners still
    booting or joining) waited for the learners instead: counted, it shut the grace window for
    the next dozen rounds (10 % of the answers late in a 30 s `bench sync`)."""


@dataclass
class FragmentState:
    """Global value, outer momentum, version and short history of one fragment.

    ``theta``, ``master`` and ``momentum`` are replaced by new tensors (a merge, a recovery, a
    checkpoint load), never written in place: the history, a checkpoint being written and a merge
    running on the worker thread hold references to them, not copies."""

    spec: Fragment
    theta: torch.Tensor
    """The value every replica holds (learners apply the broadcast updates to it bit-identically)."""
    momentum: torch.Tensor
    master: torch.Tensor | None = None
    """The exact fp32 result of the outer steps when the downlink is quantized (None: ``theta``).
    Every broadcast update is q(master − theta), so what quantization dropped from one update
    travels in the next one (the replicas never drift from the master by more than one
    update's quantization error, and small late outer steps are never lost)."""
    reply: tuple[int, int, list[Any]] | None = None
    """(epoch, version, frames) of the last full-value reply: requests for one version are encoded once."""
    version: int = 0
    history: dict[int, torch.Tensor] = field(default_factory=dict)
    answered_unix: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    """Learner -> (round, reference, last) of its answers to this fragment: the round it last
    answered, the wall time its claims in that round count from (its last answer to an earlier
    round) and the time of its last answer. The steps an answer may claim follow the time since the
    reference (common.robust); not the time since its base: a learner that carries its unmerged
    steps keeps counting them across bases, and one that answers a re-sent open again still
    counts from the same point."""
    round: OpenRound | None = None
    last_opened_at: float | None = None
    next_round: int = 0
    recovery: "Recovery | None" = None
    """Set while the shard collects live learners' copies at start (no rounds meanwhile)."""
    clipper: NormClipper | None = field(default_factory=NormClipper)
    """Recent outer-gradient norms of this fragment (robust merge). None while a merge worker has
    it (``MergeJob.clipper``): handed over with the merge, handed back with its result."""
    merging: "MergeJob | None" = None
    """A closed round whose merge runs on the worker thread (no new round opens meanwhile)."""
    last_merged_at: float | None = None
    failed_rounds: int = 0
    """Rounds closed without a merge since the last merge (every answer dropped, not finite, no weight)."""
    effective_h: float = 0.0
    """EMA of the learner steps between two merges of this fragment (schedule check)."""


@dataclass
class MergeResult:
    """What a merge worker hands back to the loop (the loop applies it: ``Merging._apply_merge``)."""

    replica: torch.Tensor | None
    """None: no merge (not finite, or every answer dropped by the clipper)."""
    master: torch.Tensor | None
    momentum: torch.Tensor | None
    frames: list[Any]
    clipped: list[str]
    seconds: float
    every_answer_dropped: bool = False
    alignment: float | None = None
    """The answers' weighted mean pairwise cosine (``OuterAccumulator._mean_cosine``)."""
    norms: tuple[float, ...] = ()
    """Each merged answer's outer-gradient norm after its clip, in the order of the answers kept."""


@dataclass(frozen=True, kw_only=True)
class MergeInput:
    """Everything a merge worker reads (ALGORITHM §5), handed over by the loop: tensors no one
    writes in place (``FragmentState``), the answers, and the fragment's clipper, which the
    worker owns until the loop takes it back with the result. The worker gets no reference to
    the shard nor to the ``FragmentState``: it cannot read the loop's state."""

    spec: Fragment
    theta: torch.Tensor
    master: torch.Tensor | None
    momentum: torch.Tensor
    bases: dict[int, torch.Tensor]
    """Version -> value of every base an answer names (the fragment's history, at submit)."""
    answers: tuple[Answer, ...]
    weights: torch.Tensor
    clipper: NormClipper
    algo: AlgoConfig
    version: int
    epoch: int
    run_id: str
    sender: str
    scratch: threading.local
    """Per merging thread: the buffers every merge on it reuses (``merging.scratch_buffers``)."""
    largest_numel: int
    """The shard's largest fragment: the size of those buffers."""


@dataclass
class MergeJob:
    """A closed round whose merge runs on a worker: the loop's record of it (never read by the worker)."""

    fragment: FragmentState
    rnd: OpenRound
    answers: list[Answer]
    weights: torch.Tensor
    closed_at: float
    reason: str
    grace: float
    version: int
    epoch: int
    clipper: NormClipper
    """The fragment's clipper, away with the worker until the loop applies the result."""
    future: "Future[MergeResult] | None" = None
    result: MergeResult | None = None


@dataclass
class Recovery:
    """A (re)started shard asking live learners for the freshest copy of one fragment."""

    recorded: int
    """The newest version the run recorded for the fragment (Redis)."""
    deadline: float
    quiet_until: float = 0.0
    """Not behind the record: if no learner holding copies is live by then, there is none to ask."""
    asked_at: float = -1e9
    answered: set[str] = field(default_factory=set)
    copies: dict[str, tuple[int, int]] = field(default_factory=dict)
    """learner -> (version, CRC-32 of the values) of its copy (common.robust.choose_copy)."""
    values: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """(version, CRC-32) -> the values: one tensor per distinct copy, at most RECOVERY_COPIES."""
    lone_limit: float = math.inf
    """The newest version a copy only one learner holds may have (common.robust.choose_copy): the
    run's record, or the checkpoint's version + the merges between two checkpoints; no limit when
    the shard has neither (a wiped shard and an empty Redis: the freshest copy)."""


@dataclass
class ShardStats:
    """The shard's counters, each declared once (``common.counters``): what it counts, its metric at
    ``/metrics`` (``syncer.readings``) and its field in the shard's hash (``ControlPlane._shard_entry``)."""

    merges: int = declare(0, doc="Rounds merged into a new fragment version (restored from the checkpoint at "
                          "start).", metric="shard_merges_total", redis="merges")
    answers: int = declare(0, doc="Learner answers by outcome: accepted (into its open round), late (the round "
                           "had merged), stale_base (its base version or shard life is gone), wrong_run.",
                           metric="shard_answers_total", label="outcome", key="accepted", redis="answers")
    malformed: int = declare(0, doc="Messages and requests that failed to decode or made no sense (dropped).",
                             metric="shard_malformed_total", redis="malformed")
    late_answers: int = declare(0, doc="Answers to a round that had merged.", metric="shard_answers_total",
                                label="outcome", key="late", redis="late_answers")
    stale_base: int = declare(0, doc="Answers whose base version or shard life is gone.",
                              metric="shard_answers_total", label="outcome", key="stale_base", redis="stale_base")
    wrong_run: int = declare(0, doc="Messages of another run (dropped).", metric="shard_answers_total", label="outcome",
                             key="wrong_run")
    reopens: int = declare(0, doc="Round opens sent again (no quorum yet).", metric="shard_reopens_total",
                           redis="reopens")
    nonfinite_rounds: int = declare(0, doc="Rounds whose merge was not finite (dropped).",
                                    metric="shard_rounds_dropped_total")
    checkpoints: int = declare(0, doc="Checkpoints: written, failed.", metric="shard_checkpoints_total",
                               label="outcome", key="written", redis="checkpoints")
    checkpoint_errors: int = declare(0, doc="Checkpoints that failed.", metric="shard_checkpoints_total",
                                     label="outcome", key="failed")
    checkpoint_cpu_s: float = declare(0.0, doc="CPU seconds the checkpoint writer thread spent writing (its "
                                      "thread time: serialisation, checksums, copies into the page cache).",
                                      metric="shard_checkpoint_cpu_seconds_total", redis="checkpoint_cpu_s", digits=3)
    checkpoint_write_s: float = declare(0.0, doc="Wall seconds of checkpoint writes (fsyncs included).",
                                        metric="shard_checkpoint_write_seconds_total", redis="checkpoint_write_s",
                                        digits=3)
    checkpoint_bytes: int = declare(0, doc="Bytes of checkpoints written.", metric="shard_checkpoint_bytes_total",
                                    redis="checkpoint_bytes")
    versions_behind: int = declare(0, doc="Fragments that restarted below the run's recorded version (no live "
                                   "learner had it).", metric="shard_versions_behind_total", redis="versions_behind")
    bytes_in: int = declare(0, doc="Message bytes: in (answers, copies), out (opens, merged fragments, "
                            "replies).", metric="shard_bytes_total", label="direction", key="in", redis="bytes_in")
    bytes_out: int = declare(0, doc="Message bytes sent: opens, merged fragments, replies.",
                             metric="shard_bytes_total", label="direction", key="out", redis="bytes_out")
    requests: int = declare(0, doc="Full-fragment requests: served, deferred (the fragment was recovering), "
                            "deduped (sent to that requester moments ago).", metric="shard_fragment_requests_total",
                            label="outcome", key="served", redis="requests")
    requests_deduped: int = declare(0, doc="Requests for a value just sent to the same requester (within "
                                    "REQUEST_DEDUPE_S): dropped.", metric="shard_fragment_requests_total",
                                    label="outcome", key="deduped", redis="requests_deduped")
    replies_cached: int = declare(0, doc="Fragment requests answered with the frames already encoded for that "
                                  "version.", redis="replies_cached")
    requests_deferred: int = declare(0, doc="Fragment requests left unanswered while the fragment was recovering "
                                     "(asked again).", metric="shard_fragment_requests_total", label="outcome",
                                     key="deferred")
    rejected: dict[str, int] = declare(dict, doc="Answers refused (nonfinite_delta) or cut (claims, clipped) by "
                                       "the robust merge, by reason.", metric="shard_answers_rejected_total",
                                       label="reason", redis="rejected_{}")
    """By reason: common.robust.REASONS."""
    round_s: metrics.Histogram = declare(metrics.Histogram, doc="Seconds from a round's open to its merge.",
                                         metric="shard_round_seconds", kind="histogram")
    """Of every merged round of this process."""
    merge_s: metrics.Histogram = declare(metrics.Histogram, doc="Seconds of merge computation per round (worker "
                                         "thread).", metric="shard_merge_seconds", kind="histogram",
                                         redis="merge_s_sum", digits=4)
    claims_clamped: int = declare(0, doc="Answers whose claims were cut by at most CLAMP_TOLERANCE (an honest "
                                  "member's timing; apart from rejections).", redis="claims_clamped")
    rounds_behind: int = declare(0, doc="Merges later than the schedule: the fragment's learner steps between "
                                 "merges (EMA) above 1.2 x H.", metric="shard_rounds_behind_total",
                                 redis="rounds_behind")
    """Effective H > BEHIND_FACTOR × H."""
    weights_capped: int = declare(0, doc="Answers whose weight was cut to the round's median weight "
                                  "(common.robust.fair_weights).", redis="weights_capped")

    @property
    def dropped(self) -> int:
        refused = self.rejected.get("nonfinite_delta", 0)   # the others are cut, still merged
        return self.malformed + self.late_answers + self.stale_base + self.wrong_run + self.nonfinite_rounds + refused


def step_time_of(learner: dict[str, str]) -> float | None:
    """A learner's step-time EMA from its Redis entry, when it is a plausible number of seconds."""
    try:
        t = float(learner.get("step_ema_s") or 0.0)
    except (TypeError, ValueError):
        return None
    return t if math.isfinite(t) and 0 < t < 3600 else None


def finite_or_nan(value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) else math.nan

