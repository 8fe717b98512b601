"""The learner: AdamW inner steps that never wait on the network (ALGORITHM §3, §6).

Three threads:
- the training thread (the caller of ``Learner.run``) runs the inner loop and, at step
  boundaries only, applies merged fragments and snapshots fragments to answer open rounds;
- the network thread owns every ZeroMQ socket: it decodes merged fragments, quantizes and
  publishes answers, asks shards for full fragments (join, version gaps);
- the control thread batches heartbeat and counters to Redis in one pipeline per interval.
Hand-over between them is by queues of whole fragments; the training thread never does I/O.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import secrets
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np
import redis
import torch

from common import control, metrics, tokens as run_count
from common import entries
from common.config import ConfigError, Endpoints, LearnerOptions, RunConfig
from common.fragments import (Fragment, describe_plan_difference, gather, model_plan, plan_digest,
                              scatter, state_tensors)
from common.keys import Keys, token_share
from common.merge import Contribution, receive_merged
from common.lifecycle import peak_rss_mb, process_start_time, rss_mb, tune_allocator
from common.log import get_logger
from learner.network import (Answer, AskPeer, Fetch, FragmentArrived, Have, NetworkThread, Outbox, PeerState,
                             PeerStateArrived, PeerStateWanted, RoundOpened, StateRequested, optimizer_digest)
from learner.group import Group, group_from_env, params_digest, rank_stream, resolve_sharding
from learner.inner import apply_step, load_optimizer_state, make_inner_optimizer, schedule_factor
from learner.staging import HostStaging, staging_for
from common.task import Task, TaskError, batch_to, bind_task, build_model, check_task, count_tokens, scalar_loss
from common.task import TaskNotAllowed


FETCH_RETRY_S = 1.0
FETCH_PENDING_S = 5.0
"""A missed update asks for the full value again only if no fetch of that fragment went out this
recently (the reply of a large fragment takes a while; updates meanwhile are kept and replayed)."""
AHEAD_UPDATES = 16
"""Updates kept per fragment while its full value is on its way."""
REDIS_JOIN_PATIENCE_S = 30.0
"""How long a joining learner waits for an unreachable Redis (restarting) before it exits."""
SERVE_COST_STEPS = 20
"""Steps over which a learner that served its state to a joiner measures what it cost it."""
LOSS_READ_EVERY = 16
"""On an accelerator the loss EMA is brought up to date every this many steps (one host sync)."""


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


class LearnerRefused(RuntimeError):
    """The run refused this learner (config or model layout differs); the message says why."""


class JoinTimeout(RuntimeError):
    """The shards did not serve the current fragments in time."""


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


def resolve_device(name: str) -> torch.device:
    """"auto" -> the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"learner device {name!r} asked for, but torch sees no CUDA device")
    return dev


def data_stream(options: LearnerOptions, learner_id: str) -> int:
    """The learner's data stream: ``data_shard``, else one derived from its id (scaled replicas
    with unique ids get distinct streams)."""
    if options.data_shard >= 0:
        return options.data_shard
    return zlib.crc32(learner_id.encode()) % (2**31 - 1)


def resolve_learner_id(options: LearnerOptions) -> str:
    """The learner's id: as configured, else <hostname>-<pid>."""
    return options.learner_id or f"{socket.gethostname()}-{os.getpid()}"


