"""A shard's set-up as named steps (``Shard.__enter__`` runs them in order): bind the run and its
task, claim the layout, take the lease, build the fragments, restore them (checkpoint, recovery),
start the merge workers, open the sockets.

Ownership: every step runs on the thread that enters the shard, the one that then runs its loop.
"""
from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

from common import control, tokens as run_count, wire
from common.config import RunConfig
from common.fragments import Fragment, gather, model_plan, owned_fragments, plan_digest, plan_layout, state_tensors
from common.links import keep_alive
from common.quorum import QuorumPolicy
from common.task import Task, TaskError, TaskNotAllowed, bind_task, build_model, count_tokens
from syncer.state import MERGE_WORKERS, FragmentState


def initial_state(run: RunConfig, task: Task) -> tuple[torch.nn.Module, tuple[Fragment, ...]]:
    """The initial model of the run (``task.model()`` under the run seed) and its fragment plan;
    FragmentationError when P does not fit the model."""
    model = build_model(task, run.task.seed)
    return model, model_plan(model, task.embedding_names, run.algo.fragments)


class SetUp:
    """The set-up steps of ``Shard`` (a mixin: the state they build is the shard's)."""

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


    def _bind_run(self) -> torch.nn.Module:
        """Connect to Redis with the run config: ours published (starting or joining with it), or
        the run's fetched (waiting up to 30 s for it); the initial model."""
        if self._run_arg is not None:
            model = self._prepare(self._run_arg)
            self.redis = control.connect(self.endpoints.redis_url)
            control.publish_run_config(self.redis, self.keys, self.run)
            return model
        self.redis = control.connect(self.endpoints.redis_url)
        try:
            return self._prepare(control.fetch_run_config(
                self.redis, self.keys, wait_s=30.0, redis_url=self.endpoints.redis_url,
                on_wait=lambda why: self.log.warning("syncer.run_config_missing", detail=why,
                                                     gives_up_after_s=30.0)), shared=True)
        except TaskNotAllowed:  # the run names a task this machine does not import: exit 2
            raise
        except TaskError as e:  # this machine's task differs from the run's
            raise control.ConfigMismatch(f"refused: {e}") from None

    def _claim_layout(self) -> None:
        """The run's shard count and fragment layout: recorded, or refused when they differ."""
        control.claim_shard_count(self.redis, self.keys, self.options.shards)
        control.record_layout(self.redis, self.keys, plan_layout(self.plan))

    def _take_lease(self) -> None:
        """This life of the shard (its epoch) and the lease of its fragments."""
        # the run-wide counter, above any epoch this shard's checkpoint or journal saw (Redis may
        # have restarted empty; live shards also put the counter back)
        self.epoch = control.take_epoch(self.redis, self.keys, max(self._checkpoint_epoch(), self._journal_epoch()))
        self.lease_holder = f"{socket.gethostname()}:{os.getpid()}:{self.epoch}"
        control.acquire_lease(self.redis, self.keys.shard_lease(self.options.shard), self.lease_holder,
                              ttl_s=self.options.lease_ttl_s, wait_s=self.options.lease_wait_s)

    def _build_fragments(self, model: torch.nn.Module) -> list[int]:
        """The round policy, and every owned fragment at the initial model's value; the owned indices."""
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
        return owned

    def _restore(self) -> None:
        """The checkpoint (unless ``--fresh``), then each fragment's recovery from the live learners;
        the run's token count put back when Redis lost it."""
        recorded = self._recorded_versions()
        loaded = False if self.options.fresh else self._load_checkpoint()
        journal = self._read_journal() if loaded else None
        self._journal_versions = dict(journal or {})
        self._start_recovery(recorded, loaded, journal)
        self._journal_now()   # this life's journal at once: never one of an earlier life with a newer checkpoint
        if self.token_shares:  # Redis may have restarted empty: the learners' LR schedule must not go back
            self.run_tokens = max(self.run_tokens, run_count.record(self.redis, self.keys, self.token_shares))

    def _start_merger(self) -> None:
        """The merge workers (merges never block the socket loop)."""
        if self.options.merge_threads > 0:
            torch.set_num_threads(self.options.merge_threads)
        self._merger = ThreadPoolExecutor(max_workers=MERGE_WORKERS, thread_name_prefix=f"{self.id}-merge")

    def _open_sockets(self) -> None:
        """SUB (answers, copies) and PUB (opens, merges) to the broker, the RPC ROUTER, the wake pair."""
        self._ctx = zmq.Context()
        if self.security is not None:
            self.security.start_zap(self._ctx)
        self._open_broker_sockets()
        self._open_router()
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.poller.register(self.router, zmq.POLLIN)
        # a finished merge wakes the loop (its broadcast and the next open do not wait out a poll)
        self._wake_rx, self._wake_tx = socket.socketpair()
        for end in (self._wake_rx, self._wake_tx):
            end.setblocking(False)
        self.poller.register(self._wake_rx.fileno(), zmq.POLLIN)

    def _open_broker_sockets(self) -> None:
        """SUB for its fragments' answers and copies, PUB for opens and merged fragments, both to the broker."""
        sec = self.security
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

    def _open_router(self) -> None:
        """The RPC ROUTER that serves full fragment values (bound; its endpoint is advertised in Redis)."""
        sec = self.security
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
