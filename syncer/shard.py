"""A syncer shard: owns fragments p with p % S == k and runs their rounds (ALGORITHM §4-5).

The daemon is a thin I/O loop; every decision (which fragment to open, whether a round may
merge, how long the grace window is, the merge itself) is a pure function or a socket-free class
(``common.quorum``, ``common.merge``, ``syncer.schedule``)::

    with Shard(...) as shard:
        while not stop.is_set():
            shard.poll_once(20)

Where each part lives: set-up steps ``syncer/setup.py``; round scheduling ``syncer/schedule.py``
(pure) around ``Shard._advance_rounds``; answer intake ``syncer/intake.py``; merges
``syncer/merging.py``; recovery ``syncer/recovery.py``; checkpoints ``syncer/checkpoints.py``;
what it sends and serves ``syncer/serving.py``; Redis ``syncer/control_plane.py``; ``/metrics``
``syncer/readings.py``; the state they share ``syncer/state.py``.

Threads and ownership (STYLE "Shells"): every mutable attribute of a ``Shard`` is owned by its
loop thread, the thread that enters it and calls ``poll_once`` (and ``close``). Three other kinds
of thread exist, and none gets a reference to the shard's state:
- merge workers (``MERGE_WORKERS``) get a ``MergeInput`` message and return a ``MergeResult``;
  the fragment's ``NormClipper`` travels with the message and comes back with the result
  (``syncer/merging.py``); they call ``_wake``, which only writes a byte to the wake pair;
- the checkpoint writer gets a state dict and reports each outcome as a message the loop counts
  (``syncer/checkpoints.py``);
- the ``/metrics`` thread reads only the ``ShardSnapshot`` the loop publishes (``syncer/readings.py``).
"""
from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import redis
import zmq

from common import control, metrics
from common.config import Endpoints, RunConfig, SyncerOptions
from common.keys import Keys
from common.log import get_logger
from common.quorum import Decision, Ema
from common.security import Security
from common.task import Task
from syncer import janitor
from syncer.checkpoints import CheckpointMismatch, CheckpointOutcome, Checkpointing, LatestWriter
from syncer.control_plane import ControlPlane
from syncer.intake import Intake
from syncer.merging import Merging
from syncer.readings import SNAPSHOT_EVERY_S, Published, ShardSnapshot, readings_of, snapshot_of
from syncer.recovery import Recovering
from syncer.schedule import Learners, RoundSchedule, RoundStateLog
from syncer.serving import Serving
from syncer.setup import SetUp, initial_state
from syncer.state import (BEHIND_FACTOR, CONTROL_REFRESH_S, HOLDING, MERGE_WORKERS, RECOVERY_COPIES,
                          RECOVERY_QUIET_S, REQUEST_DEDUPE_S, Answer, FragmentState, OpenRound, Recovery,
                          ShardStats, step_time_of)

__all__ = ["Shard", "CheckpointMismatch", "LatestWriter", "initial_state", "Answer", "OpenRound", "FragmentState",
           "Recovery", "ShardStats", "BEHIND_FACTOR", "CONTROL_REFRESH_S", "HOLDING", "MERGE_WORKERS",
           "RECOVERY_COPIES", "RECOVERY_QUIET_S", "REQUEST_DEDUPE_S"]


