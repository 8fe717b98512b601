"""A syncer shard: owns fragments p with p % S == k and runs their rounds (ALGORITHM §4-5).

The daemon is a thin I/O loop; every decision (which fragment to open, whether a round may
merge, how long the grace window is, the merge itself) is a pure function from
``common.quorum`` / ``common.merge``::

    with Shard(...) as shard:
        while not stop.is_set():
            shard.poll_once(20)
"""
from __future__ import annotations

import math
import os
import socket
import statistics
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import redis
import torch
import zmq

from common import control, metrics, tokens as run_count, wire
from common import entries
from common.config import Endpoints, RunConfig, SyncerOptions
from common.fragments import Fragment, gather, model_plan, owned_fragments, plan_digest, plan_layout, state_tensors
from common.keys import Keys
from common.lifecycle import peak_rss_mb
from common.links import keep_alive
from common.security import Security
from common.log import get_logger
from common.merge import OuterAccumulator, outer_step, quantized_update
from common.robust import (STEP_TIME_FLOOR_OF_MEDIAN, STEP_TIME_UNKNOWN_S, NormClipper, bound_claims, claims_reference,
                           choose_copy, fair_weights, fold_round, max_steps_claim, steps_in_time)
from common.quorum import (Decision, Ema, OpenSchedule, QuorumPolicy, RoundView, decide_round, due_fragments,
                           grace_window_s)
from common.task import Task, TaskError, bind_task, build_model, count_tokens
from common.task import TaskNotAllowed

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
    delta: torch.Tensor
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
    clipper: NormClipper = field(default_factory=NormClipper)
    """Recent outer-gradient norms of this fragment (robust merge)."""
    merging: "_MergeJob | None" = None
    """A closed round whose merge runs on the worker thread (no new round opens meanwhile)."""
    last_merged_at: float | None = None
    failed_rounds: int = 0
    """Rounds closed without a merge since the last merge (every answer dropped, not finite, no weight)."""
    effective_h: float = 0.0
    """EMA of the learner steps between two merges of this fragment (schedule check)."""


@dataclass
class _MergeResult:
    replica: torch.Tensor | None
    """None: no merge (not finite, or every answer dropped by the clipper)."""
    master: torch.Tensor | None
    momentum: torch.Tensor | None
    frames: list[Any]
    clipped: list[str]
    seconds: float
    every_answer_dropped: bool = False


@dataclass
class _MergeJob:
    fragment: FragmentState
    rnd: OpenRound
    answers: list["Answer"]
    weights: torch.Tensor
    closed_at: float
    reason: str
    grace: float
    version: int
    epoch: int
    future: "Future[_MergeResult] | None" = None
    result: _MergeResult | None = None


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
    merges: int = 0
    answers: int = 0
    malformed: int = 0
    late_answers: int = 0
    stale_base: int = 0
    wrong_run: int = 0
    reopens: int = 0
    nonfinite_rounds: int = 0
    checkpoint_errors: int = 0
    checkpoints: int = 0
    versions_behind: int = 0
    """Fragments that restarted below the run's recorded version (no live learner had it)."""
    bytes_in: int = 0
    bytes_out: int = 0
    requests: int = 0
    requests_deduped: int = 0
    """Requests for a value just sent to the same requester (within REQUEST_DEDUPE_S): dropped."""
    replies_cached: int = 0
    """Fragment requests answered with the frames already encoded for that version."""
    requests_deferred: int = 0
    """Fragment requests left unanswered while the fragment was recovering (asked again)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Answers refused or clipped by the robust-merge rules, by reason (common.robust.REASONS)."""
    round_s: metrics.Histogram = field(default_factory=metrics.Histogram)
    """Seconds from a round's open to its merge, of every merged round of this process."""
    merge_s: metrics.Histogram = field(default_factory=metrics.Histogram)
    """Seconds of merge computation (worker thread) per merged round."""
    claims_clamped: int = 0
    """Answers whose claims were cut by at most CLAMP_TOLERANCE (an honest member's timing; apart from rejections)."""
    rounds_behind: int = 0
    weights_capped: int = 0
    """Answers whose weight was cut to the round's median weight (common.robust.fair_weights)."""
    """Merges that came later than the schedule allows: effective H > BEHIND_FACTOR × H."""

    @property
    def dropped(self) -> int:
        refused = self.rejected.get("nonfinite_delta", 0)   # the others are cut, still merged
        return self.malformed + self.late_answers + self.stale_base + self.wrong_run + self.nonfinite_rounds + refused


def _step_time_of(learner: dict[str, str]) -> float | None:
    """A learner's step-time EMA from its Redis entry, when it is a plausible number of seconds."""
    try:
        t = float(learner.get("step_ema_s") or 0.0)
    except (TypeError, ValueError):
        return None
    return t if math.isfinite(t) and 0 < t < 3600 else None


def _finite_or_nan(value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) else math.nan


class LatestWriter:
    """One background thread that writes the newest submitted item; an item submitted while
    another is being written replaces any item still waiting (intermediate ones are skipped)."""

    def __init__(self, write: Callable[[Any], None], *, name: str) -> None:
        self._write = write
        self._name = name
        self._cond = threading.Condition()
        self._pending: Any = None
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, item: Any) -> None:
        with self._cond:
            self._pending = item
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                item, self._pending, self._busy = self._pending, None, True
            try:
                self._write(item)
            except Exception:  # the writer logs its own failures; the thread must outlive one
                pass
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def close(self) -> None:
        """Wait until nothing is pending or being written; submitted items are written, not lost."""
        with self._cond:
            while self._pending is not None or self._busy:
                self._cond.wait()


class CheckpointMismatch(RuntimeError):
    """The checkpoint on disk belongs to another run config or shard layout."""


def initial_state(run: RunConfig, task: Task) -> tuple[torch.nn.Module, tuple[Fragment, ...]]:
    """The initial model of the run (``task.model()`` under the run seed) and its fragment plan;
    FragmentationError when P does not fit the model."""
    model = build_model(task, run.task.seed)
    return model, model_plan(model, task.embedding_names, run.algo.fragments)


