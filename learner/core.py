"""The learner: AdamW inner steps that never wait on the network (ALGORITHM §3, §6).

Three threads, each the only one to touch its own state:
- the training thread (the caller of ``Learner.run``) owns the model, the optimizer, the
  ``Receipt`` of merged fragments (learner/receipt.py), ``LearnerStats`` and ``status``; it runs
  the inner loop and, at the step boundary only (``_sync_at_boundary``), applies merged
  fragments and snapshots fragments to answer open rounds. It publishes ``LearnerView`` (status,
  a copy of its counters) and ``Bases`` (a copy of the bases) at every step boundary and change
  of status: what the other threads and ``/metrics`` read;
- the network thread (learner/network.py) owns every ZeroMQ socket and its own counters;
- the control thread (learner/heartbeat.py) batches heartbeat and counters to Redis in one
  pipeline per interval and publishes the shards' endpoints and the run's token count.
Hand-over between them is by queues of typed messages (learner/messages.py) and values replaced
whole; the training thread never does I/O. A helper thread that fails puts its error on
``_failures``; the training thread raises it. Shared by design, thread-safe by construction: the
queues, the ``Outbox`` (its own lock), the Redis client (a connection pool), the ``stop`` events.
Attributes set before the helper threads start (id, options, plan, stream, incarnation) are
not changed afterwards. learner/ownership.py checks all this in tests.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import redis
import torch

from common import control, metrics
from common.config import Endpoints, LearnerOptions, RunConfig
from common.keys import Keys
from common.lifecycle import process_start_time, tune_allocator
from common.thread_cpu import threads_cpu_s
from common.log import get_logger
from common.task import Task, batch_to, count_tokens, scalar_loss
from learner import ownership
from learner.batch_log import BatchLog
from learner.bootstrap import PeerBootstrap
from learner.exchange import Exchange
from learner.group import Group, group_from_env, resolve_sharding
from learner.group_member import GroupMember
from learner.heartbeat import Heartbeat
from learner.inner import apply_step, load_optimizer_state, make_inner_optimizer
from learner.join import (JoinTimeout, Joining, LearnerRefused, data_stream, resolve_device,  # noqa: F401
                          resolve_learner_id)
from learner.network import NetworkThread, optimizer_digest
from learner.outbox import Outbox
from learner.pace import StepPace
from learner.position_ahead import PositionAhead
from learner.published import Published
from learner.receipt import Bases, Receipt
from learner.stats import (STEP_TIME_WARMUP, LearnerStats, LearnerSummary, LearnerView,  # noqa: F401 (importable here)
                           mark_boot, step_time_estimate)


@dataclass
class _Loop:
    """The inner loop's own state (training thread)."""

    opt: torch.optim.Optimizer
    sched: Any
    batches: Iterator[Any]
    train_model: torch.nn.Module
    leader: bool
    min_steps: int
    batch_log: BatchLog
    ready: list[Any] | None = None          # the next step's batches (kept over a skip)
    ready_s: float = 0.0                    # what reading them took (part of the step)