class Shard(SetUp, ControlPlane, Intake, Merging, Recovering, Checkpointing, Serving):
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
        self._eval_loss = math.nan
        """The global model's last eval loss in Redis (`ddloco up` writes it), for /metrics."""
        self._init_learner_records()
        self._ctx: zmq.Context | None = None
        self._last_control = -1e9
        self._janitor = janitor.MemberKeys(self.keys) if options.shard == 0 else None
        self._last_tidy = -1e9
        self._redis_ok = True
        self._merges_since_ckpt = 0
        self._ckpt_versions: dict[int, int] = {}
        """Each fragment's version in the newest checkpoint (loaded, or handed to the writer; none: nothing on disk)."""
        self._ckpt_saved_versions: dict[int, int] = {}
        """Each fragment's version in the checkpoint on disk (loaded, or reported written)."""
        self._ckpt_at = clock()
        self._lease_lost = False
        self._ckpt_writer = LatestWriter(self._write_checkpoint, name=f"{self.id}-checkpoint")
        self._ckpt_outcomes: queue.SimpleQueue[CheckpointOutcome] = queue.SimpleQueue()
        """From the writer thread: each checkpoint's outcome and cost (counted by the loop)."""
        self._journal_versions: dict[int, int] = {}
        """Each fragment's version in the newest journal handed to its writer (or loaded)."""
        self._journal_writer = LatestWriter(self._write_journal, name=f"{self.id}-journal")
        self._ckpt_every = options.checkpoint_every_merges
        """The ``checkpoint_every_merges`` the loaded checkpoint was written under (``lone_limit``)."""
        self.grace_s = 0.0
        """The adaptive grace window of the last poll (seconds a round waits past its quorum)."""
        self.round_log = RoundStateLog(self.log.info)
        """Each open round's (decision, reason), logged on change (``syncer.round_state``)."""
        self.metrics: metrics.MetricsServer | None = None
        self._snapshots = Published(self._snapshot())
        """What ``/metrics`` reads: the loop's last ``ShardSnapshot``."""
        self._snapshot_at = -1e9
        self._behind_logged_at = -1e9
        self._served: dict[tuple[bytes, int], tuple[int, int, float]] = {}
        """(requester, fragment) -> (epoch, version, when) of the last full value sent to it."""
        self._merger: ThreadPoolExecutor | None = None
        """The merge workers: merges never block the socket loop."""
        self._scratch = threading.local()
        """Per merging thread: the buffers every merge on it reuses (``merging.scratch_buffers``)."""

    def _init_learner_records(self) -> None:
        """What the shard knows of the learners and the run's token count (from Redis and answers)."""
        self.live: dict[str, dict[str, str]] = {}
        self._step_s_seen: dict[str, float] = {}
        """Learner id -> its last step-time EMA seen in Redis (the claims bound)."""
        self._finished: set[str] = set()
        """Learners whose last answer was final (sent after their last step, ``wire.Message.final``)."""
        self._departed: set[str] = set()
        """Lock-step: learners no longer live whose entry says they left after their training ended
        (read with the live learners; from Redis, so a restarted shard knows them too; and kept in
        the checkpoint, for a restart whose Redis restarted empty as well)."""
        self._known_learners: set[str] | None = None
        """Lock-step: the learner ids Redis held when this shard first read it."""
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
        self.run_tokens = 0
        """The run's global token count as last seen in Redis."""
        self.token_shares: dict[str, int] = {}
        """Every learner process's share of that count as last seen (common/tokens.py): checkpointed,
        written back after Redis restarted empty (a learner that is gone cannot)."""
        self.data_positions: dict[str, int] = {}
        """Every learner id's data position as last read (common/positions.py): checkpointed,
        written back after Redis restarted empty (a learner that is down cannot)."""
        self._live_fields: set[str] = set()
        """Learner processes (``<id>:<incarnation>``) live at the previous control refresh."""

    # ---------------------------------------------------------------- set-up / tear-down
    def __enter__(self) -> "Shard":
        model = self._bind_run()
        self._claim_layout()
        self._take_lease()
        owned = self._build_fragments(model)
        self._restore()
        self._start_merger()
        self._open_sockets()
        self.started_at = self.clock()
        self.schedule = RoundSchedule(policy=self.policy, algo=self.run.algo, started_s=self.started_at,
                                      initial_step_time_s=self.options.initial_step_time_s,
                                      min_answers_wait_periods=self.options.min_answers_wait_periods,
                                      reopen_after_steps=self.options.reopen_after_steps)
        self._refresh_control(force=True)
        self._announce(owned)
        self._start_metrics()
        return self

    def _announce(self, owned: list[int]) -> None:
        control.add_event(self.redis, self.keys, "shard_start", shard=self.options.shard,
                          versions={p: f.version for p, f in self.frags.items()})
        self.log.info("syncer.started", fragments=owned, rpc=self.rpc_endpoint, config=self.run.to_dict(),
                      checkpoint=str(self.checkpoint_path) if self.checkpoint_path else "none",
                      versions={p: f.version for p, f in self.frags.items()})

    def _start_metrics(self) -> None:
        """``/metrics`` when asked for: its thread gets the snapshot box, not the shard."""
        self._snapshots.publish(self._snapshot())
        box = self._snapshots
        try:
            self.metrics = metrics.start(role="shard", run_id=self.endpoints.run_id, member=self.id,
                                         read=lambda: readings_of(box.latest()), host=self.options.metrics_host,
                                         port=self.options.metrics_port, info={"shards": str(self.options.shards)})
        except BaseException:
            self.close()
            raise
        if self.metrics is not None:
            self.log.info("syncer.metrics", url=self.metrics.url)

    def readings(self) -> list[metrics.Reading]:
        """What ``/metrics`` shows now (on the loop thread: from a fresh snapshot)."""
        return readings_of(self._snapshot())

    def _snapshot(self) -> ShardSnapshot:
        """On the loop: what ``/metrics`` shows now (copies, published to the metrics thread)."""
        return snapshot_of(self.stats, self.frags, grace_s=self.grace_s, live_learners=len(self.live),
                           eval_loss=self._eval_loss)

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
            # a last read of the learners: the final counts of those that left since the periodic
            # one (``up`` stops the shards right after its learners exit) go into the run's shares
            # and the checkpoint, so a resumed run's LR schedule does not start behind
            try:
                self._refresh_control(force=True)
            except control.LeaseHeld:
                return        # another process owns these fragments now: write nothing
            self._journal_writer.close()
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

    # ---------------------------------------------------------------- the loop
    def poll_once(self, timeout_ms: int = 20) -> None:
        """Read the sockets, apply finished merges, refresh Redis, advance recovery and rounds."""
        events = dict(self.poller.poll(timeout_ms))
        if self._wake_rx.fileno() in events:
            try:
                while self._wake_rx.recv(4096):
                    pass
            except OSError:   # drained (would block)
                pass
        if self.sub in events:
            self._drain(self.sub, self._on_update)
        if self.router in events:
            self._drain(self.router, self._on_request)
        self._finish_merges()
        self._count_checkpoints()
        now = self.clock()
        self._refresh_control(now=now)
        self._advance_recovery(now)
        self._advance_rounds(now)
        if now - self._snapshot_at >= SNAPSHOT_EVERY_S:
            self._snapshot_at = now
            self._snapshots.publish(self._snapshot())

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Callable[[list], None]) -> None:
        """Up to 256 waiting messages of ``sock`` to ``handle`` (the other socket gets its turn)."""
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            handle(frames)

    def _learners(self) -> Learners:
        """The live learners as the round schedule sees them."""
        return Learners(live=len(self.live), answering=sum(1 for h in self.live.values() if h.get("status") in HOLDING),
                        step_times_s=tuple(t for t in map(step_time_of, self.live.values()) if t is not None),
                        finishing=bool(self._finished & self.live.keys()),
                        departed=len(self._departed - self.live.keys()))

    def _xi_step(self, *, slowest: bool) -> float:
        return self.schedule.xi_step_s(self._learners(), slowest=slowest)

    def _advance_rounds(self, now: float) -> None:
        """Merge, re-send or keep each open round (``RoundSchedule.decide``, its state logged on
        change); then open the fragments that are due (``RoundSchedule.due``)."""
        learners = self._learners()
        grace = self.grace_s = self.schedule.grace_s(learners, xi_quorum_s=self.xi_quorum.value or 0.0,
                                                     xi_sync_s=self.xi_sync.value or 0.0)
        rounds = {p: f.round for p, f in self.frags.items() if f.round is not None}
        for call in self.schedule.decide(now, rounds, learners, grace_s=grace):
            self.round_log.observe(call)
            f = self.frags[call.fragment]
            if call.decision is Decision.MERGE:
                self._merge(f, now, call.reason, grace)
            elif call.reopen:
                f.round.attempt += 1
                self.stats.reopens += 1
                self._send_open(f, now)
        in_flight = [p for p, f in self.frags.items() if f.round is not None or f.merging is not None]
        last = {p: f.last_opened_at for p, f in self.frags.items() if f.last_opened_at is not None}
        ready = [p for p, f in self.frags.items() if f.recovery is None]
        for p in self.schedule.due(now, ready=ready, last_opened_s=last, in_flight=in_flight, owned=len(self.frags),
                                   learners=learners):
            f = self.frags[p]
            f.round = OpenRound(round_id=f.next_round, opened_at=now,
                                timed=any(h.get("status") in HOLDING for h in self.live.values()))
            f.next_round += 1
            f.last_opened_at = now
            self._send_open(f, now)
