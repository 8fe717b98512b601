"""The learner's counters, what it publishes of them, and how they are shown (``/metrics``,
the heartbeat hash in Redis).

Ownership: ``LearnerStats`` of a learner is written by its training thread only; the network
thread counts into counters of its own (``NetworkReadings`` fields). Other threads (control,
``/metrics`` scrapes, tests) read ``LearnerView``: a frozen value the training thread publishes
at every step boundary and change of status, combined with the network thread's frozen
``NetworkReadings`` (``LearnerView.stats_with``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from common import entries, metrics

STEP_TIME_WARMUP = 10
"""Steps averaged plainly before the step-time estimate becomes an EMA (0.9)."""


def step_time_estimate(ema: float, step_s: float, seen: int) -> float:
    """The learner's step time estimate (``step_ema_s``, which the shards space rounds by and
    size the grace window with) after one more training iteration of ``step_s`` seconds (the step
    and the sync work on the training thread), ``seen`` steps of this life already counted. The
    step alone is not the pace: at 1e8 parameters on a 2-core VM, applying merges and snapshotting
    answers made an iteration 0.43 s where the step took 0.29 s, so the shards merged 1.22 × as
    often as H asked and 5.7 % of answers missed a grace window sized by the step. The first
    iteration is left out: it allocates the gradients and AdamW's moments and touches fresh memory
    (1.6-2.6 s against ~0.25-0.42 s later at 1e8 parameters on a 2-core VM, ``bench sync``'s
    ``step1_s``), and an EMA seeded with it overstated the pace for ~20 steps, so the shards spaced
    the first rounds too far apart.
    The next ``STEP_TIME_WARMUP`` steps are averaged, then an EMA (0.9)."""
    if seen == 0:
        return 0.0
    if seen <= STEP_TIME_WARMUP:
        return ema + (step_s - ema) / seen
    return 0.9 * ema + 0.1 * step_s


@dataclass
class LearnerStats:
    steps: int = 0
    tokens: int = 0
    answers: int = 0
    merges_applied: int = 0
    version_gaps: int = 0
    versions_regressed: int = 0
    stale_opens: int = 0
    flushed: int = 0
    unflushed: int = 0
    nonfinite_answers: int = 0
    fetches: int = 0
    malformed: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_fetched: int = 0
    """Of bytes_down: full fragment values fetched from the shards (join, repairs)."""
    chunks_fetched: int = 0
    """Chunks of fragments fetched in pieces (larger than the shard's ``reply_chunk_values``)."""
    updates_replayed: int = 0
    """Broadcast updates that arrived before the value they apply to, applied once it was here."""
    train_s: float = 0.0
    flush_s: float = 0.0
    """Seconds after the last step spent answering every fragment once more (not training: goodput)."""
    blocked_s: float = 0.0
    boot_s: float = 0.0
    cpu_s_at_joined: float = 0.0
    """The process's CPU seconds (every thread) when it joined: ``cpu_s`` minus this is training's."""
    boot_phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the process start to: init (interpreter, imports), prepared (run config, task,
    model, checks), joined (every fragment fetched), first_answer."""
    step_ema_s: float = 0.0
    loss_ema: float = 0.0
    lr: float = 0.0
    batches: int = 0
    last_contrib_fragment: int = -1
    first_answer: str = ""
    bootstrap: str = ""
    """Where this life's state came from: "peer <id>" or "shards"."""
    bootstraps_served: int = 0
    last_contrib_at: float = 0.0
    schedule_tokens: float = 0.0
    """The highest run token count the learning-rate schedule used (``Learner._step_run_tokens``)."""
    schedule_regressions: int = 0
    """Schedule reads below ``schedule_tokens``: the learning rate went back (must stay 0)."""


@dataclass
class LearnerSummary:
    learner_id: str
    stats: LearnerStats
    versions: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkReadings:
    """The network thread's counters as it last published them."""

    bytes_up: int = 0
    bytes_down: int = 0
    bytes_fetched: int = 0
    chunks_fetched: int = 0
    malformed: int = 0
    nonfinite_answers: int = 0

    @classmethod
    def of(cls, counters: Any) -> NetworkReadings:
        return cls(**{f.name: getattr(counters, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class LearnerView:
    """What the training thread publishes: its status and a copy of its counters (no thread
    writes either), and what the heartbeat reports of its data position."""

    status: str
    stats: LearnerStats
    data_position: int = 0

    @classmethod
    def of(cls, status: str, stats: LearnerStats, data_position: int) -> LearnerView:
        return cls(status, replace(stats, boot_phases=dict(stats.boot_phases)), data_position)

    def stats_with(self, net: NetworkReadings | None) -> LearnerStats:
        """A copy of the counters with the network thread's (None: as they are)."""
        s = replace(self.stats, boot_phases=dict(self.stats.boot_phases))
        return s if net is None else replace(s, **asdict(net))


STATUSES = ("joining", "training", "blocked", "flushing", "stopped")


def heartbeat_fields(s: LearnerStats) -> dict[str, Any]:
    """The counters as the learner's hash in Redis holds them (learner/core.py adds who and where)."""
    return {"steps": s.steps, "tokens": s.tokens, "step_ema_s": round(s.step_ema_s, 6),
            "loss_ema": round(s.loss_ema, 5), "lr": s.lr, "answers": s.answers, "merges_applied": s.merges_applied,
            "version_gaps": s.version_gaps, "versions_regressed": s.versions_regressed,
            "stale_opens": s.stale_opens, "flushed": s.flushed, "unflushed": s.unflushed, "fetches": s.fetches,
            "malformed": s.malformed, "bytes_up": s.bytes_up, "bytes_down": s.bytes_down,
            "train_s": round(s.train_s, 3), "flush_s": round(s.flush_s, 3), "blocked_s": round(s.blocked_s, 3),
            "boot_s": round(s.boot_s, 3), "boot_phases": json.dumps(s.boot_phases),
            "last_contrib_fragment": s.last_contrib_fragment, "first_answer": s.first_answer,
            "bootstrap": s.bootstrap, "bootstraps_served": s.bootstraps_served,
            "last_contrib_at": s.last_contrib_at, "schedule_tokens": int(s.schedule_tokens),
            "schedule_regressions": s.schedule_regressions, "bytes_fetched": s.bytes_fetched,
            "chunks_fetched": s.chunks_fetched, "cpu_s_at_joined": round(s.cpu_s_at_joined, 3)}


def readings(s: LearnerStats, status: str, *, replaced: int, inbox: int, outbox: int) -> list[metrics.Reading]:
    """What ``/metrics`` shows of a learner's counters ``s`` (``replaced``: answers the outbox
    replaced; ``inbox``/``outbox``: items waiting in the queues)."""
    return [
        metrics.counter("learner_steps_total", "Inner steps taken by this process.", s.steps),
        metrics.counter("learner_tokens_total", "Tokens trained on by this process.", s.tokens),
        metrics.counter("learner_answers_total", "Answers sent to open rounds.", s.answers),
        metrics.counter("learner_merges_applied_total", "Merged fragments applied.", s.merges_applied),
        metrics.counter("learner_fetches_total", "Full fragments asked of the shards (join, gaps, a "
                        "restarted shard).", s.fetches),
        metrics.counter("learner_version_gaps_total", "Lost broadcasts found by their version (repaired by "
                        "a fetch).", s.version_gaps),
        metrics.counter("learner_versions_regressed_total", "Fragments a shard moved back below our "
                        "version.", s.versions_regressed),
        metrics.counter("learner_stale_opens_total", "Open rounds skipped: already merged past them.",
                        s.stale_opens),
        metrics.counter("learner_nonfinite_answers_total", "Answers not sent: non-finite delta.",
                        s.nonfinite_answers),
        metrics.counter("learner_answers_replaced_total", "Answers not sent: a newer answer for the same "
                        "fragment replaced them while they waited (the network thread fell behind).", replaced),
        metrics.counter("learner_malformed_total", "Messages dropped: failed to decode.", s.malformed),
        metrics.counter("learner_bad_entries_total", "Redis entries ignored as malformed, by kind.reason "
                        "(common/entries.py).", entries.BAD_ENTRIES.snapshot(), "reason"),
        metrics.counter("learner_bytes_total", "Bytes sent (out: answers, copies, peer state) and received "
                        "(in: merged fragments, peer state).", {"out": s.bytes_up, "in": s.bytes_down},
                        "direction"),
        metrics.counter("learner_train_seconds_total", "Seconds of training work (frozen steps excluded).",
                        s.train_s),
        metrics.counter("learner_blocked_seconds_total", "Seconds waiting at the lock-step barrier.",
                        s.blocked_s),
        metrics.counter("learner_bootstraps_served_total", "States served to joining peers.",
                        s.bootstraps_served),
        metrics.gauge("learner_step_seconds", "Inner step time (EMA, 0.9).", s.step_ema_s),
        metrics.gauge("learner_loss", "Training loss (EMA, 0.95).", s.loss_ema),
        metrics.gauge("learner_learning_rate", "Inner learning rate of the last step.", s.lr),
        metrics.gauge("learner_schedule_tokens", "Highest run token count the learning-rate schedule "
                      "used.", s.schedule_tokens),
        metrics.counter("learner_schedule_regressions_total", "Schedule reads of a run token count below "
                        "the highest used before (the learning rate went back; 0 expected).",
                        s.schedule_regressions),
        metrics.gauge("learner_boot_seconds", "Process start to joined (0 before).", s.boot_s),
        metrics.gauge("learner_last_contribution_timestamp_seconds", "Unix time of the last answer sent "
                      "(0: none yet).", s.last_contrib_at),
        metrics.gauge("learner_queue_depth", "Items waiting between the threads: inbox (network to "
                      "training), outbox (training to network).", {"inbox": inbox, "outbox": outbox}, "queue"),
        metrics.gauge("learner_status", "1 for the learner's current status.",
                      {st: float(status == st) for st in STATUSES}, "status"),
    ]