class Learner(Published, Joining, PeerBootstrap, GroupMember, Exchange):
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
        self._stats = ownership.owned(LearnerStats(), "stats")
        self._net_stats = ownership.owned(LearnerStats(), "network stats")
        """The network thread's counters (it publishes ``NetworkReadings`` of them)."""
        self.log = get_logger("learner", learner=self.id, run=endpoints.run_id)
        self.data_position = 0
        """Batches consumed before this life (read from Redis at join); reported as data_position."""
        self._position: PositionAhead | None = None
        """Writes the data position before each step (training thread; closed when it leaves)."""
        self._status = "joining"
        self._view = LearnerView.of(self._status, ownership.unwrapped(self._stats), 0)
        self._bases: Bases | None = None
        self.receipt: Receipt | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = Outbox()
        self._failures: queue.SimpleQueue = queue.SimpleQueue()
        self._threads_stop = threading.Event()
        self._ended = False
        """The training ended on its own (budget or data done): its leave says so (lock-step stops waiting)."""
        self._started_at = time.time()
        self.joined_versions: dict[int, int] = {}
        self._process_started_at = process_start_time() or self._started_at
        mark_boot(self._stats.boot_phases, "init", self._process_started_at)
        self._opt: torch.optim.Optimizer | None = None
        self._sched: Any = None
        self._boot_optimizer: dict[str, Any] | None = None
        self._boot_life_steps = 0
        self.incarnation = secrets.token_hex(4)
        """This process's life under ``self.id``: a restart with the same id is a new incarnation."""
        self.metrics: metrics.MetricsServer | None = None
        self.heartbeat: Heartbeat | None = None
        self.pace: StepPace | None = None
        """The pace of the inner steps (made when training starts)."""
        self.net: NetworkThread | None = None
        ranks = group_from_env()
        self.group: Group | None = Group(*ranks) if ranks is not None else None
        """This process's rank of a torchrun learner (learner/group.py); None: a learner of one process."""
        self._init_group_member()

    # ------------------------------------------------------------------ run
    def run(self) -> LearnerSummary:
        """Join, train, leave; ``/metrics`` is served meanwhile when ``options.metrics_port`` asks.
        A rank other than 0 of a group follows rank 0 (``_follow``)."""
        ownership.claim(self._stats)
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

    def _run(self) -> LearnerSummary:
        self._join_group_or_alone()
        ownership.claim(self.receipt)
        self._outbox.own_pipe()
        threads = self._start_helpers()
        try:
            self._redis_patient(self._announce_join, "announce")
            self._bootstrap()
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
        return self._summary()

    def _join_group_or_alone(self) -> None:
        """Join's checks and reads; a group is formed first: a refusal or failure here must
        release the other ranks."""
        if self.group is None:
            self._redis_patient(self._join_control, "join")
            return
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

    def _start_helpers(self) -> list[threading.Thread]:
        """The network and control threads (each owns what it is given here from now on)."""
        self.heartbeat = Heartbeat(redis_client=self.redis, keys=self.keys, learner_id=self.id,
                                   incarnation=self.incarnation, ttl_s=self.options.heartbeat_ttl_s,
                                   interval_s=self.options.heartbeat_interval_s, counters=self._counters,
                                   tokens=lambda: self._view.stats.tokens,
                                   run_count_at_join=self._run_count_at_join, log=self.log)
        heartbeat = self.heartbeat
        self.net = self.network_class(learner_id=self.id, endpoints=self.endpoints, codec=self.algo.uplink_codec,
                                      numels=[f.numel for f in self.plan], inbox=self._inbox, outbox=self._outbox,
                                      stats=self._net_stats, shard_endpoints=lambda: heartbeat.shard_endpoints,
                                      stop=self._threads_stop, peer_bind=self.options.peer_bind,
                                      advertise_host=self.options.advertise_host, log=self.log)
        self.net.bases = lambda: self._bases
        if self._staging is not None:
            self.net.stage = self._staging.prefetch
        net_stats = self._net_stats

        def network() -> None:
            ownership.claim(net_stats)
            self.net.run()
        threads = [threading.Thread(target=self._guarded, args=(network, "net"), name=f"{self.id}-net", daemon=True),
                   threading.Thread(target=self._guarded, args=(lambda: heartbeat.run(self._threads_stop), "control"),
                                    name=f"{self.id}-control", daemon=True)]
        for t in threads:
            t.start()
        return threads

    def _bootstrap(self) -> None:
        """Every fragment's current value: from a training peer, else from the shards."""
        # a group starts from the shards: a peer's AdamW state would be rank 0's alone
        if not (self.options.peer_bootstrap and self.group is None and self._bootstrap_from_peer()):
            self._load_current_fragments()
            self._stats.bootstrap = "shards"
        rc = self.receipt
        if self.group is not None:      # every rank starts from the fragments rank 0 joined with
            # (none when stopped while joining: every rank still holds the seeded initial values)
            self.group.share_changed(self.plan, self.tensors,
                                     {p: v for p, v in enumerate(rc.base_values) if v is not None})
            self._changed.clear()
        self._stats.boot_s = time.time() - self._process_started_at
        self._stats.cpu_s_at_joined = time.process_time()
        if self.net is not None:
            self._stats.net_cpu_s_at_joined = _thread_cpu_s(self.net)
        self._stats.io_cpu_s_at_joined = threads_cpu_s() or 0.0
        mark_boot(self._stats.boot_phases, "joined", self._process_started_at)
        self.joined_versions = rc.versions()
        self._publish()
        self.log.info("learner.joined", fragments=len(self.plan), boot_s=round(self._stats.boot_s, 2),
                      malloc_tuned=self.malloc_tuned, host_staging=self._staging is not None,
                      boot_phases=self._stats.boot_phases, gc_on=gc.isenabled(), gc_frozen=gc.get_freeze_count(),
                      versions_max=int(rc.base_version.max()), config=self.run_cfg.to_dict())

    def _train(self) -> None:
        ended = self._train_steps()
        if self.group is not None:
            self._group_trained()
            if self._deferring:      # rank 0 holds the whole model now and flushes alone
                self._deferring = False
                deferred, self._deferred = self._deferred, []
                for item in deferred:
                    self._apply(item)
        self._ended = ended
        if ended:
            self._flush()
        self._drain_inbox()
        self._publish()

    # ------------------------------------------------------------------ the inner loop (ALGORITHM §3)
    def _train_steps(self) -> bool:
        """The inner loop; True when it ended on its own (step budget, data), not on ``stop``.
        In a group (torchrun) every rank runs it; rank 0 alone does the network work at each
        step boundary and the group then agrees on what happens next (``Group.boundary``)."""
        loop = self._start_loop()
        stats, rc = self._stats, self.receipt
        while True:
            t_iter = time.perf_counter()   # applying merges and snapshotting answers is training work
            # step boundary: merged fragments in (§6), answers out (§4), the group agrees
            stop, done, skip, tokens = self._boundary(loop)
            if stop or done:
                return done and not stop
            if skip:                       # lock-step: still at the barrier
                continue
            # θ ← AdamW(θ, ∇L(θ; next batch))
            t0 = time.perf_counter()
            loss = self._forward_backward(loop)
            stats.lr = apply_step(self.model, loop.opt, loop.sched, self.algo)
            # for every p: c_steps[p] += 1; c_tokens[p] += tokens in this batch (all ranks)
            rc.count_step(tokens)
            stats.steps += 1
            stats.tokens += tokens
            # emulated slower chip / accelerator step time; the pace the shards see; the loss EMA
            self._watch_serve_cost(self.pace.after_step(t_iter, t0 - loop.ready_s))
            loop.ready = None
            self.pace.note_loss(loss)
            self._publish()

    def _start_loop(self) -> _Loop:
        """The optimizer (a peer's AdamW state when there is one), the batches, the model to train."""
        group = self.group
        leader = group is None or group.leader
        train_model = group.wrap(self.model, self.device, self._sharding) if group is not None else self.model
        if group is not None and group.sharded:
            self._shard_for_training()
        self.pace = StepPace(stats=self._stats, options=self.options, algo=self.algo, log=self.log, stop=self.stop)
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
        batches = iter(self.task.batches(self.stream, self.run_cfg.task.seed, self.data_position))
        self.status = "training"
        self.model.train()
        # a torchrun learner's ranks read a stream each: the heartbeat records rank 0's position
        self._position = PositionAhead(self.options.position_writes, self.endpoints.redis_url,
                                       self.keys.learner(self.id), self.log) if group is None else None
        return _Loop(opt, sched, batches, train_model, leader,
                     min_steps=self.algo.sync_every_steps if self.algo.lockstep else 1,
                     batch_log=BatchLog(self.options.batch_log, self.stream))

    def _boundary(self, loop: _Loop) -> tuple[bool, bool, bool, int]:
        """Between two steps: (stop, done, skip, tokens of the next step)."""
        stop, done, skip = self.stop.is_set(), False, False
        if self.options.max_steps and self._stats.steps >= self.options.max_steps:
            done = True
        elif loop.leader and not stop:
            skip = self._sync_at_boundary(loop.min_steps)
        if loop.ready is None and not (stop or done):
            t_read = time.perf_counter()
            loop.ready = list(itertools.islice(loop.batches, self.algo.inner_grad_accum))
            loop.ready_s = time.perf_counter() - t_read
            if len(loop.ready) < self.algo.inner_grad_accum:
                self.log.info("learner.data_exhausted", steps=self._stats.steps)
                done = True
        ready = loop.ready
        tokens = sum(count_tokens(self.task, b) for b in ready) if ready and not (stop or done or skip) else 0
        if self.group is not None:
            stop, done, skip, tokens = self._group_boundary(stop=stop, done=done, skip=skip, tokens=tokens,
                                                            min_steps=loop.min_steps)
        return stop, done, skip, tokens

    def _sync_at_boundary(self, min_steps: int) -> bool:
        """The hook at the step boundary (rank 0): apply the merged fragments that arrived (§6),
        answer open rounds (§4); lock-step waits at its barrier. True: skip this step."""
        self._check_helpers()
        cpu_at = time.thread_time()
        self._drain_inbox()
        self._answer_open_rounds(min_steps)
        self._stats.boundary_cpu_s += time.thread_time() - cpu_at
        if self.algo.lockstep and int(self.receipt.c_steps.max()) >= self.algo.sync_every_steps:
            self._wait_blocked(min_steps)
            return True
        return False

    def _forward_backward(self, loop: _Loop) -> torch.Tensor:
        """∇L over ``inner_grad_accum`` micro-batches; the summed loss, left on the device."""
        loop.opt.zero_grad(set_to_none=True)
        accum = self.algo.inner_grad_accum
        autocast = self._autocast()
        loss_sum = torch.zeros((), device=self.device)
        if self._position is not None:   # these batches are taken: no later life of this id trains them
            self._position.write(self.data_position + self._stats.batches + len(loop.ready), self._stats.step_ema_s)
        for i, batch in enumerate(loop.ready):
            loop.batch_log.trained(self.data_position + self._stats.batches)
            self._stats.batches += 1
            # in a group, gradients are averaged over the ranks on the last micro-batch only
            sync = contextlib.nullcontext() if self.group is None or i == accum - 1 else \
                self.group.no_sync(loop.train_model)
            with sync:
                with autocast:
                    loss = scalar_loss(self.task, loop.train_model, batch_to(batch, self.device)) / accum
                loss.backward()
            loss_sum = loss_sum + loss.detach().float()        # stays on the device: no sync
        return loss_sum

    # ------------------------------------------------------------------ the schedule's token count
    def _step_run_tokens(self) -> float:
        """The global token count the learning-rate schedule reads: in a group, rank 0's count
        as of the last step boundary (the same on every rank), else the live one."""
        tokens = self._group_run_tokens if self.group is not None else self.run_tokens()
        self.pace.note_schedule_tokens(tokens)
        return tokens

    def run_tokens(self) -> float:
        """The run's global token count now: the last value the control thread published plus
        our tokens since (training thread)."""
        seen, ours_then = self.heartbeat.run_count if self.heartbeat is not None else (self._run_count_at_join, 0)
        return seen + (self._stats.tokens - ours_then)

    def _autocast(self) -> Any:
        """bf16 autocast of the forward pass (``learner.autocast``), or a no-op context."""
        mode = self.options.autocast
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    # ------------------------------------------------------------------ flush and lock-step
    def _flush(self) -> None:
        """After the last step: answer each fragment's next round once more so that no step this
        learner took is lost (the global model then holds every token of the budget). Ends when
        every fragment's steps were merged, on ``stop`` or after ``flush_timeout_s``."""
        if self.options.flush_timeout_s <= 0:
            return
        s, rc = self._stats, self.receipt
        # a fragment's next round may be a whole period (H steps of the run) away
        timeout = max(self.options.flush_timeout_s, 3.0 * self.algo.sync_every_steps * s.step_ema_s)
        self.status = "flushing"
        t0 = time.monotonic()
        deadline = t0 + timeout
        before = rc.unmerged()
        while rc.unmerged() and not self.stop.is_set() and time.monotonic() < deadline:
            self._check_helpers()
            try:
                self._handle(self._inbox.get(timeout=0.05))
            except queue.Empty:
                pass
            self._drain_inbox()
            self._answer_open_rounds(1)
            self._publish()
        s.unflushed = rc.unmerged()
        s.flushed = before - s.unflushed
        s.flush_s = time.monotonic() - t0
        log = self.log.info if not s.unflushed else self.log.warning
        log("learner.flushed", fragments=s.flushed, unflushed=s.unflushed, flush_s=round(s.flush_s, 3),
            timed_out=bool(s.unflushed) and not self.stop.is_set())

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
        self._stats.blocked_s += time.perf_counter() - t0
        self.status = "training"

    # ------------------------------------------------------------------ helper threads
    def _guarded(self, body: Callable[[], None], name: str) -> None:
        """A helper thread that dies must not leave a zombie learner (live in Redis, never
        syncing): its error goes to the training thread, which raises it at its next step."""
        try:
            body()
        except Exception as e:
            self.log.error("learner.thread_failed", thread=name, error=repr(e))
            self._failures.put(e)

    def _check_helpers(self) -> None:
        """Training thread: raise the error of a helper thread that failed."""
        try:
            failure = self._failures.get_nowait()
        except queue.Empty:
            return
        self._failures.put(failure)     # raised again wherever it is checked next
        raise RuntimeError(f"learner helper thread failed: {failure!r}") from failure

    def _leave(self) -> None:
        if self._position is not None:
            self._position.close()
        try:
            pipe = self.redis.pipeline(transaction=False)
            final = {**self._counters(), "stopped_at": time.time()}
            pipe.hset(self.keys.learner(self.id), mapping=final)
            pipe.hset(self.keys.life(self.id, self.incarnation), mapping=final)
            control.leave(pipe, self.keys, self.id, finished=self._ended)
            control.add_learner_event(pipe, self.keys, self.id, "leave", steps=self._stats.steps)
            pipe.execute()
        except (redis.RedisError, AttributeError):
            pass
        s = self.stats
        self.log.info("learner.stopped", steps=s.steps, answers=s.answers, merges_applied=s.merges_applied,
                      version_gaps=s.version_gaps, answers_replaced=self._outbox.replaced,
                      loss_ema=round(s.loss_ema, 4))


def _thread_cpu_s(net: Any) -> float:
    """The network thread's CPU seconds now, read from its own clock (its last published value
    where the platform has no per-thread clocks: up to one of its loops behind)."""
    ident = getattr(net, "thread_ident", None)
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, TypeError, OSError):
        return net.published.net_cpu_s