class Shard:
    """Syncer shard k of S."""

    def __init__(self, *, endpoints: Endpoints, options: SyncerOptions, run: RunConfig | None = None,
                 task: Task | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``run``: the run config to start or join with (None: the run's, from Redis). ``task``:
        the model (None: load the run's task from its spec)."""
        self.endpoints = endpoints
        self.options = options
        self._run_arg = run
        self.task = task
        self.clock = clock
        self.keys = Keys(endpoints.run_id)
        self.id = f"shard{options.shard}"
        self.security = Security(endpoints.keys_dir, self.id) if endpoints.keys_dir else None
        """CURVE: the RPC ROUTER admits only the run's listed keys; broker sockets authenticate."""
        self.log = get_logger("syncer", shard=options.shard, run=endpoints.run_id)
        self.stats = ShardStats()
        self.frags: dict[int, FragmentState] = {}
        self.xi_quorum = Ema(alpha=0.2)  # starts at its first sample (None before: counts as 0)
        self.xi_sync = Ema(alpha=0.2)
        self.live: dict[str, dict[str, str]] = {}
        self._step_s_seen: dict[str, float] = {}
        """Learner id -> its last step-time EMA seen in Redis (the claims bound)."""
        self._eval_loss = math.nan
        """The global model's last eval loss in Redis (`ddloco up` writes it), for /metrics."""
        self._finished: set[str] = set()
        """Learners whose last answer was final (sent after their last step, ``wire.Message.final``)."""
        self._first_seen: dict[str, float] = {}
        """Learner id -> the earliest it can have joined, as this shard saw it (the claims bound of its
        first answer): the read of the live learners before the one that first listed it."""
        self._since_unknown_unix = time.time()
        """What a learner already live when this shard started did since is unknown: from the last
        checkpoint's time (a restarted shard), else this process's start."""
        self._live_read_unix = self._since_unknown_unix
        """When the live learners were last read from Redis."""
        self._live_reads = 0
        """Reads of the live learners so far (the first one's learners joined before this shard)."""
        self._ctx: zmq.Context | None = None
        self._last_control = -1e9
        self._redis_ok = True
        self._merges_since_ckpt = 0
        self._lease_lost = False
        self._ckpt_writer = LatestWriter(self._write_checkpoint, name=f"{self.id}-checkpoint")
        self.grace_s = 0.0
        """The adaptive grace window of the last poll (seconds a round waits past its quorum)."""
        self.metrics: metrics.MetricsServer | None = None
        self._behind_logged_at = -1e9
        self._served: dict[tuple[bytes, int], tuple[int, int, float]] = {}
        """(requester, fragment) -> (epoch, version, when) of the last full value sent to it."""
        self._merger: ThreadPoolExecutor | None = None
        """The merge worker: merges never block the socket loop."""
        self._scratch = threading.local()
        """Per merging thread: the buffers every merge on it reuses (``_merge_scratch``)."""

    # ---------------------------------------------------------------- set-up / tear-down
    def _prepare(self, run: RunConfig, *, shared: bool = False) -> torch.nn.Module:
        """Bind the task and plan the fragments: every refusal before anything is written.
        ``shared``: ``run`` came from Redis (its task spec is imported only if allowed here)."""
        self.task, self.run = bind_task(run, self.task, shared=shared)
        model, self.plan = initial_state(self.run, self.task)
        self.plan_digest = plan_digest(self.plan)
        self.tokens_per_step_bound = self._tokens_per_step_bound()
        return model

    def _tokens_per_step_bound(self) -> float:
        """The most tokens an answer may claim per inner step: ``syncer.tokens_per_step_max``, else
        the task's first batch × ``inner_grad_accum`` × 2 (slack for batches that vary in size)."""
        if self.options.tokens_per_step_max > 0:
            return float(self.options.tokens_per_step_max)
        batch = next(iter(self.task.batches(0, self.run.task.seed, 0)))
        return 2.0 * count_tokens(self.task, batch) * self.run.algo.inner_grad_accum

    def __enter__(self) -> "Shard":
        if self._run_arg is not None:
            model = self._prepare(self._run_arg)
            self.redis = control.connect(self.endpoints.redis_url)
            control.publish_run_config(self.redis, self.keys, self.run)
        else:
            self.redis = control.connect(self.endpoints.redis_url)
            try:
                model = self._prepare(control.fetch_run_config(
                    self.redis, self.keys, wait_s=30.0, redis_url=self.endpoints.redis_url,
                    on_wait=lambda why: self.log.warning("syncer.run_config_missing", detail=why,
                                                         gives_up_after_s=30.0)), shared=True)
            except TaskNotAllowed:  # the run names a task this machine does not import: exit 2
                raise
            except TaskError as e:  # this machine's task differs from the run's
                raise control.ConfigMismatch(f"refused: {e}") from None
        control.claim_shard_count(self.redis, self.keys, self.options.shards)
        control.record_layout(self.redis, self.keys, plan_layout(self.plan))
        # this life of the shard: the run-wide counter, above any epoch this shard's checkpoint saw
        # (Redis may have restarted empty; live shards and learners also put the counter back)
        self.epoch = control.take_epoch(self.redis, self.keys, self._checkpoint_epoch())
        self.lease_holder = f"{socket.gethostname()}:{os.getpid()}:{self.epoch}"
        control.acquire_lease(self.redis, self.keys.shard_lease(self.options.shard), self.lease_holder,
                              ttl_s=self.options.lease_ttl_s, wait_s=self.options.lease_wait_s)
        algo = self.run.algo
        self.policy = QuorumPolicy(quorum=algo.quorum, tau=algo.tau, grace_gamma=algo.grace_gamma,
                                   grace_enabled=algo.grace_enabled, all_live=algo.lockstep,
                                   min_answers=self.options.min_answers)
        params = state_tensors(model)
        owned = owned_fragments(self.options.shard, self.options.shards, algo.fragments)
        for p in owned:
            theta = gather(params, self.plan[p])
            # with μ = 0 the momentum is never read nor written (common.merge.outer_step): a zero view
            # of one value, not a zero copy of the fragment (checkpointed as that one value)
            momentum = torch.zeros_like(theta) if algo.outer_momentum else torch.zeros(1).expand(theta.numel())
            self.frags[p] = FragmentState(spec=self.plan[p], theta=theta, momentum=momentum, history={0: theta})
        self.run_tokens = 0
        """The run's global token count as last seen in Redis."""
        self.token_shares: dict[str, int] = {}
        """Every learner process's share of that count as last seen (common/tokens.py): checkpointed,
        written back after Redis restarted empty (a learner that is gone cannot)."""
        self._live_fields: set[str] = set()
        """Learner processes (``<id>:<incarnation>``) live at the previous control refresh."""
        recorded = self._recorded_versions()
        loaded = False if self.options.fresh else self._load_checkpoint()
        self._start_recovery(recorded, loaded)
        if self.token_shares:  # Redis may have restarted empty: the learners' LR schedule must not go back
            self.run_tokens = max(self.run_tokens, run_count.record(self.redis, self.keys, self.token_shares))
        if self.options.merge_threads > 0:
            torch.set_num_threads(self.options.merge_threads)
        self._merger = ThreadPoolExecutor(max_workers=MERGE_WORKERS, thread_name_prefix=f"{self.id}-merge")
        self._open_sockets()
        self.started_at = self.clock()
        self._opens = OpenSchedule()
        """Where the opening schedule stands (common/quorum.py)."""
        self._refresh_control(force=True)
        control.add_event(self.redis, self.keys, "shard_start", shard=self.options.shard,
                          versions={p: f.version for p, f in self.frags.items()})
        self.log.info("syncer.started", fragments=owned, rpc=self.rpc_endpoint, config=self.run.to_dict(),
                      checkpoint=str(self.checkpoint_path) if self.checkpoint_path else "none",
                      versions={p: f.version for p, f in self.frags.items()})
        try:
            self.metrics = metrics.start(role="shard", run_id=self.endpoints.run_id, member=self.id,
                                         read=self.readings, host=self.options.metrics_host,
                                         port=self.options.metrics_port, info={"shards": str(self.options.shards)})
        except BaseException:
            self.close()
            raise
        if self.metrics is not None:
            self.log.info("syncer.metrics", url=self.metrics.url)
        return self

    def readings(self) -> list[metrics.Reading]:
        """What ``/metrics`` shows, read on the scrape's thread (copies of counters: no lock)."""
        st, frags = self.stats, list(self.frags.items())
        return [
            metrics.counter("shard_merges_total", "Rounds merged into a new fragment version (restored from the "
                            "checkpoint at start).", st.merges),
            metrics.counter("shard_answers_total", "Learner answers by outcome: accepted (into its open round), "
                            "late (the round had merged), stale_base (its base version or shard life is gone), "
                            "wrong_run.", {"accepted": st.answers, "late": st.late_answers,
                                           "stale_base": st.stale_base, "wrong_run": st.wrong_run}, "outcome"),
            metrics.counter("shard_answers_rejected_total", "Answers refused (nonfinite_delta) or cut (claims, "
                            "clipped) by the robust merge, by reason.", dict(st.rejected), "reason"),
            metrics.counter("shard_bad_entries_total", "Redis entries ignored as malformed, by kind.reason "
                            "(common/entries.py).", entries.BAD_ENTRIES.snapshot(), "reason"),
            metrics.counter("shard_malformed_total", "Messages and requests that failed to decode or made no "
                            "sense (dropped).", st.malformed),
            metrics.counter("shard_rounds_dropped_total", "Rounds whose merge was not finite (dropped).",
                            st.nonfinite_rounds),
            metrics.counter("shard_reopens_total", "Round opens sent again (no quorum yet).", st.reopens),
            metrics.counter("shard_bytes_total", "Message bytes: in (answers, copies), out (opens, merged "
                            "fragments, replies).", {"in": st.bytes_in, "out": st.bytes_out}, "direction"),
            metrics.counter("shard_fragment_requests_total", "Full-fragment requests: served, deferred (the "
                            "fragment was recovering), deduped (sent to that requester moments ago).",
                            {"served": st.requests, "deferred": st.requests_deferred, "deduped": st.requests_deduped},
                            "outcome"),
            metrics.counter("shard_checkpoints_total", "Checkpoints: written, failed.",
                            {"written": st.checkpoints, "failed": st.checkpoint_errors}, "outcome"),
            metrics.counter("shard_versions_behind_total", "Fragments that restarted below the run's recorded "
                            "version (no live learner had it).", st.versions_behind),
            metrics.histogram("shard_round_seconds", "Seconds from a round's open to its merge.", st.round_s),
            metrics.histogram("shard_merge_seconds", "Seconds of merge computation per round (worker thread).",
                              st.merge_s),
            metrics.counter("shard_rounds_behind_total", "Merges later than the schedule: the fragment's "
                            "learner steps between merges (EMA) above 1.2 x H.", st.rounds_behind),
            metrics.gauge("shard_grace_window_seconds", "The adaptive grace window: how long a round waits "
                          "for more answers past its quorum.", self.grace_s),
            metrics.gauge("shard_rounds_open", "Rounds in flight.", sum(f.round is not None for _, f in frags)),
            metrics.gauge("shard_fragments_recovering", "Fragments still collecting live learners' copies.",
                          sum(f.recovery is not None for _, f in frags)),
            metrics.gauge("shard_fragment_version", "Version of each owned fragment.",
                          {str(p): f.version for p, f in frags}, "fragment"),
            metrics.gauge("shard_live_learners", "Learners with a fresh heartbeat, as last read from Redis.",
                          len(self.live)),
            metrics.gauge("run_global_eval_loss", "The global model's last eval loss, as `ddloco up` evaluated it "
                          "(read from Redis; NaN when nothing evaluates the run).", self._eval_loss),
        ]

    def _open_sockets(self) -> None:
        self._ctx = zmq.Context()
        sec = self.security
        if sec is not None:
            sec.start_zap(self._ctx)
        self.sub = keep_alive(self._ctx.socket(zmq.SUB))
        self.sub.setsockopt(zmq.RCVHWM, 10_000)
        self.sub.setsockopt(zmq.LINGER, 0)
        # the largest legitimate frame: an owned fragment at fp32 (a `have`); requests and
        # subscriptions are small (a larger frame drops the sender's connection)
        self.sub.setsockopt(zmq.MAXMSGSIZE, wire.max_frame_bytes(max((f.spec.numel for f in self.frags.values()),
                                                                     default=0)))
        if sec is not None:
            sec.client(self.sub, "broker")
        self.sub.connect(self.endpoints.broker_sub)
        for p in self.frags:
            self.sub.setsockopt(zmq.SUBSCRIBE, wire.topic(self.endpoints.run_id, wire.UPDATE, p))
            self.sub.setsockopt(zmq.SUBSCRIBE, wire.topic(self.endpoints.run_id, wire.HAVE, p))
        self.pub = keep_alive(self._ctx.socket(zmq.PUB))
        self.pub.setsockopt(zmq.SNDHWM, 10_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.MAXMSGSIZE, wire.HEADER_SLACK_BYTES)
        if sec is not None:
            sec.client(self.pub, "broker")
        self.pub.connect(self.endpoints.broker_pub)
        self.router = keep_alive(self._ctx.socket(zmq.ROUTER))
        self.router.setsockopt(zmq.LINGER, 0)
        # a requester that does not read holds at most two replies of every owned fragment (each
        # reply's frames are shared by every requester of that version): a joiner asks for all at once
        chunk = self.options.reply_chunk_values
        replies = sum(1 if chunk <= 0 else -(-f.spec.numel // chunk) for f in self.frags.values())
        self.router.setsockopt(zmq.SNDHWM, 2 * replies + 16)
        self.router.setsockopt(zmq.MAXMSGSIZE, wire.HEADER_SLACK_BYTES)
        if sec is not None:
            sec.server(self.router, "shard")
        self.router.bind(self.options.rpc_bind)
        bound = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        host = self.options.advertise_host
        self.rpc_endpoint = bound if not host else f"tcp://{host}:{bound.rsplit(':', 1)[1]}"
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.poller.register(self.router, zmq.POLLIN)
        # a finished merge wakes the loop (its broadcast and the next open do not wait out a poll)
        self._wake_rx, self._wake_tx = socket.socketpair()
        for end in (self._wake_rx, self._wake_tx):
            end.setblocking(False)
        self.poller.register(self._wake_rx.fileno(), zmq.POLLIN)

    def _wake(self, _future: Any = None) -> None:
        """From a merge worker: the loop has a result to apply (a byte on the wake pair; if its
        buffer is full a wake is pending anyway)."""
        try:
            self._wake_tx.send(b"!")
        except OSError:
            pass

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self._ctx is None:
            return
        try:
            if self._lease_lost:
                return
            self._drain_merges()      # merges already computing are applied and broadcast, then saved
            self.checkpoint(wait=True)
            control.add_event(self.redis, self.keys, "shard_stop", shard=self.options.shard,
                              versions={p: f.version for p, f in self.frags.items()})
            self.redis.hset(self.keys.shard(self.options.shard), "status", "stopped")
            control.release_lease(self.redis, self.keys.shard_lease(self.options.shard), self.lease_holder)
        except redis.RedisError:
            pass
        finally:
            if self.security is not None:
                self.security.stop_zap(self._ctx)
            self._ctx.destroy(linger=0)
            self._ctx = None
            for end in (self._wake_rx, self._wake_tx):
                end.close()
        self.log.info("syncer.stopped", merges=self.stats.merges, dropped=self.stats.dropped,
                      versions={p: f.version for p, f in self.frags.items()})

    def _broadcast_merged(self, f: FragmentState, new: torch.Tensor, old_version: int, epoch: int
                          ) -> tuple[torch.Tensor, torch.Tensor | None, list[Any]]:
        """(replica, master, broadcast frames) after an outer step whose result is ``new`` (ALGORITHM §7).

        fp32 downlink: the full value (replica = ``new``, no separate master). Otherwise the
        update q(new − Θ_old) in the run's downlink codec, from version ``old_version``; the
        shard and every learner holding Θ_old compute Θ_old + deq(q(update)) with the same fp32
        additions, so all replicas stay bit-identical, while ``new`` stays the fp32 master (the
        next update carries what this one dropped). Pure: runs on the merge worker."""
        codec = self.run.algo.downlink_codec
        if codec == "fp32":
            return new, None, wire.encode(kind=wire.FRAG, run=self.endpoints.run_id, sender=self.id,
                                          fragment=f.spec.index, epoch=epoch, values=new, codec="fp32",
                                          version=old_version + 1)
        replica, frames = quantized_update(f.theta, new, codec)
        return replica, new, wire.encode(kind=wire.FRAG, run=self.endpoints.run_id, sender=self.id,
                                         fragment=f.spec.index, epoch=epoch, codec=codec,
                                         encoded=(frames, new.numel()), version=old_version + 1, base=old_version)

    # ---------------------------------------------------------------- checkpoints
    @property
    def checkpoint_path(self) -> Path | None:
        if not self.options.checkpoint_dir:
            return None
        name = f"{self.endpoints.run_id}-shard{self.options.shard}of{self.options.shards}.pt"
        return Path(self.options.checkpoint_dir).absolute() / name

    def checkpoint(self, *, wait: bool = False) -> None:
        """Snapshot {Θ, momentum, version, next_round} of every fragment (references to tensors no
        merge writes in place: no copy, no extra memory) and hand it to the writer thread, which
        writes it atomically (temp file, fsync, rename, fsync of the directory) off the loop. A
        snapshot taken while the previous one is still being written replaces any snapshot still
        waiting (the newest one wins).
        ``wait``: write synchronously after the writer finished (the final checkpoint at stop)."""
        if self.checkpoint_path is None:
            return
        state = {
            "format": 2, "run_digest": self.run.digest(), "run_config": self.run.to_dict(),
            "plan_digest": self.plan_digest, "shard": self.options.shard, "shards": self.options.shards,
            "epoch": self.epoch,
            # references, not copies: a fragment's tensors are replaced by every merge, never
            # written in place (FragmentState), so the snapshot stays at its versions meanwhile
            "fragments": {p: {"theta": f.theta, "momentum": f.momentum, "version": f.version,
                              "next_round": f.next_round,
                              **({} if f.master is None else {"master": f.master})}
                          for p, f in self.frags.items()},
            "merges": self.stats.merges, "saved_at": time.time(), "run_tokens": self.run_tokens,
            "token_shares": dict(self.token_shares),
        }
        self._merges_since_ckpt = 0
        if wait:
            self._ckpt_writer.close()
            self._write_checkpoint(state)
        else:
            self._ckpt_writer.submit(state)

    def _write_checkpoint(self, state: dict[str, Any]) -> None:
        """Atomic: write a temp file, fsync, rename over the old one, fsync the directory. Runs on
        the writer thread (or at stop): it reads nothing of the live shard state."""
        path = self.checkpoint_path
        assert path is not None
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        t0 = time.perf_counter()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except (OSError, RuntimeError) as e:  # disk full, directory gone: keep merging, the old one stays intact
            self.stats.checkpoint_errors += 1
            self.log.error("syncer.checkpoint_failed", path=str(path), error=str(e))
            tmp.unlink(missing_ok=True)
            return
        self.stats.checkpoints += 1
        self.log.info("syncer.checkpoint", path=str(path), write_s=round(time.perf_counter() - t0, 4),
                      versions={p: fs["version"] for p, fs in state["fragments"].items()})

    def _recorded_versions(self) -> dict[int, int]:
        """The newest version the run recorded for each owned fragment (0 when none)."""
        return {p: v or 0 for p, v in control.fragment_versions(self.redis, self.keys, self.frags).items()}

    def _start_recovery(self, recorded: dict[int, int], loaded: bool) -> None:
        """Versions never go back. ``--fresh``: the initial model, above every recorded version.
        Otherwise each fragment asks the live learners for their copies before its first round
        when the run recorded a newer version than the checkpoint holds, learners are live (not
        only joining ones of a run that trained no token yet) or a checkpoint was loaded (Redis
        may have lost the record), and waits until every live learner
        holding copies answered (none live for ``RECOVERY_QUIET_S``: none to ask, unless behind),
        for ``recovery_timeout_s`` at most
        (a frozen learner leaves the live set when its heartbeat expires; a loaded machine may
        take seconds to answer, and ending early would move every learner back)."""
        now = self.clock()
        control.sync_members(self.redis, self.keys)
        live = control.live_learners(self.redis, self.keys)
        holding = any(h.get("status") in HOLDING for h in live.values())
        if live and not holding and not loaded and not run_count.read_total(self.redis, self.keys):
            live = {}   # a new run: its learners are joining (waiting for us) and none trained yet
        for p, f in self.frags.items():
            if self.options.fresh:
                f.version = recorded[p] + 1 if recorded[p] else 0
                f.history = {f.version: f.theta}
                continue
            behind = recorded[p] > f.version
            if behind or live or loaded:  # a checkpoint may be older than the copies learners hold
                lone = max(recorded[p], f.version + self.options.checkpoint_every_merges) if loaded else \
                    (recorded[p] or math.inf)
                f.recovery = Recovery(recorded=recorded[p], deadline=now + self.options.recovery_timeout_s,
                                      quiet_until=0.0 if behind else now + RECOVERY_QUIET_S, lone_limit=lone)
        if self.options.fresh:
            self.log.warning("syncer.fresh_start", versions={p: f.version for p, f in self.frags.items()})
        self._momentum_source = "checkpoint" if loaded else "zero"

    def _advance_recovery(self, now: float) -> None:
        for p, f in self.frags.items():
            rec = f.recovery
            if rec is None:
                continue
            # the learners that hold copies: a joining one has none yet (it waits for us)
            live = {lid for lid, h in self.live.items() if h.get("status") in HOLDING}
            done = (now >= rec.deadline or (bool(live) and live <= rec.answered)  # every live learner answered
                    or (not live and rec.quiet_until and now >= rec.quiet_until))  # none to ask
            if not done:
                if now - rec.asked_at >= 1.0:  # lost, or learners joining meanwhile: ask again
                    self._publish(wire.encode(kind=wire.NEED, run=self.endpoints.run_id, sender=self.id,
                                              fragment=p, epoch=self.epoch, version=f.version))
                    rec.asked_at = now
                continue
            f.recovery = None
            old = f.version
            own = f.theta
            chosen = choose_copy(rec.copies, own_version=f.version, lone_limit=rec.lone_limit,
                                 distance=lambda key: float(torch.linalg.vector_norm(rec.values[key] - own)))
            if chosen is not None:
                version = chosen[0]
                learners = sorted(lid for lid, c in rec.copies.items() if c == chosen)
                f.theta, f.master, f.reply = rec.values[chosen], None, None
                f.version = version
                f.history = {version: f.theta}
                self.log.info("syncer.recovered", fragment=p, from_version=old, version=version, learners=learners,
                              momentum=self._momentum_source)
                control.add_event(self.redis, self.keys, "recover", shard=self.options.shard, fragment=p,
                                  from_version=old, version=version, learner=learners[0], agreeing=len(learners),
                                  momentum=self._momentum_source)
                self._publish(self._frag_frames(f))
            refused = {lid: c for lid, c in rec.copies.items() if c[0] > f.version}
            if refused:
                self.log.warning("syncer.recovery_copies_refused", fragment=p, version=f.version,
                                 copies={lid[:64]: v for lid, (v, _) in list(refused.items())[:10]})
            if f.version < rec.recorded:
                self.stats.versions_behind += 1
                self.log.warning("syncer.recovery_incomplete", fragment=p, version=f.version, recorded=rec.recorded,
                                 answered=sorted(rec.answered))
                control.add_event(self.redis, self.keys, "recover_incomplete", shard=self.options.shard, fragment=p,
                                  version=f.version, recorded=rec.recorded)

    def _on_have(self, msg: wire.Message) -> None:
        f = self.frags.get(msg.fragment)
        rec = None if f is None else f.recovery
        if rec is None or msg.numel != f.spec.numel:
            return  # not recovering (late reply): nothing to do
        try:
            value = msg.values()
        except wire.WireError as e:
            self._count_malformed(e)
            return
        if len(rec.answered) >= RECOVERY_COPIES and msg.sender not in rec.answered:
            return
        rec.answered.add(msg.sender)
        if not bool(torch.isfinite(value).all()):
            return
        key = (int(msg.version), zlib.crc32(value.contiguous().numpy().view(np.uint8)))
        if key not in rec.values and len(rec.values) >= RECOVERY_COPIES:
            return
        rec.values.setdefault(key, value)
        rec.copies[msg.sender] = key

    def _checkpoint_epoch(self) -> int:
        """The epoch recorded in this shard's checkpoint (0: none, or unreadable)."""
        path = self.checkpoint_path
        if self.options.fresh or path is None or not path.exists():
            return 0
        try:
            return int(torch.load(path, weights_only=True).get("epoch", 0))
        except Exception:  # a damaged file is reported by _load_checkpoint
            return 0

    def _load_checkpoint(self) -> bool:
        path = self.checkpoint_path
        if path is None or not path.exists():
            return False
        state = torch.load(path, weights_only=True)
        if (state.get("run_digest") not in {self.run.digest(), *self.run.legacy_digests()}
                or state.get("plan_digest") != self.plan_digest):
            raise CheckpointMismatch(f"checkpoint {path} belongs to another run config; move it away or use another --checkpoint-dir")
        if (state["shard"], state["shards"]) != (self.options.shard, self.options.shards):
            raise CheckpointMismatch(f"checkpoint {path} is for shard {state['shard']} of {state['shards']}")
        for p, fs in state["fragments"].items():
            f = self.frags[int(p)]
            f.theta, f.momentum, f.version = fs["theta"], fs["momentum"], int(fs["version"])
            f.master, f.reply = fs.get("master"), None
            f.history = {f.version: f.theta}  # answers on older bases are refused as stale
            f.next_round = int(fs["next_round"])
        self.stats.merges = int(state.get("merges", 0))
        self.run_tokens = int(state.get("run_tokens", 0))
        self._since_unknown_unix = float(state.get("saved_at", self._since_unknown_unix))
        # a checkpoint from before shares existed holds the total only: one share of it
        self.token_shares = run_count.merge_shares(state.get("token_shares") or {},
                                                   {} if "token_shares" in state or not self.run_tokens
                                                   else {run_count.EARLIER: self.run_tokens})
        self.log.info("syncer.resumed", path=str(path), versions={p: f.version for p, f in self.frags.items()})
        return True

    # ---------------------------------------------------------------- the loop
    def poll_once(self, timeout_ms: int = 20) -> None:
        events = dict(self.poller.poll(timeout_ms))
        if self._wake_rx.fileno() in events:
            try:
                while self._wake_rx.recv(4096):
                    pass
            except OSError:   # drained (would block)
                pass
        if self.sub in events:
            for _ in range(256):
                try:
                    frames = self.sub.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_update(frames)
        if self.router in events:
            for _ in range(256):
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_request(frames)
        self._finish_merges()
        now = self.clock()
        self._refresh_control(now=now)
        self._advance_recovery(now)
        self._advance_rounds(now)

    def _xi_step(self, *, slowest: bool) -> float:
        times = [t for t in map(_step_time_of, self.live.values()) if t is not None]
        if not times:
            return self.options.initial_step_time_s
        return max(times) if slowest else statistics.median(times)

    def _advance_rounds(self, now: float) -> None:
        algo = self.run.algo
        xi_step = self._xi_step(slowest=True)
        grace = grace_window_s(xi_step_s=xi_step, xi_quorum_s=self.xi_quorum.value or 0.0,
                               xi_sync_s=self.xi_sync.value or 0.0, tau=algo.tau, gamma=algo.grace_gamma)
        self.grace_s = grace
        answering = sum(1 for h in self.live.values() if h.get("status") in HOLDING)
        policy = dataclasses.replace(self.policy, min_answers_wait_s=self.options.min_answers_wait_periods
                                     * algo.sync_every_steps * xi_step)
        for p, f in self.frags.items():
            rnd = f.round
            if rnd is None:
                continue
            view = RoundView(opened_at_s=rnd.opened_at, answers=len(rnd.answers), quorum_reached_at_s=rnd.quorum_at,
                             live_learners=len(self.live), answering=answering)
            decision, reason = decide_round(now, view, policy, grace_s=grace)
            if decision is Decision.MERGE:
                self._merge(f, now, reason, grace)
            elif decision is Decision.WAIT_QUORUM and now - rnd.last_sent_at >= self._reopen_after_s(rnd, xi_step):
                rnd.attempt += 1
                self.stats.reopens += 1
                self._send_open(f, now)
        in_flight = [p for p, f in self.frags.items() if f.round is not None or f.merging is not None]
        if algo.lockstep:
            period, tau = 0.0, len(self.frags)
        elif self._finished & self.live.keys():
            # a learner took its last step and waits for its final answers to merge: no period to
            # keep (its steps are done), rounds back to back, τ in flight (the end of a run: no
            # learner idles a whole period of rounds, ~8 % of a 3 s run)
            period, tau = 0.0, algo.tau
        else:
            period, tau = algo.sync_every_steps * self._xi_step(slowest=False), algo.tau
        last = {p: f.last_opened_at for p, f in self.frags.items() if f.last_opened_at is not None}
        spacing = period / len(self.frags)
        ready = [p for p, f in self.frags.items() if f.recovery is None]
        for p in due_fragments(now, owned=ready, last_opened_s=last, in_flight=in_flight,
                               period_s=period, tau=tau, started_s=self.started_at, n_fragments=algo.fragments,
                               min_spacing_s=spacing, last_open_any_s=self._opens.last_open_any_s(spacing)):
            f = self.frags[p]
            f.round = OpenRound(round_id=f.next_round, opened_at=now,
                                timed=any(h.get("status") in HOLDING for h in self.live.values()))
            f.next_round += 1
            f.last_opened_at = now
            self._opens.record(now, spacing)
            self._send_open(f, now)

    def _reopen_after_s(self, rnd: OpenRound, xi_step: float) -> float:
        """Re-send an unanswered open (it may have been lost) with exponential backoff, so a
        round that simply waits for slow learners does not make fast ones re-answer often."""
        return self.options.reopen_after_steps * xi_step * (2 ** min(rnd.attempt, 3))

    def _send_open(self, f: FragmentState, now: float) -> None:
        rnd = f.round
        frames = wire.encode(kind=wire.OPEN, run=self.endpoints.run_id, sender=self.id, fragment=f.spec.index,
                             epoch=self.epoch, round=rnd.round_id, attempt=rnd.attempt, version=f.version)
        self._publish(frames)
        rnd.last_sent_at = now

    def _publish(self, frames: list[Any]) -> None:
        try:
            self.pub.send_multipart(frames, zmq.NOBLOCK, copy=False)
            self.stats.bytes_out += wire.message_nbytes(frames)
        except zmq.Again:
            self.log.warning("syncer.publish_dropped")

    # ---------------------------------------------------------------- messages
    def _on_update(self, frames: list[Any]) -> None:
        try:
            msg = wire.decode(frames, expect_run=self.endpoints.run_id)
        except wire.WrongRunError:
            self.stats.wrong_run += 1
            return
        except wire.WireError as e:
            self._count_malformed(e)
            return
        self.stats.bytes_in += msg.payload_nbytes
        if msg.kind == wire.HAVE:
            self._on_have(msg)
            return
        f = self.frags.get(msg.fragment)
        if msg.kind != wire.UPDATE or f is None or msg.numel != f.spec.numel or msg.steps < 1:
            self._count_malformed(ValueError(f"unexpected {msg.kind} for fragment {msg.fragment} "
                                             f"(numel {msg.numel}, steps {msg.steps})"))
            return
        rnd = f.round
        if rnd is None or msg.round != rnd.round_id:
            self.stats.late_answers += 1
            return
        if msg.epoch != self.epoch or msg.base not in f.history:
            self.stats.stale_base += 1
            self.log.info("syncer.stale_base", fragment=f.spec.index, learner=msg.sender, base=msg.base,
                          oldest=min(f.history), epoch=msg.epoch, our_epoch=self.epoch)
            return
        try:
            delta = msg.values()
        except wire.WireError as e:
            self._count_malformed(e)
            return
        if not bool(torch.isfinite(delta).all()):   # e.g. an int4 scale that decodes to inf: this answer only
            self._reject("nonfinite_delta", msg.sender, f.spec.index)
            return
        H, step_s = self.run.algo.sync_every_steps, self._claim_step_s(msg.sender)
        elapsed_s = self._time_since_answered(f, msg.sender, msg.round)
        max_steps = max_steps_claim(versions_since_base=f.version - msg.base, sync_every_steps=H, step_s=step_s,
                                    factor=self.options.max_steps_factor, elapsed_s=elapsed_s)
        steps, tokens, cut = bound_claims(steps=msg.steps, tokens=msg.tokens, max_steps=max_steps,
                                          tokens_per_step_bound=self.tokens_per_step_bound)
        for reason in cut:
            if reason == "claims_clamped":       # within the tolerance of an honest member's timing
                self.stats.claims_clamped += 1
                self.log.info("syncer.claims_clamped", learner=msg.sender[:64], fragment=f.spec.index,
                              steps=msg.steps, tokens=msg.tokens, max_steps=max_steps, round=msg.round,
                              base=msg.base, version=f.version, elapsed_s=round(elapsed_s, 3), step_s=round(step_s, 5))
                continue
            self._reject(reason, msg.sender, f.spec.index, steps=msg.steps, tokens=msg.tokens, max_steps=max_steps,
                         base=msg.base, version=f.version, elapsed_s=round(elapsed_s, 3), step_s=round(step_s, 5))
        now = self.clock()
        clip_steps = min(steps, steps_in_time(elapsed_s=elapsed_s, step_s=step_s, sync_every_steps=H))
        rnd.answers[msg.sender] = Answer(sender=msg.sender, base=msg.base, steps=steps, tokens=tokens,
                                         delta=delta, received_at=now, clip_steps=clip_steps)
        if msg.final:             # past its last step: rounds open without spacing while it is live
            if len(self._finished) < 100_000:
                self._finished.add(msg.sender)
        else:
            self._finished.discard(msg.sender)
        self.stats.answers += 1
        if rnd.quorum_at is None and len(rnd.answers) >= self.policy.quorum:
            rnd.quorum_at = now
            if rnd.timed:
                self.xi_quorum.update(now - rnd.opened_at)

    def _time_since_answered(self, f: FragmentState, learner: str, round_id: int) -> float:
        """Seconds since ``learner`` last answered an earlier round of fragment ``f`` (its steps
        since then are what it claims now), and this answer recorded. A learner never seen
        answering: since it joined, as this shard saw it (learners live when this shard started:
        since the last checkpoint, or this process's start; one not yet seen live: since the last
        read of the live learners)."""
        now = time.time()
        seen = f.answered_unix.get(learner)
        joined = self._first_seen.setdefault(learner, self._live_read_unix) if seen is None else now
        reference, f.answered_unix[learner] = claims_reference(seen, round_id, now, joined)
        if len(f.answered_unix) > 100_000:       # bounded whatever joins
            f.answered_unix.clear()
        return now - reference

    def _claim_step_s(self, learner: str) -> float:
        """The step time a learner's claims are checked against: its own step-time EMA (the last
        one seen: Redis may have restarted), never below a share of the median of the learners'.
        Not known yet (its first heartbeats, the first second of a run): the fastest one known, and
        before any is, STEP_TIME_UNKNOWN_S."""
        known = [t for lid, t in self._step_s_seen.items() if lid in self.live] or list(self._step_s_seen.values())
        own = self._step_s_seen.get(learner, min(known) if known else STEP_TIME_UNKNOWN_S)
        median = statistics.median(known) if known else own
        return max(own, STEP_TIME_FLOOR_OF_MEDIAN * median)

    def _reject(self, reason: str, sender: str, fragment: int, **detail: Any) -> None:
        """Count an answer refused, or its claims or outer gradient cut, by the robust-merge rules."""
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        n = self.stats.rejected[reason]
        if n <= 10 or n % 100 == 0:   # bounded logging whatever a sender does
            self.log.warning("syncer.answer_rejected", reason=reason, learner=sender[:64], fragment=fragment,
                             count=n, **detail)

    def _count_malformed(self, err: Exception) -> None:
        self.stats.malformed += 1
        if self.stats.malformed <= 10 or self.stats.malformed % 100 == 0:
            self.log.warning("syncer.malformed_dropped", error=str(err), total=self.stats.malformed)

    def _on_request(self, frames: list[Any]) -> None:
        ident, rest = frames[0], frames[1:]
        try:
            msg = wire.decode(rest, expect_run=self.endpoints.run_id)
        except wire.WireError as e:
            self._count_malformed(e)
            return
        f = self.frags.get(msg.fragment)
        if msg.kind != wire.GET or f is None:
            self._count_malformed(ValueError(f"request {msg.kind} for fragment {msg.fragment} not owned"))
            return
        if f.recovery is not None:
            # not the run's value yet (the initial model or an old checkpoint): the requester
            # asks again and gets the recovered value; never serve a value that would move it back
            self.stats.requests_deferred += 1
            return
        key = (ident.bytes, f.spec.index)
        now = self.clock()
        last = self._served.get(key)
        if last is not None and last[:2] == (self.epoch, f.version) and now - last[2] < REQUEST_DEDUPE_S:
            self.stats.requests_deduped += 1     # the same value is on its way to that requester
            return
        self.stats.requests += 1
        if f.reply is None or f.reply[:2] != (self.epoch, f.version):
            f.reply = (self.epoch, f.version, self._reply_messages(f))
        else:
            self.stats.replies_cached += 1
        for reply in f.reply[2]:
            try:
                self.router.send_multipart([ident, *reply], zmq.NOBLOCK, copy=False)
                self.stats.bytes_out += wire.message_nbytes(reply)
            except zmq.Again:
                return                            # not (all) sent: a retry is served, the chunks here are kept
        if len(self._served) > 100_000:          # bounded whatever requesters do
            self._served.clear()
        self._served[key] = (self.epoch, f.version, now)

    def _reply_messages(self, f: FragmentState) -> list[list[Any]]:
        """The reply to a request: the full value, in chunks of ``reply_chunk_values`` when it
        is larger (each its own message: the requester assembles them, common/rpc.py)."""
        if self._whole_reply(f):
            return [self._frag_frames(f)]
        n, chunk = f.theta.numel(), self.options.reply_chunk_values
        return [self._frag_frames(f, off, chunk) for off in range(0, n, chunk)]

    def _whole_reply(self, f: FragmentState) -> bool:
        chunk = self.options.reply_chunk_values
        return chunk <= 0 or f.theta.numel() <= chunk

    def _frag_frames(self, f: FragmentState, offset: int = 0, count: int | None = None) -> list[Any]:
        """The full value every replica holds, exact (fp32): a join, a repair, a recovery; or
        ``count`` values of it from ``offset``, a chunk of the reply (``of`` = the whole)."""
        whole = count is None
        values = f.theta if whole else f.theta[offset:offset + count]
        return wire.encode(kind=wire.FRAG, run=self.endpoints.run_id, sender=self.id, fragment=f.spec.index,
                           epoch=self.epoch, values=values, codec="fp32", version=f.version,
                           offset=offset, of=-1 if whole else f.theta.numel())

    # ---------------------------------------------------------------- merge (ALGORITHM §5)
    def _merge(self, f: FragmentState, now: float, reason: str, grace: float) -> None:
        """Close the round and hand its merge to the worker thread; ``_finish_merges`` applies the
        result on this loop (which meanwhile goes on reading sockets and answering requests).
        The fragment opens no round until then."""
        rnd = f.round
        answers = list(rnd.answers.values())
        weights, capped = fair_weights([a.tokens for a in answers], [a.steps for a in answers])  # [M]
        self.stats.weights_capped += len(capped)
        f.round = None
        if float(weights.sum()) <= 0.0:
            self._record_failed_round(f, "every answer weighs 0 (no tokens claimed)")
            return
        job = _MergeJob(fragment=f, rnd=rnd, answers=answers, weights=weights, closed_at=now, reason=reason,
                        grace=grace, version=f.version, epoch=self.epoch)
        f.merging = job
        if self._merger is None:
            job.result = self._compute_merge(job)
            self._apply_merge(job)
        else:
            job.future = self._merger.submit(self._compute_merge, job)
            job.future.add_done_callback(self._wake)

    def _compute_merge(self, job: "_MergeJob") -> "_MergeResult":
        """ALGORITHM §5 on the worker thread. Reads the fragment's value, momentum and history,
        which only the loop changes, and only when it applies this job's result, and updates the
        fragment's clipper (a fragment's merges run one at a time); returns new tensors. Memory: O(|fragment|) whatever the number of answers (accumulated, not stacked)."""
        t0 = time.perf_counter()
        f, algo = job.fragment, self.run.algo
        master = f.theta if f.master is None else f.master      # the exact fp32 master
        scratch = self._merge_scratch(f.spec.numel)
        acc = OuterAccumulator(f.spec.numel, f.spec.spans, algo.merge_rule, scratch=scratch[:2], robust_buffers=True,
                               robust_radius=True)
        # float buffers (BatchNorm statistics) move by their own rule, not the norm bound; an answer
        # moving them by more than the warm-up ceiling × their norm is left out (a 1e30 variance)
        buffer_ceiling = f.clipper.ceiling_factor * max(acc.float_buffer_norm(f.theta), 1.0)
        # Δ_m = Θ_p − (Θ_p^{base_m} + δ_m) against the replica every learner holds (the learner's own
        # value is built on it); the step is taken from the master, so what quantization left out of
        # the replica (master − replica) is carried, never mistaken for a gradient. Robust: each Δ_m
        # is scaled down to the lower of a few times its learners' median norm and 1.5 × the round's
        # weighted median (or, before either exists, dropped when far larger than the fragment)
        scales = fold_round(acc, f.theta, [(a.sender, f.history[a.base], a.delta, a.clip_steps) for a in job.answers],
                            job.weights.tolist(), f.clipper, buf=scratch[2], buffer_ceiling=buffer_ceiling)
        clipped = [a.sender for a, scale in zip(job.answers, scales) if scale != 1.0]
        if acc.count == 0:                                       # every answer dropped: no merge
            return _MergeResult(None, None, None, [], clipped, time.perf_counter() - t0, every_answer_dropped=True)
        theta, momentum = outer_step(master, f.momentum, acc.result(), f.spec.spans, algo, merges_done=job.version)
        if not bool(torch.isfinite(theta).all()):   # a diverged learner must not poison Θ
            return _MergeResult(None, None, None, [], clipped, time.perf_counter() - t0)
        replica, master, frames = self._broadcast_merged(f, theta, job.version, job.epoch)
        return _MergeResult(replica, master, momentum, frames, clipped, time.perf_counter() - t0)

    def _merge_scratch(self, numel: int) -> tuple[torch.Tensor, ...]:
        """The merge accumulator's two buffers and one for an answer's outer gradient, ``numel``
        long: views of buffers this thread allocated once, as long as the shard's largest fragment,
        and reuses for every merge it runs (fresh memory's page faults cost as much as the math).
        One set per merging thread, not per fragment: 3 × the largest fragment per thread, whatever
        the number of fragments the shard owns. A merge's result is copied out before the thread's
        next merge reuses them (``outer_step`` returns new tensors)."""
        bufs = getattr(self._scratch, "bufs", None)
        if bufs is None or bufs[0].numel() < numel:
            size = max([numel, *(f.spec.numel for f in self.frags.values())])
            bufs = self._scratch.bufs = tuple(torch.empty(size, dtype=torch.float32) for _ in range(3))
        return tuple(b[:numel] for b in bufs)

    def _drain_merges(self) -> None:
        merger, self._merger = self._merger, None
        if merger is None:
            return
        merger.shutdown(wait=True)
        for f in self.frags.values():
            job = f.merging
            if job is not None and job.future is not None:
                try:
                    job.result = job.future.result()
                except Exception as e:   # logged; the checkpoint of what was merged still gets written
                    f.merging = None
                    self.log.error("syncer.merge_failed", fragment=f.spec.index, error=repr(e))
                    continue
                self._apply_merge(job)

    def _finish_merges(self) -> None:
        for f in self.frags.values():
            job = f.merging
            if job is not None and job.future is not None and job.future.done():
                job.result = job.future.result()            # an exception here is a bug: the daemon stops
                self._apply_merge(job)

    def _apply_merge(self, job: "_MergeJob") -> None:
        f, rnd, answers, res = job.fragment, job.rnd, job.answers, job.result
        f.merging = None
        for sender in res.clipped:
            self._reject("clipped", sender, f.spec.index)
        if res.replica is None:
            if res.every_answer_dropped:              # by the clipper: nothing to merge, Θ as it was
                self.log.warning("syncer.merge_dropped_every_answer_clipped", fragment=f.spec.index,
                                 round=rnd.round_id, contributors=[a.sender for a in answers])
                self._record_failed_round(f, "every answer dropped by the norm bound (syncer.merge_dropped_every_answer_clipped)")
                return
            self.stats.nonfinite_rounds += 1
            self.log.warning("syncer.nonfinite_merge_dropped", fragment=f.spec.index, round=rnd.round_id,
                             contributors=[a.sender for a in answers])
            self._record_failed_round(f, "the merged value was not finite (syncer.nonfinite_merge_dropped)")
            return
        if f.failed_rounds:
            self.log.info("syncer.fragment_merges_again", fragment=f.spec.index, failed_rounds=f.failed_rounds)
            f.failed_rounds = 0
        algo = self.run.algo
        f.theta, f.master, f.momentum = res.replica, res.master, res.momentum
        f.version += 1
        if f.master is None and self._whole_reply(f):
            f.reply = (job.epoch, f.version, [res.frames])   # fp32 downlink: the broadcast is the reply
        else:
            f.reply = None          # an older version's reply serves no request now, and is as large as the fragment
        f.history[f.version] = f.theta             # never changed in place: a new tensor every merge
        for v in sorted(f.history)[:-algo.history_versions]:
            del f.history[v]
        self._publish(res.frames)
        now = self.clock()
        self.stats.merges += 1
        self.stats.round_s.observe(now - rnd.opened_at)
        self.stats.merge_s.observe(res.seconds)
        self._merges_since_ckpt += 1
        self.xi_sync.update(now - job.closed_at)    # round closed -> merged value out (compute included)
        contributors = [a.sender for a in answers]
        waited = 0.0 if rnd.quorum_at is None else job.closed_at - rnd.quorum_at
        self.log.info("syncer.merge", fragment=f.spec.index, version=f.version, round=rnd.round_id,
                      contributors=contributors, reason=job.reason, merge_s=round(res.seconds, 4))
        self._record_merge(f, rnd, answers, job.weights, waited, job.grace, job.reason)
        self._check_schedule(f, now)
        if self._merges_since_ckpt >= self.options.checkpoint_every_merges:
            self.checkpoint()

    def _record_failed_round(self, f: FragmentState, problem: str) -> None:
        """A round closed without a merge: counted per fragment, and its reason kept in the
        fragment's Redis entry (``ddloco status`` and ``up`` name it) until the next merge."""
        f.failed_rounds += 1
        try:
            self.redis.hset(self.keys.fragment(f.spec.index), mapping={"problem": problem,
                                                                       "failed_rounds": f.failed_rounds})
        except redis.RedisError as e:
            self._redis_lost(e)

    def _check_schedule(self, f: FragmentState, now: float) -> None:
        """Rounds must come every H learner steps: the steps between two merges of a fragment
        (time between them ÷ the median learner step time) are tracked as an EMA; above
        BEHIND_FACTOR × H the merge is counted as behind and logged (at most every 10 s)."""
        last, f.last_merged_at = f.last_merged_at, now
        if last is None or self.run.algo.lockstep or not self.live:
            return
        h = (now - last) / max(self._xi_step(slowest=False), 1e-6)
        f.effective_h = h if f.effective_h == 0.0 else 0.8 * f.effective_h + 0.2 * h
        H = self.run.algo.sync_every_steps
        if f.effective_h > BEHIND_FACTOR * H:
            self.stats.rounds_behind += 1
            if now - self._behind_logged_at >= 10.0:
                self._behind_logged_at = now
                self.log.warning("syncer.rounds_behind", fragment=f.spec.index, effective_h=round(f.effective_h, 1),
                                 configured_h=H, last_merge_s=round(self.stats.merge_s.last_s, 4),
                                 count=self.stats.rounds_behind)

    def _record_merge(self, f: FragmentState, rnd: OpenRound, answers: list[Answer], weights: torch.Tensor,
                      waited: float, grace: float, reason: str) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            t = time.time()
            pipe.hset(self.keys.fragment(f.spec.index), mapping={
                "version": f.version, "shard": self.options.shard, "merged_at": t,
                "contributors": ",".join(a.sender for a in answers)})
            pipe.hdel(self.keys.fragment(f.spec.index), "problem", "failed_rounds")
            for a in answers:
                pipe.hincrby(self.keys.learner(a.sender), "merged_contributions", 1)
                pipe.hset(self.keys.learner(a.sender), "last_merged_at", t)
            control.add_event(pipe, self.keys, "merge", fragment=f.spec.index, version=f.version,
                              shard=self.options.shard, round=rnd.round_id,
                              contributors=[a.sender for a in answers],
                              weights=[round(float(w), 4) for w in weights],
                              grace_waited_s=round(waited, 4), grace_s=round(grace, 4), reason=reason,
                              dropped=self.stats.dropped)
            pipe.execute()
            self._redis_ok = True
        except redis.RedisError as e:
            self._redis_lost(e)

    # ---------------------------------------------------------------- control plane
    def _refresh_control(self, now: float | None = None, force: bool = False) -> None:
        now = self.clock() if now is None else now
        if not force and now - self._last_control < CONTROL_REFRESH_S:
            return
        self._last_control = now
        try:
            if not control.renew_lease(self.redis, self.keys.shard_lease(self.options.shard), self.lease_holder,
                                       ttl_s=self.options.lease_ttl_s):
                self._lease_lost = True  # another process owns these fragments now: write nothing
                raise control.LeaseHeld(f"lost the lease of shard {self.options.shard} to "
                                        f"{self.redis.get(self.keys.shard_lease(self.options.shard))!r}")
            control.sync_members(self.redis, self.keys)   # the membership set is ours to keep
            self.live = control.live_learners(self.redis, self.keys)
            self._remember_step_times()
            self._accept_token_claims()
            self._live_read_unix = time.time()
            pipe = self.redis.pipeline(transaction=False)
            control.register_shard(pipe, self.keys, self.options.shard, {
                "rpc": self.rpc_endpoint, "shards": self.options.shards, "pid": os.getpid(),
                "plan": self.plan_digest, "checkpoint": str(self.checkpoint_path or ""), "epoch": self.epoch,
                "versions_behind": self.stats.versions_behind, "checkpoints": self.stats.checkpoints,
                **{f"rejected_{k}": v for k, v in self.stats.rejected.items()},
                "status": "running", "merges": self.stats.merges, "dropped": self.stats.dropped,
                "malformed": self.stats.malformed, "late_answers": self.stats.late_answers,
                "stale_base": self.stats.stale_base, "bytes_out": self.stats.bytes_out,
                "bytes_in": self.stats.bytes_in, "reopens": self.stats.reopens, "heartbeat_at": time.time(),
                "answers": self.stats.answers, "rounds_behind": self.stats.rounds_behind,
                "claims_clamped": self.stats.claims_clamped,
                "weights_capped": self.stats.weights_capped,
                "merge_s_sum": round(self.stats.merge_s.sum_s, 4), "replies_cached": self.stats.replies_cached,
                "requests": self.stats.requests, "requests_deduped": self.stats.requests_deduped,
                "peak_rss_mb": peak_rss_mb(), "cpu_s": round(time.process_time(), 3),
                "bad_entries": entries.BAD_ENTRIES.total()})
            for p, f in self.frags.items():
                if f.recovery is not None:
                    continue  # the recorded version stays until this fragment has caught up
                pipe.hset(self.keys.fragment(p), mapping={"version": f.version, "shard": self.options.shard,
                                                          "round": -1 if f.round is None else f.round.round_id})
            control.publish_run_config(pipe, self.keys, self.run)  # rebuilds it after an empty restart
            pipe.hsetnx(self.keys.config, "shards", self.options.shards)
            control.raise_counter(pipe, self.keys.epochs, self.epoch)  # epochs never go back either
            # the run's token count (the learners' LR schedule): put back the shares Redis lost, read them
            run_count.record(pipe, self.keys, self.token_shares)
            pipe.hgetall(self.keys.token_shares)
            pipe.hget(self.keys.eval, "loss")       # `up`'s last evaluation of the global model, for /metrics
            res = pipe.execute()
            self.token_shares = run_count.merge_shares(self.token_shares, res[-2])
            self.run_tokens = max(self.run_tokens, int(res[-3]))
            self._eval_loss = _finite_or_nan(res[-1])
            control.restore_run_config(self.redis, self.keys, self.run, plan_layout(self.plan))
            if not self._redis_ok:
                self.log.info("syncer.redis_back")
            self._redis_ok = True
        except redis.RedisError as e:
            self._redis_lost(e)

    def _accept_token_claims(self) -> None:
        """Learner processes' own token counts taken into the run's shares, each learner id capped
        by ``run_count.accept_claims``: the live ones' (their hashes), and from the ``life`` hashes
        those of processes live at the previous read (their last count) and of processes never
        counted yet (a life shorter than one control refresh). A process that stays gone is not
        read again (until it is live again): a stopped attacker's claim does not grow with the others'."""
        paused = set(self.token_shares) - self._live_fields
        claims = run_count.claims_of_lives(control.life_token_counts(self.redis, self.keys, skip=paused))
        live = run_count.claims_of(self.live)
        claims.update(live)
        self._live_fields = set(live)
        # no id above 2 x the median learner's count, nor, while the others are joining, above one
        # sync period's tokens at the claims' bound
        floor = int(self.tokens_per_step_bound * self.run.algo.sync_every_steps)
        self.token_shares = run_count.accept_claims(self.token_shares, claims, live=self.live, floor=floor)

    def _remember_step_times(self) -> None:
        """Each live learner's step-time EMA, kept when Redis forgets it (claims are checked against it)."""
        if len(self._step_s_seen) > 100_000:     # bounded whatever joins
            self._step_s_seen.clear()
        if len(self._first_seen) > 100_000:
            self._first_seen.clear()
        first = self._live_reads == 0   # learners live at this shard's very first read: since it started
        self._live_reads += 1
        for lid, h in self.live.items():
            # it was not live at the previous read: it joined after that, at the earliest
            self._first_seen.setdefault(lid, self._since_unknown_unix if first else self._live_read_unix)
            t = _step_time_of(h)
            if t is not None:
                self._step_s_seen[lid] = t

    def _redis_lost(self, err: Exception) -> None:
        if self._redis_ok:
            self.log.warning("syncer.redis_unavailable", error=str(err))
        self._redis_ok = False
