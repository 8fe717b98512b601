"""Joining a run (ALGORITHM §8): every check that can refuse a learner before it writes to Redis,
the join event, and loading the current fragments from the shards.

``Joining`` is a part of ``Learner`` (learner/core.py); its methods run on the thread that calls
``prepare``/``run`` (the training thread), before the network and control threads start, except
``_load_current_fragments``, which reads the network thread's messages from the inbox.
"""
from __future__ import annotations

import os
import queue
import secrets
import socket
import time
import zlib
from dataclasses import replace
from typing import Any, Callable

import redis
import torch

from common import control, positions, tokens as run_count
from common.config import ConfigError, LearnerOptions, RunConfig
from common.fragments import Fragment, describe_plan_difference, model_plan, plan_digest, state_tensors
from common.lean import resume_gc
from common.log import get_logger
from common.task import TaskError, TaskNotAllowed, bind_task, build_model, check_task, stray_tensors
from learner import ownership
from learner.inner import apply_step, make_inner_optimizer
from learner.messages import Fetch, FragmentArrived, RoundOpened
from learner.receipt import Receipt
from learner.staging import HostStaging, staging_for
from learner.stats import mark_boot

REDIS_JOIN_PATIENCE_S = 30.0
"""How long a joining learner waits for an unreachable Redis (restarting) before it exits."""


class LearnerRefused(RuntimeError):
    """The run refused this learner (config or model layout differs); the message says why."""


class JoinTimeout(RuntimeError):
    """The shards did not serve the current fragments in time."""


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


def new_receipt(learner: Any) -> Receipt:
    """The receipt of a joining learner (every fragment unknown), owned by its training thread."""
    return ownership.owned(Receipt(len(learner.plan), carry=learner.algo.carry_local_steps,
                                   mix_alpha=learner.algo.mix_alpha, stats=learner._stats, log=learner.log),
                           "receipt")


class Joining:
    """Prepare, refuse or join; see the module docstring."""

    # ------------------------------------------------------------------ before any write
    def _prepare(self, run: RunConfig, *, shared: bool = False) -> None:
        """Bind the task to ``run``, build the model and its plan, dry-run one batch: every check
        that can refuse this learner, before it writes anything to Redis. ``shared``: ``run`` came
        from Redis (its task spec is imported only if this machine allows it)."""
        resume_gc()   # a started learner's own imports are done: the collector on (common/lean.py)
        self.task, self.run_cfg = bind_task(run, self.task, shared=shared)
        self.algo = self.run_cfg.algo
        self.device = self._resolve_device()
        self.model = self._build_model()
        self.tensors = state_tensors(self.model)
        self.plan: tuple[Fragment, ...] = model_plan(self.model, self.task.embedding_names, self.algo.fragments)
        self.plan_digest = plan_digest(self.plan)
        self._staging: HostStaging | None = staging_for(self.device, grouped=self.group is not None)
        if self._staging is not None:
            warmed = self._staging.warm(max(f.numel for f in self.plan), blocks=len(self.plan))
            if warmed is not None:
                self.log.warning("learner.pinned_warm_failed", reason=warmed[:200],
                                 detail="copies take pinned memory as they go (slower step boundaries)")
        self.stream = data_stream(self.options, self.id)
        check_task(self.task, self.model, seed=self.run_cfg.task.seed, stream=self.stream)
        mark_boot(self._stats.boot_phases, "prepared", self._process_started_at)

    def _build_model(self) -> torch.nn.Module:
        """The task's model on this learner's device. On a GPU it is built there (its values come
        from the shards at join; a 1 B-parameter model built on the host first cost 1.9 GB of peak
        RSS); a model whose construction needs the host (a CPU ``torch.Generator`` for its init,
        as the built-in tasks use) is built on the host and moved."""
        seed = self.run_cfg.task.seed
        model = None
        if self.device.type == "cuda":
            try:
                model = build_model(self.task, seed, device=self.device)
            except RuntimeError as e:   # e.g. a CPU generator's draw into a CUDA tensor
                self.log.info("learner.model_built_on_host", reason=str(e)[:200])
        if model is None:
            return build_model(self.task, seed).to(self.device)
        stray = stray_tensors(model, self.device)
        if stray:   # made on the host despite the context (skip_init, an explicit device=...): moved
            self.log.warning("learner.model_moved", tensors=len(stray), first=stray[:3], device=str(self.device),
                             detail="the task's model made these on another device; moved to the learner's")
            model = model.to(self.device)
        return model

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
        if self._run_arg is not None and getattr(self, "run_cfg", None) is None:
            self._prepare(self._run_arg)                     # refusals happen before any write
        r = control.connect(self.endpoints.redis_url)
        on_wait = lambda why: self.log.warning("learner.run_config_missing", detail=why,  # noqa: E731
                                               gives_up_after_s=self.options.join_timeout_s)
        if self._run_arg is not None:
            try:   # written by `up`, the shards or the operator: a learner writes no shared key
                control.check_run_config(r, self.keys, self.run_cfg, wait_s=self.options.join_timeout_s,
                                         stop=self.stop, redis_url=self.endpoints.redis_url, on_wait=on_wait)
            except control.ConfigMismatch as e:
                control.add_learner_event(r, self.keys, self.id, "refuse", reason=str(e))
                raise LearnerRefused(str(e)) from None
        else:
            run = control.fetch_run_config(r, self.keys, wait_s=self.options.join_timeout_s, stop=self.stop,
                                           redis_url=self.endpoints.redis_url, on_wait=on_wait)
            try:
                self._prepare(run, shared=True)
            except TaskNotAllowed:  # the run names a task this machine does not import: exit 2
                raise
            except TaskError as e:  # this machine's task differs from the run's
                control.add_learner_event(r, self.keys, self.id, "refuse", reason=str(e))
                raise LearnerRefused(f"refused: {e}") from None
        self.redis = r   # set last: a Redis error above leaves prepare() to be retried whole

    # ------------------------------------------------------------------ a standby process
    def warm_up(self) -> None:
        """A standby process: pay the lazy first-use costs now (the first AdamW step and its
        allocations, the metrics endpoint's imports), not after a failure. (Not done by every learner
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
        self._stats.boot_phases = {"standby": standby_s, "init": 0.0, "prepared": 0.0}

    # ------------------------------------------------------------------ joining
    def _join_control(self) -> None:
        self.prepare()
        # a restarted learner resumes its data stream (read before the heartbeat first writes it)
        self.data_position = positions.resume_at(self.redis, self.keys, self.id)
        self._previous_life = self.redis.hmget(self.keys.learner(self.id), "incarnation", "status", "updated_at")
        self._run_count_at_join = run_count.read_total(self.redis, self.keys)
        self.receipt = new_receipt(self)
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
            self._check_helpers()
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
                if self.receipt.known(item.fragment):   # an update needs the full value first
                    need.discard(item.fragment)
            elif isinstance(item, RoundOpened):
                self.receipt.keep_open(item)

