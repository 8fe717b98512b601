"""The learner's counters, what it publishes of them, and how they are shown (``/metrics``,
the heartbeat hash in Redis).

Ownership: ``LearnerStats`` of a learner is written by its training thread only; the network
thread counts into counters of its own (``NetworkReadings`` fields). Other threads (control,
``/metrics`` scrapes, tests) read ``LearnerView``: a frozen value the training thread publishes
at every step boundary and change of status, combined with the network thread's frozen
``NetworkReadings`` (``LearnerView.stats_with``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from common import counters, entries, metrics
from common.counters import declare

def mark_boot(phases: dict[str, float], phase: str, process_started_at: float) -> None:
    """A boot phase reached: seconds from the process start (``phase``) and the process's CPU
    seconds so far, every thread (``phase + "_cpu"``): on a busy host the two differ by the share
    of the cores the booting process gets (``python -m ddloco.bench.rejoin``)."""
    phases[phase] = round(time.time() - process_started_at, 3)
    phases[f"{phase}_cpu"] = round(time.process_time(), 3)


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
    """The learner's counters, each declared once (``common.counters``): what it counts, its
    metric at ``/metrics`` (``readings``) and its field in the learner's hash (``heartbeat_fields``)."""

    steps: int = declare(0, doc="Inner steps taken by this process.", metric="learner_steps_total", redis="steps")
    tokens: int = declare(0, doc="Tokens trained on by this process.", metric="learner_tokens_total", redis="tokens")
    answers: int = declare(0, doc="Answers sent to open rounds.", metric="learner_answers_total", redis="answers")
    merges_applied: int = declare(0, doc="Merged fragments applied.", metric="learner_merges_applied_total",
                                  redis="merges_applied")
    version_gaps: int = declare(0, doc="Lost broadcasts found by their version (repaired by a fetch).",
                                metric="learner_version_gaps_total", redis="version_gaps")
    versions_regressed: int = declare(0, doc="Fragments a shard moved back below our version.",
                                      metric="learner_versions_regressed_total", redis="versions_regressed")
    stale_opens: int = declare(0, doc="Open rounds skipped: already merged past them.",
                               metric="learner_stale_opens_total", redis="stale_opens")
    flushed: int = declare(0, doc="Fragments whose last steps the flush got merged.", redis="flushed")
    unflushed: int = declare(0, doc="Fragments whose last steps were still unmerged when the flush ended.",
                             redis="unflushed")
    nonfinite_answers: int = declare(0, doc="Answers not sent: non-finite delta.",
                                     metric="learner_nonfinite_answers_total")
    fetches: int = declare(0, doc="Full fragments asked of the shards (join, gaps, a restarted shard).",
                           metric="learner_fetches_total", redis="fetches")
    malformed: int = declare(0, doc="Messages dropped: failed to decode.", metric="learner_malformed_total",
                             redis="malformed")
    bytes_up: int = declare(0, doc="Bytes sent (out: answers, copies, peer state) and received (in: merged "
                            "fragments, peer state).", metric="learner_bytes_total", label="direction", key="out",
                            redis="bytes_up")
    bytes_down: int = declare(0, doc="Bytes received: merged fragments, peer state.", metric="learner_bytes_total",
                              label="direction", key="in", redis="bytes_down")
    bytes_fetched: int = declare(0, doc="Of bytes_down: full fragment values fetched from the shards (join, "
                                 "repairs).", redis="bytes_fetched")
    chunks_fetched: int = declare(0, doc="Chunks of fragments fetched in pieces (larger than the shard's "
                                  "``reply_chunk_values``).", redis="chunks_fetched")
    updates_replayed: int = declare(0, doc="Broadcast updates that arrived before the value they apply to, "
                                    "applied once it was here.")
    train_s: float = declare(0.0, doc="Seconds of training work (frozen steps excluded).",
                             metric="learner_train_seconds_total", redis="train_s", digits=3)
    flush_s: float = declare(0.0, doc="Seconds after the last step spent answering every fragment once more "
                             "(not training: goodput).", redis="flush_s", digits=3)
    blocked_s: float = declare(0.0, doc="Seconds waiting at the lock-step barrier.",
                               metric="learner_blocked_seconds_total", redis="blocked_s", digits=3)
    boot_s: float = declare(0.0, doc="Process start to joined (0 before).", metric="learner_boot_seconds",
                            kind="gauge", redis="boot_s", digits=3)
    cpu_s_at_joined: float = declare(0.0, doc="The process's CPU seconds (every thread) when it joined: "
                                     "``cpu_s`` minus this is training's.", redis="cpu_s_at_joined", digits=3)
    boundary_cpu_s: float = declare(0.0, doc="The training thread's CPU seconds on the sync path at step "
                                    "boundaries (merged fragments applied, answers snapshotted).",
                                    redis="boundary_cpu_s", digits=3)
    net_cpu_s: float = declare(0.0, doc="The network thread's CPU seconds (encoding and decoding fragments, "
                               "handing them to and taking them from ZeroMQ, whose own I/O threads are "
                               "``io_cpu_s``; its join fetches included).", redis="net_cpu_s", digits=3)
    net_cpu_s_at_joined: float = declare(0.0, doc="``net_cpu_s`` when the learner joined: the sync path's CPU "
                                         "since is ``boundary_cpu_s + net_cpu_s - net_cpu_s_at_joined`` (+ ``io_cpu_s - "
                                         "io_cpu_s_at_joined``, libzmq's).",
                                         redis="net_cpu_s_at_joined", digits=3)
    io_cpu_s: float = declare(0.0, doc="The CPU seconds of libzmq's I/O threads in the learner's process (the "
                              "bytes on the wire: socket copies, CURVE), read from /proc about once a second "
                              "(0 where there is no /proc).", redis="io_cpu_s", digits=3)
    io_cpu_s_at_joined: float = declare(0.0, doc="``io_cpu_s`` when the learner joined.",
                                        redis="io_cpu_s_at_joined", digits=3)
    boot_phases: dict[str, float] = declare(dict, doc="Seconds from the process start to: init (interpreter, "
                                            "imports), prepared (run config, task, model, checks), joined "
                                            "(every fragment fetched), first_answer; each also as PHASE_cpu, the process's "
                                            "CPU seconds then.", redis="boot_phases")
    step_ema_s: float = declare(0.0, doc="Inner step time (EMA, 0.9).", metric="learner_step_seconds",
                                kind="gauge", redis="step_ema_s", digits=6)
    loss_ema: float = declare(0.0, doc="Training loss (EMA, 0.95).", metric="learner_loss", kind="gauge",
                              redis="loss_ema", digits=5)
    lr: float = declare(0.0, doc="Inner learning rate of the last step.", metric="learner_learning_rate",
                        kind="gauge", redis="lr")
    d2h_copies: int = declare(0, doc="CUDA learner: answers copied device to host on the side stream.",
                              redis="d2h_copies")
    d2h_ms: float = declare(0.0, doc="CUDA learner: GPU milliseconds of those copies (CUDA events).",
                            redis="d2h_ms", digits=3)
    h2d_copies: int = declare(0, doc="CUDA learner: merged values copied host to device on the side stream.",
                              redis="h2d_copies")
    h2d_ms: float = declare(0.0, doc="CUDA learner: GPU milliseconds of those copies (CUDA events).",
                            redis="h2d_ms", digits=3)
    stream_waits: int = declare(0, doc="CUDA learner: merged values the training stream reached before their "
                                "copy had ended (it waited on the GPU; 0 expected).",
                                metric="learner_training_stream_waits_total", redis="stream_waits")
    stream_wait_ms: float = declare(0.0, doc="CUDA learner: the training stream's milliseconds of those waits.",
                                    redis="stream_wait_ms", digits=3)
    pin_ms: float = declare(0.0, doc="CUDA learner: wall milliseconds the training thread spent taking pinned "
                            "host memory for answers (from PyTorch's cache: ~0 once warm) and pinning the base of a merge "
                            "on a round it did not answer.", redis="pin_ms", digits=3)
    pin_ms_net: float = declare(0.0, doc="CUDA learner: the same on the network thread, for merged values on their "
                                "way to the device.", redis="pin_ms_net", digits=3)
    gpu_peak_mb: float = declare(0.0, doc="CUDA learner: the device's peak allocated memory (MiB).",
                                 metric="learner_gpu_peak_megabytes", kind="gauge", redis="gpu_peak_mb", digits=1)
    batches: int = declare(0, doc="Batches drawn this life (the hash's ``data_position`` counts them).")
    last_contrib_fragment: int = declare(-1, doc="The fragment of the last answer sent (-1: none yet).",
                                         redis="last_contrib_fragment")
    first_answer: str = declare("", doc="fragment:round:unix time of this life's first answer.",
                                redis="first_answer")
    bootstrap: str = declare("", doc='Where this life\'s state came from: "peer <id>" or "shards".',
                             redis="bootstrap")
    bootstraps_served: int = declare(0, doc="States served to joining peers.",
                                     metric="learner_bootstraps_served_total", redis="bootstraps_served")
    last_contrib_at: float = declare(0.0, doc="Unix time of the last answer sent (0: none yet).",
                                     metric="learner_last_contribution_timestamp_seconds", kind="gauge",
                                     redis="last_contrib_at")
    schedule_tokens: float = declare(0.0, doc="Highest run token count the learning-rate schedule used.",
                                     metric="learner_schedule_tokens", kind="gauge", redis="schedule_tokens",
                                     whole=True)
    """``Learner._step_run_tokens``'s highest."""
    schedule_regressions: int = declare(0, doc="Schedule reads of a run token count below the highest used "
                                        "before (the learning rate went back; 0 expected).",
                                        metric="learner_schedule_regressions_total", redis="schedule_regressions")


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
    net_cpu_s: float = 0.0
    io_cpu_s: float = 0.0

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
    return counters.hash_fields(s)


def readings(s: LearnerStats, status: str, *, replaced: int, inbox: int, outbox: int) -> list[metrics.Reading]:
    """What ``/metrics`` shows of a learner's counters ``s`` (``replaced``: answers the outbox
    replaced; ``inbox``/``outbox``: items waiting in the queues)."""
    return [
        *counters.readings(s),
        metrics.counter("learner_answers_replaced_total", "Answers not sent: a newer answer for the same "
                        "fragment replaced them while they waited (the network thread fell behind).", replaced),
        metrics.counter("learner_bad_entries_total", "Redis entries ignored as malformed, by kind.reason "
                        "(common/entries.py).", entries.BAD_ENTRIES.snapshot(), "reason"),
        metrics.gauge("learner_queue_depth", "Items waiting between the threads: inbox (network to "
                      "training), outbox (training to network).", {"inbox": inbox, "outbox": outbox}, "queue"),
        metrics.gauge("learner_status", "1 for the learner's current status.",
                      {st: float(status == st) for st in STATUSES}, "status"),
    ]