class Learner:
    """One learner. ``Learner(...).run()`` joins, trains until ``max_steps`` or ``stop``, leaves."""

    network_class: type[NetworkThread] = NetworkThread
    """The network thread (a test may wrap it to inject faults)."""

    def __init__(self, *, endpoints: Endpoints, options: LearnerOptions, task: Task | None = None,
                 run: RunConfig | None = None, stop: threading.Event | None = None) -> None:
        """``task``: the model and data (None: load the run's task from its config in Redis).
        ``run``: the run config to start or join with (None: take the run's from Redis)."""
        self.endpoints = endpoints
        self.options = options
        self.malloc_tuned = tune_allocator()   # fragment-sized temporaries off fresh mappings
        self.id = resolve_learner_id(options)
        self.keys = Keys(endpoints.run_id)
        self.task = task
        self._run_arg = run
        self.stop = stop or threading.Event()
        self.stats = LearnerStats()
        self.log = get_logger("learner", learner=self.id, run=endpoints.run_id)
        self.status = "joining"
        self.data_position = 0
        """Batches consumed before this life (read from Redis at join); reported as data_position."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = Outbox()
        self._losses: list[torch.Tensor] = []
        self._loss_seen = 0
        self._threads_stop = threading.Event()
        self._endpoints_lock = threading.Lock()
        self._shard_endpoints: tuple[int, dict[int, str]] = (0, {})
        self._started_at = time.time()
        self.joined_versions: dict[int, int] = {}
        self._fatal: BaseException | None = None
        self._process_started_at = process_start_time() or self._started_at
        self.stats.boot_phases["init"] = round(time.time() - self._process_started_at, 3)
        self._opt: torch.optim.Optimizer | None = None
        self._sched: Any = None
        self._boot_optimizer: dict[str, Any] | None = None
        self._boot_life_steps = 0
        self._timed_steps = 0
        """Inner steps of this life seen by the step-time estimate (``step_time_estimate``)."""
        self._serve_watch: dict[str, Any] | None = None
        self.incarnation = secrets.token_hex(4)
        """This process's life under ``self.id``: a restart with the same id is a new incarnation."""
        self.metrics: metrics.MetricsServer | None = None
        ranks = group_from_env()
        self.group: Group | None = Group(*ranks) if ranks is not None else None
        """This process's rank of a torchrun learner (learner/group.py); None: a learner of one process."""
        self._changed: dict[int, torch.Tensor] = {}
        """In a group, rank 0's fragments changed since the last step boundary (the values it
        applied: scattered into its own tensors, or in a sharded group sent to every shard)."""
        self._group_run_tokens = 0.0
        self._sharding = "ddp"
        """In a group: "ddp" (every rank holds the whole model) or "fsdp" (rank 0 decides, at join)."""
        self._deferred: list[FragmentArrived] = []
        self._gathered: dict[int, torch.Tensor] | None = None
        """Rank 0 of a sharded group while it trains: merges that arrived wait for the step
        boundary (``_deferred``), where the group gathers the fragments rank 0 needs whole
        (``_gathered``: p → flat value, updated as merges are applied); None between boundaries."""
        self._deferring = False
        self._trained_rss_mb = 0.0
        self._schedule_dip: tuple[int, float] | None = None
        """While the schedule reads a run token count below its highest: (reads so far, lowest
        ratio of the schedule's factor to the factor at the highest count)."""

    # ------------------------------------------------------------------ join
    def _prepare(self, run: RunConfig, *, shared: bool = False) -> None:
        """Bind the task to ``run``, build the model and its plan, dry-run one batch: every check
        that can refuse this learner, before it writes anything to Redis. ``shared``: ``run`` came
        from Redis (its task spec is imported only if this machine allows it)."""
        self.task, self.run_cfg = bind_task(run, self.task, shared=shared)
        self.algo = self.run_cfg.algo
        self.device = self._resolve_device()
        self.model = build_model(self.task, self.run_cfg.task.seed).to(self.device)
        self.tensors = state_tensors(self.model)
        self.plan: tuple[Fragment, ...] = model_plan(self.model, self.task.embedding_names, self.algo.fragments)
        self.plan_digest = plan_digest(self.plan)
        self._staging: HostStaging | None = staging_for(self.device, grouped=self.group is not None)
        self.stream = data_stream(self.options, self.id)
        check_task(self.task, self.model, seed=self.run_cfg.task.seed, stream=self.stream)
        self.stats.boot_phases["prepared"] = round(time.time() - self._process_started_at, 3)

    def _resolve_device(self) -> torch.device:
        """``options.device``; in a group on CUDA, this rank's GPU (cuda:LOCAL_RANK: one GPU per
        rank, whatever index was given), made the current device."""
        device = resolve_device(self.options.device)
        if self.group is not None and device.type == "cuda":
            if device.index is not None and device.index != self.group.local_rank:
                self.log.warning("learner.group_device", given=str(device), used=f"cuda:{self.group.local_rank}",
                                 detail="a torchrun learner puts rank r on cuda:LOCAL_RANK")
            device = torch.device("cuda", self.group.local_rank)
            torch.cuda.set_device(device)
        return device

    def prepare(self) -> None:
        """Connect to Redis, take (or publish) the run config, build the task and model, dry-run
        one batch: everything that does not depend on the learner id. ``run`` does it when it has
        not been done; a standby process (``ddloco learner --standby``) does it ahead of time."""
        if getattr(self, "redis", None) is not None:
            return
        if self._run_arg is not None:
            if getattr(self, "run_cfg", None) is None:
                self._prepare(self._run_arg)                 # refusals happen before any write
            r = control.connect(self.endpoints.redis_url)
            try:   # written by `up`, the shards or the operator: a learner writes no shared key
                control.check_run_config(r, self.keys, self.run_cfg, wait_s=self.options.join_timeout_s,
                                         stop=self.stop, redis_url=self.endpoints.redis_url,
                                         on_wait=lambda why: self.log.warning(
                                             "learner.run_config_missing", detail=why,
                                             gives_up_after_s=self.options.join_timeout_s))
            except control.ConfigMismatch as e:
                control.add_learner_event(r, self.keys, self.id, "refuse", reason=str(e))
                raise LearnerRefused(str(e)) from None
            self.redis = r   # set last: a Redis error above leaves prepare() to be retried whole
        else:
            r = control.connect(self.endpoints.redis_url)
            run = control.fetch_run_config(
                r, self.keys, wait_s=self.options.join_timeout_s, stop=self.stop,
                redis_url=self.endpoints.redis_url,
                on_wait=lambda why: self.log.warning("learner.run_config_missing", detail=why,
                                                     gives_up_after_s=self.options.join_timeout_s))
            try:
                self._prepare(run, shared=True)
            except TaskNotAllowed:  # the run names a task this machine does not import: exit 2
                raise
            except TaskError as e:  # this machine's task differs from the run's
                control.add_learner_event(r, self.keys, self.id, "refuse", reason=str(e))
                raise LearnerRefused(f"refused: {e}") from None
            self.redis = r

    def warm_up(self) -> None:
        """A standby process: pay the lazy first-use costs now (the first AdamW construction
        imports torch's compiler stack: seconds), not after a failure. (Not done by every learner
        before it joins: in 5 `make demo` runs that way the final eval loss was 2.31-2.43 against
        2.25-2.33 without; the cause is not understood.)"""
        w = torch.nn.Parameter(torch.zeros(1))   # no random init: the run's RNG streams stay as they were
        holder = torch.nn.Module()
        holder.w = w
        opt, sched = make_inner_optimizer([w], self.algo)
        (w * 2.0).sum().backward()
        apply_step(holder, opt, sched)
        opt.load_state_dict(opt.state_dict())
        import prometheus_client  # noqa: F401  (the /metrics endpoint starts with run(): not after a failure)

    def use_redis_url(self, url: str) -> None:
        """A standby told which learner to become: that learner's own Redis user from now on (a
        standby of ``up`` reads with a user that writes nothing)."""
        self.endpoints = replace(self.endpoints, redis_url=url)
        if getattr(self, "redis", None) is not None:
            self.redis.close()
            self.redis = control.connect(url)

    def assign(self, *, learner_id: str, data_shard: int | None = None, max_steps: int | None = None,
               slowdown: float | None = None, metrics_port: int | None = None) -> None:
        """A prepared standby process becomes learner ``learner_id`` (a restart that skips the
        interpreter, imports and model build). Its life and boot phases count from now."""
        self.options = replace(self.options, learner_id=learner_id,
                               **{k: v for k, v in (("data_shard", data_shard), ("max_steps", max_steps),
                                                    ("slowdown", slowdown), ("metrics_port", metrics_port))
                                  if v is not None})
        self.id = learner_id
        self.incarnation = secrets.token_hex(4)   # a forked copy of a standby is a life of its own
        self.log = get_logger("learner", learner=self.id, run=self.endpoints.run_id)
        self.stream = data_stream(self.options, self.id)
        standby_s = round(time.time() - self._process_started_at, 3)
        self._started_at = self._process_started_at = time.time()
        self.stats.boot_phases = {"standby": standby_s, "init": 0.0, "prepared": 0.0}

    def _join_control(self) -> None:
        self.prepare()
        # a restarted learner resumes its data stream (read before the heartbeat first writes it)
        self.data_position = control.data_position(self.redis, self.keys, self.id)
        self._previous_life = self.redis.hmget(self.keys.learner(self.id), "incarnation", "status", "updated_at")
        self._global_tokens = (run_count.read_total(self.redis, self.keys), 0)  # (run's count, our tokens then)
        self._count_behind = False
        n = len(self.plan)
        self.base_version = np.full(n, -1, dtype=np.int64)
        self.base_epoch = np.full(n, -1, dtype=np.int64)    # life of the owning shard the base came from
        self.base_values: list[torch.Tensor | None] = [None] * n
        self.c_steps = np.zeros(n, dtype=np.int64)
        self.c_tokens = np.zeros(n, dtype=np.int64)
        self._pending_open: dict[int, RoundOpened] = {}
        self._contributed: dict[int, Contribution] = {}
        self._answered: set[tuple[int, int, int, int]] = set()
        self._fetch_asked: dict[int, tuple[int, int, float]] = {}
        self._ahead: dict[int, dict[tuple[int, int], FragmentArrived]] = {}
        """Per fragment: broadcast updates keyed by (epoch, base) that arrived before their base."""
        self._check_shard_plan()

    def _redis_patient(self, step: Callable[[], None], what: str) -> None:
        """Run a joining step, riding out a Redis that is restarting (a learner started while
        Redis is down, by an operator or a supervisor, waits for it instead of exiting): retried
        every 0.2 s for up to ``REDIS_JOIN_PATIENCE_S``, then the error is raised."""
        deadline = time.monotonic() + REDIS_JOIN_PATIENCE_S
        warned = False
        while True:
            try:
                return step()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() > deadline or self.stop.is_set():
                    raise
                if not warned:
                    self.log.warning("learner.redis_unavailable", step=what, error=str(e),
                                     gives_up_after_s=REDIS_JOIN_PATIENCE_S)
                    warned = True
                self.stop.wait(0.2)

    def _announce_join(self) -> None:
        """Join as a new incarnation of this learner id. A previous incarnation that never left
        (killed, lost) is recorded as having left first, even when its heartbeat has not expired
        yet: a same-id restart reads as leave + join in membership events and reports."""
        prev, status, seen = self._previous_life
        pipe = self.redis.pipeline(transaction=False)
        if prev and status not in ("left", "stopped"):
            control.add_learner_event(pipe, self.keys, self.id, "leave", incarnation=prev, last_seen=seen or "",
                                      reason="replaced: the previous incarnation ended without leaving")
        control.add_learner_event(pipe, self.keys, self.id, "join", incarnation=self.incarnation)
        pipe.hset(self.keys.learner(self.id), mapping={"incarnation": self.incarnation, "status": self.status})
        pipe.execute()

    def _check_shard_plan(self) -> None:
        for k, h in control.shard_table(self.redis, self.keys).items():
            if h.get("plan") and h["plan"] != self.plan_digest:
                theirs = control.run_layout(self.redis, self.keys)
                detail = (describe_plan_difference(self.plan, theirs) if theirs is not None
                          else "the shard's tensor layout is not recorded")
                msg = (f"refused: model state layout {self.plan_digest} differs from shard {k}'s {h['plan']} "
                       f"(same task name, task config and P={self.algo.fragments}; {detail}: is the model code "
                       f"the same version on every machine?)")
                control.add_learner_event(self.redis, self.keys, self.id, "refuse", reason=msg)
                raise LearnerRefused(msg)

    def _load_current_fragments(self) -> None:
        """Before training: get the current version of every fragment from the shards."""
        need = set(range(len(self.plan)))
        deadline = time.monotonic() + self.options.join_timeout_s
        last_log = 0.0
        self._outbox.put(Fetch(tuple(sorted(need))))
        asked = arrived_at = time.monotonic()
        while need and not self.stop.is_set():
            now = time.monotonic()
            if now > deadline:
                raise JoinTimeout(f"shards served {len(self.plan) - len(need)}/{len(self.plan)} fragments "
                                  f"within {self.options.join_timeout_s}s (are the syncers running?)")
            if self._fatal is not None:
                raise RuntimeError(f"learner helper thread failed: {self._fatal!r}") from self._fatal
            if now - asked > 2.0 and now - arrived_at > 2.0:  # lost request or shard not up yet: ask again
                # (not while fragments keep arriving: a large model's replies take longer than 2 s)
                self._check_shard_plan()  # shards that registered since: refuse a layout mismatch now
                self._outbox.put(Fetch(tuple(sorted(need))))
                asked = now
            if now - last_log > 5.0:
                self.log.info("learner.join_waiting", have=len(self.plan) - len(need), of=len(self.plan))
                last_log = now
            try:
                item = self._inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, FragmentArrived):
                arrived_at = time.monotonic()
                self._apply(item, joining=True)
                if self.base_values[item.fragment] is not None:   # an update needs the full value first
                    need.discard(item.fragment)
            elif isinstance(item, RoundOpened):
                self._pending_open[item.fragment] = item

    # ------------------------------------------------------------------ training thread
    def run(self) -> LearnerSummary:
        """Join, train, leave; ``/metrics`` is served meanwhile when ``options.metrics_port`` asks.
        A rank other than 0 of a group follows rank 0 (``_follow``)."""
        if self.group is not None and not self.group.leader:
            return self._follow()
        self.metrics = metrics.start(role="learner", run_id=self.endpoints.run_id, member=lambda: self.id,
                                     read=self.readings, host=self.options.metrics_host,
                                     port=self.options.metrics_port, info={"device": self.options.device})
        if self.metrics is not None:
            self.log.info("learner.metrics", url=self.metrics.url)
        try:
            return self._run()
        finally:
            if self.metrics is not None:
                self.metrics.stop()
                self.metrics = None

    def readings(self) -> list[metrics.Reading]:
        """What ``/metrics`` shows, read on the scrape's thread (counters as they are: no lock)."""
        s = self.stats
        statuses = ("joining", "training", "blocked", "flushing", "stopped")
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
                            "fragment replaced them while they waited (the network thread fell behind).",
                            self._outbox.replaced),
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
                          "training), outbox (training to network).",
                          {"inbox": self._inbox.qsize(), "outbox": self._outbox.qsize()}, "queue"),
            metrics.gauge("learner_status", "1 for the learner's current status.",
                          {st: float(self.status == st) for st in statuses}, "status"),
        ]

    def _run(self) -> LearnerSummary:
        if self.group is None:
            self._redis_patient(self._join_control, "join")
        else:   # form the group first: a refusal or failure here must release the other ranks
            self.group.start(self._resolve_device())
            try:
                self._redis_patient(self._join_control, "join")
                self._sharding = resolve_sharding(self.options.group_sharding, self.device,
                                                  sum(p.numel() for p in self.model.parameters()))
            except BaseException as e:
                self.group.share({"abort": f"{type(e).__name__}: {e}"})
                self.group.close()
                raise
            self._lead_group()
        self._outbox.own_pipe()
        self.net = self.network_class(learner_id=self.id, endpoints=self.endpoints, codec=self.algo.uplink_codec,
                                      numels=[f.numel for f in self.plan], inbox=self._inbox, outbox=self._outbox,
                                      stats=self.stats, shard_endpoints=self._current_shard_endpoints,
                                      stop=self._threads_stop, peer_bind=self.options.peer_bind,
                                      advertise_host=self.options.advertise_host, log=self.log)
        threads = [threading.Thread(target=self._guarded, args=(self.net.run, "net"), name=f"{self.id}-net",
                                    daemon=True),
                   threading.Thread(target=self._control_loop, name=f"{self.id}-control", daemon=True)]
        for t in threads:
            t.start()
        try:
            self._redis_patient(self._announce_join, "announce")
            # a group starts from the shards: a peer's AdamW state would be rank 0's alone
            if not (self.options.peer_bootstrap and self.group is None and self._bootstrap_from_peer()):
                self._load_current_fragments()
                self.stats.bootstrap = "shards"
            if self.group is not None:      # every rank starts from the fragments rank 0 joined with
                # (none when stopped while joining: every rank still holds the seeded initial values)
                self.group.share_changed(self.plan, self.tensors,
                                         {p: v for p, v in enumerate(self.base_values) if v is not None})
                self._changed.clear()
            self.stats.boot_s = time.time() - self._process_started_at
            self.stats.cpu_s_at_joined = time.process_time()
            self.stats.boot_phases["joined"] = round(self.stats.boot_s, 3)
            self.joined_versions = {p: int(v) for p, v in enumerate(self.base_version)}
            self.log.info("learner.joined", fragments=len(self.plan), boot_s=round(self.stats.boot_s, 2),
                          malloc_tuned=self.malloc_tuned, host_staging=self._staging is not None,
                          boot_phases=self.stats.boot_phases,
                          versions_max=int(self.base_version.max()), config=self.run_cfg.to_dict())
            self._train()
        finally:
            self.status = "stopped"
            self._threads_stop.set()
            for t in threads:
                t.join(timeout=5.0)
            if not threads[0].is_alive():
                self._outbox.close()
            self._leave()
            if self.group is not None:
                self.group.close()
        return LearnerSummary(self.id, self.stats, {p: int(v) for p, v in enumerate(self.base_version)})

    def _train(self) -> None:
        ended = self._train_steps()
        if self.group is not None:
            self._group_trained()
            if self._deferring:      # rank 0 holds the whole model now and flushes alone
                self._deferring = False
                deferred, self._deferred = self._deferred, []
                for item in deferred:
                    self._apply(item)
        if ended:
            self._flush()
        self._drain_inbox()

    # ------------------------------------------------------------------ a torchrun group (learner/group.py)
    def _group_trained(self) -> None:
        """Every rank, after its last step: a sharded group gathers the whole model (a collective,
        at the same point on every rank), then each rank logs what it trained and cost."""
        g = self.group
        self._trained_rss_mb = rss_mb()
        if g.sharded:
            self.tensors = g.materialize(self.model)
        self.log.info("learner.group_trained", rank=g.rank, ranks=g.world, steps=self.stats.steps,
                      params_digest=params_digest(self.tensors), **self._rank_figures())

    def _rank_figures(self) -> dict[str, Any]:
        """What one rank of a group cost: its training time, peak RSS (MB), RSS at the end of
        training (before a sharded group gathers the whole model), and on CUDA the device's peak
        allocated memory (MB)."""
        out: dict[str, Any] = {"train_s": round(self.stats.train_s, 3), "peak_rss_mb": peak_rss_mb(),
                               "trained_rss_mb": self._trained_rss_mb, "sharding": self._sharding,
                               "fragments_shared": self.group.shared if self.group is not None else 0}
        if self.device.type == "cuda":
            out["peak_device_mb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        return out

    def _lead_group(self) -> None:
        """Rank 0, prepared: join the group and tell the other ranks what they cannot read
        themselves (the run config, data stream and position, the schedule's token count)."""
        g = self.group
        self._group_run_tokens = self.run_tokens()
        g.share({"run": self.run_cfg.to_dict(), "learner_id": self.id, "stream": self.stream,
                 "data_position": self.data_position, "run_tokens": self._group_run_tokens,
                 "sharding": self._sharding})
        self.log.info("learner.group", ranks=g.world, backend=g.backend, device=str(self.device),
                      sharding=self._sharding)

    def _follow(self) -> LearnerSummary:
        """A rank other than 0: no Redis, no sockets. Build the same model, take rank 0's
        fragments, then train in step with it; merged fragments arrive at step boundaries."""
        from common.config import run_config_from_dict
        g = self.group
        g.start(self._resolve_device())                # its type picks the backend, as on rank 0
        info = g.share()
        if "abort" in info:                            # rank 0 was refused or failed to join
            self.log.info("learner.group_aborted", rank=g.rank, reason=info["abort"])
            g.close()
            return LearnerSummary(self.id, self.stats)
        self.id = str(info["learner_id"])
        self.log = get_logger("learner", learner=self.id, run=self.endpoints.run_id, rank=g.rank)
        self._prepare(run_config_from_dict(info["run"]))
        self.stream = rank_stream(int(info["stream"]), g.rank)
        self.data_position = int(info["data_position"])
        self._group_run_tokens = float(info["run_tokens"])
        self._sharding = str(info["sharding"])
        n = len(self.plan)
        self.c_steps = np.zeros(n, dtype=np.int64)
        self.c_tokens = np.zeros(n, dtype=np.int64)
        g.share_changed(self.plan, self.tensors, {})
        try:
            self._train_steps()
            self._group_trained()
        finally:
            self.status = "stopped"
            g.close()
        return LearnerSummary(self.id, self.stats)

    def _train_steps(self) -> bool:
        """The inner loop; True when it ended on its own (step budget, data), not on ``stop``.
        In a group (torchrun) every rank runs it; rank 0 alone does the network work at each
        step boundary and the group then agrees on what happens next (``Group.boundary``)."""
        group = self.group
        leader = group is None or group.leader
        train_model = group.wrap(self.model, self.device, self._sharding) if group is not None else self.model
        if group is not None and group.sharded:   # the parameters are DTensors now: each rank's shard
            self.tensors = state_tensors(self.model)
            self._deferring = leader
            held = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in self.tensors.values())
            self.log.info("learner.group_sharded", rank=group.rank, holds=held,
                          of=sum(t.numel() for t in self.tensors.values()))
        opt, sched = make_inner_optimizer(self.model.parameters(), self.algo, tokens=self._step_run_tokens)
        if self._boot_optimizer is not None:  # a peer's AdamW state and place in the per-life ramp
            load_optimizer_state(opt, self._boot_optimizer)
            sched.last_epoch = self._boot_life_steps
            for g in opt.param_groups:
                g["lr"] = sched.lr_lambdas[0](sched.last_epoch) * g["initial_lr"]
            self.log.info("learner.bootstrapped_optimizer", optimizer_digest=optimizer_digest(opt.state_dict()),
                          life_steps=self._boot_life_steps)
            self._boot_optimizer = None
        self._opt, self._sched = opt, sched
        accum = self.algo.inner_grad_accum
        autocast = self._autocast()
        batches: Iterator[Any] = iter(self.task.batches(self.stream, self.run_cfg.task.seed, self.data_position))
        H = self.algo.sync_every_steps
        min_steps = H if self.algo.lockstep else 1
        self.status = "training"
        self.model.train()
        ready: list[Any] | None = None                      # the next step's batches (kept over a skip)
        ready_s = 0.0                                       # what reading them took (part of the step)
        while True:
            stop, done, skip = self.stop.is_set(), False, False
            t_iter = time.perf_counter()   # applying merges and snapshotting answers is training work
            if self.options.max_steps and self.stats.steps >= self.options.max_steps:
                done = True
            elif leader and not stop:
                if self._fatal is not None:
                    raise RuntimeError(f"learner helper thread failed: {self._fatal!r}") from self._fatal
                self._drain_inbox()
                self._answer_open_rounds(min_steps)
                if self.algo.lockstep and int(self.c_steps.max()) >= H:
                    self._wait_blocked(min_steps)
                    skip = True
            if ready is None and not (stop or done):
                t_read = time.perf_counter()
                ready = list(itertools.islice(batches, accum))
                ready_s = time.perf_counter() - t_read
                if len(ready) < accum:
                    self.log.info("learner.data_exhausted", steps=self.stats.steps)
                    done = True
            tokens = sum(count_tokens(self.task, b) for b in ready) if ready and not (stop or done or skip) else 0
            if group is not None:   # the group agrees: stop, budget, barrier, tokens, merged fragments
                # (also at the last boundary: merges drained this iteration reach every rank)
                want = self._wanted_whole(min_steps, answers=not (stop or done)) if self._deferring else ()
                b = group.boundary(fragments=len(self.plan), stop=stop, done=done, skip=skip, tokens=tokens,
                                   run_tokens=self.run_tokens() if leader else 0.0, changed=self._changed,
                                   gather=want)
                if b.gather:        # a sharded group's second phase (learner/group.py)
                    self._gathered = group.gather_fragments(self.plan, self.tensors, b.gather)
                    try:
                        if leader:   # the last boundary applies merges; the flush answers after it
                            self._apply_deferred(min_steps, answer=not (b.stop or b.done))
                    finally:
                        self._gathered = None
                    group.share_changed(self.plan, self.tensors, self._changed)
                else:
                    group.share_fragments(self.plan, self.tensors, self._changed, b.changed)
                self._changed.clear()
                stop, done, skip, tokens, self._group_run_tokens = b.stop, b.done, b.skip, b.tokens, b.run_tokens
            if stop or done:
                return done and not stop
            if skip:
                continue
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=self.device)
            for i, batch in enumerate(ready):                # ∇L over inner_grad_accum micro-batches
                self.stats.batches += 1
                # in a group, gradients are averaged over the ranks on the last micro-batch only
                sync = contextlib.nullcontext() if group is None or i == accum - 1 else group.no_sync(train_model)
                with sync:
                    with autocast:
                        loss = scalar_loss(self.task, train_model, batch_to(batch, self.device)) / accum
                    loss.backward()
                loss_sum = loss_sum + loss.detach().float()        # stays on the device: no sync
            ready = None
            self.stats.lr = apply_step(self.model, opt, sched, self.algo)   # θ ← AdamW(θ, ∇L(θ; batch))
            self.c_steps += 1                                # for every p: c_steps[p] += 1
            self.c_tokens += tokens                          #              c_tokens[p] += tokens (all ranks)
            self.stats.steps += 1
            self.stats.tokens += tokens
            compute_s = time.perf_counter() - t0 + ready_s
            target_s = max(compute_s * self.options.slowdown, self.options.step_time_floor_ms / 1000.0)
            if target_s > compute_s:                         # emulated slower chip / accelerator step time
                self.stop.wait(target_s - compute_s)
            ema = self.stats.step_ema_s
            now = time.perf_counter()
            iter_s = now - t_iter
            # a frozen iteration is no work: at most 3 × the estimate (before there is one, 3 × the step)
            worked_s = min(iter_s, 3 * (ema if ema > 0 else now - t0 + ready_s))
            self.stats.train_s += worked_s
            if self._serve_watch is not None:
                self._watch_serve_cost(iter_s)
            # the pace at which this learner reaches step boundaries: the step and the sync work
            # on this thread (merges applied, answers snapshotted), which the shards space rounds by
            self.stats.step_ema_s = step_time_estimate(ema, worked_s, self._timed_steps)
            if self._timed_steps < 2:   # the first two iterations' seconds: the first one is left out above
                self.stats.boot_phases[f"step{self._timed_steps + 1}_s"] = round(iter_s, 3)
            self._timed_steps += 1
            self._note_loss(loss_sum)

    def _step_run_tokens(self) -> float:
        """The global token count the learning-rate schedule reads: in a group, rank 0's count
        as of the last step boundary (the same on every rank), else the live one."""
        tokens = self._group_run_tokens if self.group is not None else self.run_tokens()
        self._note_schedule_tokens(tokens)
        return tokens

    def _note_schedule_tokens(self, tokens: float) -> None:
        """Record the count the schedule read (``schedule_tokens``: the highest); a read below it
        is a regression of the schedule: counted, logged when it starts and when it ends."""
        s = self.stats
        if tokens >= s.schedule_tokens:
            if self._schedule_dip is not None:
                reads, low = self._schedule_dip
                self.log.info("learner.schedule_caught_up", run_tokens=int(tokens), reads_behind=reads,
                              lowest_lr_ratio=round(low, 6))
                self._schedule_dip = None
            s.schedule_tokens = tokens
            return
        s.schedule_regressions += 1
        high = schedule_factor(self.algo, s.schedule_tokens)
        ratio = schedule_factor(self.algo, tokens) / high if high > 0 else 1.0
        if self._schedule_dip is None:
            self.log.warning("learner.schedule_went_back", run_tokens=int(tokens), highest=int(s.schedule_tokens),
                             lr_ratio=round(ratio, 6))
        reads, low = self._schedule_dip or (0, 1.0)
        self._schedule_dip = (reads + 1, min(low, ratio))

    def _note_loss(self, loss: torch.Tensor) -> None:
        """Loss EMA. On an accelerator the step's loss stays on the device and is read in batches
        of LOSS_READ_EVERY steps (one host sync each), so the training thread never waits for
        the device just to log; on a CPU it is read at once."""
        self._losses.append(loss)
        if loss.device.type != "cpu" and len(self._losses) < LOSS_READ_EVERY:
            return
        values = torch.stack(self._losses).tolist() if len(self._losses) > 1 else [float(self._losses[0])]
        self._losses.clear()
        for lv in values:
            self._loss_seen += 1
            self.stats.loss_ema = lv if self._loss_seen == 1 else 0.95 * self.stats.loss_ema + 0.05 * lv

    def run_tokens(self) -> float:
        """The run's global token count now: the last value read from Redis plus our tokens since."""
        seen, ours_then = self._global_tokens
        return seen + (self.stats.tokens - ours_then)

    def _autocast(self) -> Any:
        """bf16 autocast of the forward pass (``learner.autocast``), or a no-op context."""
        mode = self.options.autocast
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _flush(self) -> None:
        """After the last step: answer each fragment's next round once more so that no step this
        learner took is lost (the global model then holds every token of the budget). Ends when
        every fragment's steps were merged, on ``stop`` or after ``flush_timeout_s``."""
        if self.options.flush_timeout_s <= 0:
            return
        # a fragment's next round may be a whole period (H steps of the run) away
        timeout = max(self.options.flush_timeout_s, 3.0 * self.algo.sync_every_steps * self.stats.step_ema_s)
        self.status = "flushing"
        t0 = time.monotonic()
        deadline = t0 + timeout
        pending = lambda: int((self.c_steps > 0).sum())  # noqa: E731
        before = pending()
        while pending() and not self.stop.is_set() and time.monotonic() < deadline:
            if self._fatal is not None:
                raise RuntimeError(f"learner helper thread failed: {self._fatal!r}") from self._fatal
            try:
                self._handle(self._inbox.get(timeout=0.05))
            except queue.Empty:
                pass
            self._drain_inbox()
            self._answer_open_rounds(1)
        self.stats.unflushed = pending()
        self.stats.flushed = before - self.stats.unflushed
        self.stats.flush_s = time.monotonic() - t0
        log = self.log.info if not self.stats.unflushed else self.log.warning
        log("learner.flushed", fragments=self.stats.flushed, unflushed=self.stats.unflushed, flush_s=round(self.stats.flush_s, 3),
            timed_out=bool(self.stats.unflushed) and not self.stop.is_set())

    def _wait_blocked(self, min_steps: int) -> None:
        """Lock-step baseline only: wait at the barrier until the fragments are merged."""
        self.status = "blocked"
        t0 = time.perf_counter()
        try:
            item = self._inbox.get(timeout=0.05)
            self._handle(item)
        except queue.Empty:
            pass
        self._answer_open_rounds(min_steps)
        self.stats.blocked_s += time.perf_counter() - t0
        self.status = "training"

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: Any) -> None:
        if isinstance(item, PeerStateWanted):
            self._outbox.put(self._peer_snapshot(item))
            return
        if isinstance(item, PeerStateArrived):
            return  # a late reply: this learner already got its state elsewhere
        if isinstance(item, StateRequested):
            p = item.fragment
            if self.base_values[p] is not None:   # our base: the merged value at base_version
                self._outbox.put(Have(p, int(self.base_epoch[p]), int(self.base_version[p]), self.base_values[p]))
            return
        if isinstance(item, FragmentArrived):
            if self._deferring:       # rank 0 of a sharded group: applied at the step boundary
                self._deferred.append(item)
            else:
                self._apply(item)
        elif isinstance(item, RoundOpened):
            self._pending_open[item.fragment] = item
            p = item.fragment
            if item.epoch != self.base_epoch[p]:       # the shard restarted (maybe from an older
                self._request_fetch(p, item.epoch, item.version)  # checkpoint): adopt its state
            elif item.version > self.base_version[p]:  # missed a broadcast: repair
                self._request_fetch(p, item.epoch, item.version)

    # ------------------------------------------------------------------ peer bootstrap (§8)
    def _peer_snapshot(self, want: PeerStateWanted) -> PeerState:
        """At a step boundary (training thread): copies of what a joiner needs to continue like
        us: the merged bases and their versions (not our unmerged steps: those are ours to
        answer), AdamW state, our place in the per-life ramp. Serialised off this thread."""
        opt = self._opt
        sharded = self.group is not None and self.group.sharded   # AdamW state is spread over the ranks
        if opt is None or sharded or any(v is None for v in self.base_values) or self.status != "training":
            return PeerState(want.identity, want.requester, None)
        t0 = time.perf_counter()
        opt_state = opt.state_dict()
        opt_state = {"state": {i: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                   for k, v in st.items()} for i, st in opt_state["state"].items()},
                     "param_groups": opt_state["param_groups"]}
        state = {"format": 1, "peer": self.id, "plan": self.plan_digest,
                 "versions": [int(v) for v in self.base_version], "epochs": [int(e) for e in self.base_epoch],
                 "bases": list(self.base_values),  # merged values: replaced, never written in place
                 "optimizer": opt_state, "life_steps": int(self._sched.last_epoch), "steps": self.stats.steps}
        self.stats.bootstraps_served += 1
        self._serve_watch = {"to": want.requester, "ema_before": self.stats.step_ema_s, "iters": []}
        return PeerState(want.identity, want.requester, state, time.perf_counter() - t0)

    def _watch_serve_cost(self, iter_s: float, n: int = SERVE_COST_STEPS) -> None:
        """What serving a joiner cost our own training: the mean of the next ``n`` iterations
        (the one that took the snapshot included) against the step time before it."""
        w = self._serve_watch
        w["iters"].append(iter_s)
        if len(w["iters"]) < n:
            return
        self._serve_watch = None
        mean = sum(w["iters"]) / len(w["iters"])
        before = w["ema_before"]
        self.log.info("learner.bootstrap_serve_cost", to=w["to"], steps=n, mean_step_s=round(mean, 5),
                      step_before_s=round(before, 5), slowdown=round(mean / before - 1.0, 4) if before else None)

    def _bootstrap_from_peer(self) -> bool:
        """Take a training peer's state (bases at their versions, AdamW state, ramp position);
        False when there is no peer or none answers within ``peer_timeout_s`` (then the shards)."""
        import random
        try:
            live = control.live_learners(self.redis, self.keys)
        except redis.RedisError:
            return False
        here = socket.gethostname()
        loopback = ("tcp://127.", "tcp://localhost:", "ipc://", "inproc://")
        fresh = time.time() - 2 * self.options.heartbeat_interval_s - 0.5   # not a frozen one
        peers = sorted((lid, h["peer"]) for lid, h in live.items()
                       if lid != self.id and h.get("status") == "training" and h.get("peer")
                       and float(h.get("updated_at") or 0) >= fresh
                       and (h.get("host") == here or not h["peer"].startswith(loopback)))  # reachable from here
        if not peers:
            return False
        peer, endpoint = random.Random(self.incarnation).choice(peers)
        t0 = time.monotonic()
        self._outbox.put(AskPeer(peer, endpoint))
        stash: list[Any] = []
        arrived: PeerStateArrived | None = None
        def waited() -> float:   # since the request, or since the last part of the state arrived
            return time.monotonic() - max(t0, self.net.peer_progress_at)
        while arrived is None and not self.stop.is_set() and waited() < self.options.peer_timeout_s:
            try:
                item = self._inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(item, PeerStateArrived):
                arrived = item
            else:
                stash.append(item)
        ok = arrived is not None and arrived.state is not None and self._adopt_peer_state(arrived)
        if not ok:
            why = "no answer" if arrived is None else (arrived.error or "state refused")
            self.log.warning("learner.bootstrap_fallback", peer=peer, reason=why,
                             waited_s=round(time.monotonic() - t0, 3))
        for item in stash:  # what arrived meanwhile: newer merges, open rounds
            if isinstance(item, FragmentArrived):
                if ok:
                    self._apply(item)
            elif isinstance(item, RoundOpened):
                self._pending_open[item.fragment] = item
            else:
                self._handle(item)
        if ok:
            self.stats.bootstrap = f"peer {peer}"
            self.log.info("learner.bootstrapped", peer=peer, bytes=arrived.nbytes,
                          seconds=round(time.monotonic() - t0, 3), versions_max=int(self.base_version.max()),
                          optimizer_digest=optimizer_digest(self._boot_optimizer))
            self._fetch_behind()
        return ok

    def _adopt_peer_state(self, arrived: PeerStateArrived) -> bool:
        st = arrived.state
        try:
            if st.get("format") != 1 or st.get("plan") != self.plan_digest or len(st["bases"]) != len(self.plan):
                self.log.warning("learner.bootstrap_refused", peer=arrived.peer, reason="another model layout")
                return False
            values = [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in st["bases"]]
            if any(v.numel() != f.numel for v, f in zip(values, self.plan)):
                return False
            versions, epochs = list(st["versions"]), list(st["epochs"])
            opt_state, life = st["optimizer"], int(st["life_steps"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        for p, (frag, v) in enumerate(zip(self.plan, values)):
            scatter(self.tensors, frag, v)
            self.base_values[p] = v
            self.base_version[p] = int(versions[p])
            self.base_epoch[p] = int(epochs[p])
        self.c_steps[:] = 0
        self.c_tokens[:] = 0
        self._boot_optimizer, self._boot_life_steps = opt_state, life
        return True

    def _fetch_behind(self) -> None:
        """Fragments the run has merged past the peer's copy: ask their shards now."""
        try:
            recorded = control.fragment_versions(self.redis, self.keys, range(len(self.plan)))
        except redis.RedisError:
            return
        for p, v in recorded.items():
            if v is not None and v > self.base_version[p]:
                self._request_fetch(p, int(self.base_epoch[p]), v)

    def _request_fetch(self, p: int, epoch: int, version: int) -> None:
        """Ask the owning shard for fragment p; repeated only after FETCH_RETRY_S (lost request,
        shard moved to another endpoint)."""
        now = time.monotonic()
        asked = self._fetch_asked.get(p)
        if asked is not None and asked[0] == epoch and asked[1] >= version and now - asked[2] < FETCH_RETRY_S:
            return
        self._fetch_asked[p] = (epoch, version, now)
        self.stats.fetches += 1
        self._outbox.put(Fetch((p,)))

    def _apply(self, item: FragmentArrived, *, joining: bool = False) -> None:
        """Apply the merged Θ_p (§6): carry the unmerged steps, or overwrite / α-mix and reset counters.

        Epochs (lives of the owning shard) and versions only go up: a restarted shard continues
        from the freshest copy (ALGORITHM §8). A value from an older life is ignored; a new life
        at our version or above is a continuation (our unmerged steps are carried); one below our
        version moves us back: adopted so we stay in step with the shard, but counted and logged."""
        p = item.fragment
        if item.update_base >= 0:
            full = self._resolve_update(item)
            if full is None:
                return
            item = full
        known = self.base_values[p] is not None
        base_v = int(self.base_version[p])
        if known and item.epoch < self.base_epoch[p]:
            return                                    # a late message of a shard life that is gone
        same_epoch = item.epoch == self.base_epoch[p]
        if same_epoch and item.version <= base_v:
            return
        if same_epoch and not joining and not item.requested and item.version > base_v + 1:
            self.stats.version_gaps += 1              # a lost broadcast, repaired by this full value
        continuing = same_epoch or item.version >= base_v
        if known and not same_epoch:
            if item.version == base_v:                # the new life starts where we are: nothing of
                self._contributed.pop(p, None)        # what we answered since was merged
            if not continuing:
                self.stats.versions_regressed += 1
                self.log.warning("learner.version_regressed", fragment=p, version=item.version, ours=base_v,
                                 epoch=item.epoch)
        frag = self.plan[p]
        contributed = self._contributed.pop(p, None)
        if joining or not known:                      # the first value: adopt it
            value, self.c_steps[p], self.c_tokens[p] = item.values, 0, 0
        else:  # carry the steps not merged yet (not across a move back), or overwrite / α-mix
            carry = self.algo.carry_local_steps and continuing
            local = self._local_values(p) if carry or self.algo.mix_alpha > 0 else None
            merged, base = item.values, self.base_values[p]
            if self._staging is not None:   # on the GPU, where the local value and snapshot are
                merged = self._staging.to_device(merged)
                if carry and contributed is None:
                    base = self._staging.to_device(base)
            value, self.c_steps[p], self.c_tokens[p] = receive_merged(
                merged, local, base, contributed, int(self.c_steps[p]),
                int(self.c_tokens[p]), carry=carry, mix_alpha=self.algo.mix_alpha)
        if self._gathered is not None:    # a sharded group: the value reaches the shards after this
            self._gathered[p] = value
        else:
            scatter(self.tensors, frag, value)
        if self.group is not None:
            self._changed[p] = value
        self.base_values[p] = item.values
        self.base_version[p] = item.version
        self.base_epoch[p] = item.epoch
        if not joining:
            self.stats.merges_applied += 1
        if self._ahead.get(p):
            self._replay_ahead(p)

    def _resolve_update(self, item: FragmentArrived) -> FragmentArrived | None:
        """A broadcast update Θ_v − Θ_base (quantized downlink, ALGORITHM §7) → the full Θ_v, computed
        as the shard computed it (base + deq(update) in fp32: bit-identical). None when it does not
        apply now: old news; or an update ahead of our copy (we are joining, or missed one: a lost
        broadcast, a shard life whose full value we have not seen), kept to be replayed once the
        full value is here (broadcasts and fetch replies travel on different sockets, in no
        particular order), and the full value fetched unless a fetch is already on its way."""
        p = item.fragment
        known = self.base_values[p] is not None
        epoch, version = int(self.base_epoch[p]), int(self.base_version[p])
        if known and item.epoch == epoch and item.update_base == version:
            return replace(item, values=self.base_values[p] + item.values, update_base=-1)
        if known and (item.epoch < epoch or (item.epoch == epoch and item.version <= version)):
            return None
        ahead = self._ahead.setdefault(p, {})
        ahead[(item.epoch, item.update_base)] = item
        while len(ahead) > AHEAD_UPDATES:
            del ahead[min(ahead)]
        if known:
            self.stats.version_gaps += 1
            asked = self._fetch_asked.get(p)
            if asked is None or time.monotonic() - asked[2] >= FETCH_PENDING_S:
                self._request_fetch(p, item.epoch, item.version)
        return None

    def _replay_ahead(self, p: int) -> None:
        """The kept update built on the value just applied, if any (``_apply`` then comes back
        here for the next one: the chain is applied in order)."""
        ahead = self._ahead[p]
        epoch, version = int(self.base_epoch[p]), int(self.base_version[p])
        for key in [k for k in ahead if k[0] < epoch or (k[0] == epoch and k[1] < version)]:
            del ahead[key]                                    # older than our copy: no use any more
        item = ahead.pop((epoch, version), None)
        if item is not None:
            self.stats.updates_replayed += 1
            self._apply(item)

    def _local_values(self, p: int) -> torch.Tensor:
        """This learner's current value of fragment p (flat float32, never written in place
        afterwards): gathered from its tensors (on the CPU; on the GPU with host staging), or in a
        sharded group the value gathered or applied at this boundary (an fp32 value as applied,
        before any cast to a buffer's dtype)."""
        if self._gathered is not None:
            return self._gathered[p]
        if self._deferring:
            raise RuntimeError(f"fragment {p} read outside a step boundary of a sharded group")
        if self._staging is not None:
            return gather(self.tensors, self.plan[p], device=self.device)
        return gather(self.tensors, self.plan[p])

    def _wanted_whole(self, min_steps: int, *, answers: bool = True) -> list[int]:
        """Rank 0 of a sharded group, before a boundary: the fragments it will need whole there
        (merges to apply; with ``answers``, rounds it may answer)."""
        want = {item.fragment for item in self._deferred}
        if answers:
            want.update(p for p, o in self._pending_open.items() if self._answerable(p, o, min_steps))
        return sorted(want)

    def _answerable(self, p: int, o: RoundOpened, min_steps: int) -> bool:
        """Open round ``o`` of fragment p can be answered now: steps enough, a base of the open's
        epoch and version (an older base fetches first, a newer one means the round merged), and
        not answered yet."""
        return (self.c_steps[p] >= min_steps and self.base_values[p] is not None
                and o.epoch == self.base_epoch[p] and o.version == self.base_version[p]
                and (o.epoch, o.fragment, o.round, o.attempt) not in self._answered)

    def _apply_deferred(self, min_steps: int, *, answer: bool = True) -> None:
        """Rank 0 of a sharded group, at a boundary with the wanted fragments gathered: apply the
        merges that arrived, then (``answer``) answer the open rounds (after them, as without
        sharding)."""
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            self._apply(item)
        if answer:
            self._answer_open_rounds(min_steps)

    def _answer_open_rounds(self, min_steps: int) -> None:
        if self._deferring and self._gathered is None:
            return    # a sharded group answers at its step boundary (``_apply_deferred``)
        for p, o in list(self._pending_open.items()):
            if self.c_steps[p] < min_steps or self.base_values[p] is None or o.epoch != self.base_epoch[p]:
                continue
            if o.version < self.base_version[p]:
                del self._pending_open[p]
                self.stats.stale_opens += 1  # that round has merged already
                continue
            if (o.epoch, o.fragment, o.round, o.attempt) in self._answered:
                del self._pending_open[p]
                continue
            if not self._answerable(p, o, min_steps):
                continue  # our base is stale (a fetch is on its way): answering now would undo merges
            if self._gathered is not None and p not in self._gathered:
                continue  # a sharded group did not gather it at this boundary: answered at a later one
            del self._pending_open[p]
            key = (o.epoch, o.fragment, o.round, o.attempt)
            self._answered.add(key)
            snapshot = self._local_values(p)  # a copy; delta and quantization off-thread
            self._contributed[p] = Contribution(snapshot, int(self.c_steps[p]), int(self.c_tokens[p]))
            sent, ready = snapshot, None
            if self._staging is not None:     # to pinned host memory on a side stream: no wait here
                sent, ready = self._staging.to_host(snapshot)
            self._outbox.put(Answer(fragment=p, epoch=o.epoch, round=o.round, attempt=o.attempt,
                                    base=int(self.base_version[p]), base_values=self.base_values[p],
                                    snapshot=sent, steps=int(self.c_steps[p]), tokens=int(self.c_tokens[p]),
                                    ready=ready, final=self.status == "flushing"))
            self.stats.answers += 1
            if self.stats.answers == 1:
                self.stats.boot_phases["first_answer"] = round(time.time() - self._process_started_at, 3)
                self.stats.first_answer = f"{p}:{o.round}:{time.time():.3f}"   # fragment:round:when
            self.stats.last_contrib_fragment = p
            self.stats.last_contrib_at = time.time()
        if len(self._answered) > 100_000:
            self._answered.clear()

    # ------------------------------------------------------------------ helper threads
    def _guarded(self, body: Callable[[], None], name: str) -> None:
        """A helper thread that dies must not leave a zombie learner (live in Redis, never
        syncing): record the error; the training thread raises it at its next step."""
        try:
            body()
        except Exception as e:
            self.log.error("learner.thread_failed", thread=name, error=repr(e))
            self._fatal = e

    # ------------------------------------------------------------------ control thread
    def _current_shard_endpoints(self) -> tuple[int, dict[int, str]]:
        with self._endpoints_lock:
            return self._shard_endpoints

    def _control_loop(self) -> None:
        self._guarded(self._control_loop_body, "control")

    def _control_loop_body(self) -> None:
        redis_ok = True
        while not self._threads_stop.is_set():
            try:
                shards, eps = control.shard_endpoints(self.redis, self.keys)
                with self._endpoints_lock:
                    self._shard_endpoints = (shards, eps)
                pipe = self.redis.pipeline(transaction=False)
                control.beat(pipe, self.keys, self.id, self._counters(), self.options.heartbeat_ttl_s)
                ours = self.stats.tokens
                # epochs, fragment versions and the run's token count are the shards' to write (they
                # take our own count from our hash, a beat late): the total, with our tokens the shards
                # have not taken in yet; our view of it never goes back
                pipe.get(self.keys.tokens)
                pipe.hget(self.keys.token_shares, token_share(self.id, self.incarnation))
                res = pipe.execute()
                total = run_count.parse_total(res[-2])     # not a count (a member wrote it): this beat skipped
                share = run_count.parse_share(token_share(self.id, self.incarnation), res[-1] or 0) or 0
                if total is not None:
                    self._note_run_count(total + max(0, ours - share), ours)
                if not redis_ok:
                    self.log.info("learner.redis_back")
                redis_ok = True
            except redis.RedisError as e:
                if redis_ok:
                    self.log.warning("learner.redis_unavailable", error=str(e))
                redis_ok = False
            self._threads_stop.wait(self.options.heartbeat_interval_s)

    def _note_run_count(self, total: int, ours: int) -> None:
        """The run's count as read with ``ours`` tokens of our own: our view goes on from what it
        had counted while the total is below it (Redis restarted empty, the shares not all back:
        logged when that starts and ends)."""
        seen = run_count.advance_seen(self._global_tokens, total, ours)
        behind = total < seen[0]
        if behind != self._count_behind:
            self._count_behind = behind
            (self.log.warning if behind else self.log.info)(
                "learner.run_count_behind" if behind else "learner.run_count_whole", total=total, counted=seen[0])
        self._global_tokens = seen

    def _counters(self) -> dict[str, Any]:
        s = self.stats
        return {"status": self.status, "steps": s.steps, "tokens": s.tokens, "step_ema_s": round(s.step_ema_s, 6),
                "loss_ema": round(s.loss_ema, 5), "lr": s.lr, "answers": s.answers, "merges_applied": s.merges_applied,
                "version_gaps": s.version_gaps, "versions_regressed": s.versions_regressed, "stale_opens": s.stale_opens, "flushed": s.flushed,
                "unflushed": s.unflushed, "fetches": s.fetches, "malformed": s.malformed,
                "bytes_up": s.bytes_up, "bytes_down": s.bytes_down, "train_s": round(s.train_s, 3), "flush_s": round(s.flush_s, 3),
                "blocked_s": round(s.blocked_s, 3), "boot_s": round(s.boot_s, 3),
                "started_at": self._process_started_at, "boot_phases": json.dumps(s.boot_phases), "updated_at": time.time(), "incarnation": self.incarnation,
                "last_contrib_fragment": s.last_contrib_fragment, "first_answer": s.first_answer,
                "bootstrap": s.bootstrap, "bootstraps_served": s.bootstraps_served,
                "peer": "" if self._sharding == "fsdp" else getattr(getattr(self, "net", None), "peer_endpoint", ""),
                "last_contrib_at": s.last_contrib_at, "schedule_tokens": int(s.schedule_tokens),
                "schedule_regressions": s.schedule_regressions,
                "data_shard": self.options.data_shard, "data_stream": self.stream, "pid": os.getpid(), "host": socket.gethostname(),
                "data_position": self.data_position + s.batches, "answers_replaced": self._outbox.replaced,
                "bytes_fetched": s.bytes_fetched, "chunks_fetched": s.chunks_fetched,
                "peak_rss_mb": peak_rss_mb(), "cpu_s": round(time.process_time(), 3),
                "cpu_s_at_joined": round(s.cpu_s_at_joined, 3), "bad_entries": entries.BAD_ENTRIES.total()}

    def _leave(self) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            final = {**self._counters(), "stopped_at": time.time()}
            pipe.hset(self.keys.learner(self.id), mapping=final)
            pipe.hset(self.keys.life(self.id, self.incarnation), mapping=final)
            control.leave(pipe, self.keys, self.id)
            control.add_learner_event(pipe, self.keys, self.id, "leave", steps=self.stats.steps)
            pipe.execute()
        except (redis.RedisError, AttributeError):
            pass
        self.log.info("learner.stopped", steps=self.stats.steps, answers=self.stats.answers,
                      merges_applied=self.stats.merges_applied, version_gaps=self.stats.version_gaps,
                      answers_replaced=self._outbox.replaced, loss_ema=round(self.stats.loss_ema, 4))
