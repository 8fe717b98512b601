"""Per-process options (not part of the run hash): where a process finds the cluster
(``Endpoints``), and the knobs of a learner, a syncer shard and ``ddloco up``.

Frozen keyword-only dataclasses, a docstring per field (the command line's help is made from it,
``common.flags``), range checks in ``__post_init__``. ``common.config`` loads them from TOML.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from common.config_values import _check, check_value, endpoint_problem, redis_url_problem

@dataclass(frozen=True, kw_only=True)
class Endpoints:
    """Where a process finds the rest of the cluster: all a learner needs to join."""

    run_id: str = "demo"
    """Run identifier: namespaces every Redis key and every message."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis holding membership, counters and round state."""
    broker_pub: str = "tcp://127.0.0.1:5555"
    """Broker XSUB endpoint: publishers connect here."""
    broker_sub: str = "tcp://127.0.0.1:5556"
    """Broker XPUB endpoint: subscribers connect here."""
    keys_dir: str = ""
    """CurveZMQ keys made by ``ddloco keys`` (this member's secret, the run's allow list of public
    keys): every ZeroMQ socket is then authenticated and encrypted. Empty: no CURVE, which the
    command line allows only with ``--insecure`` (the Python API leaves it to the caller)."""

    def __post_init__(self) -> None:
        _check(bool(re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.run_id)),
               f"endpoints.run_id must be 1-64 characters of A-Z a-z 0-9 . _ -, got {self.run_id!r}")
        check_value("endpoints.redis_url", self.redis_url, redis_url_problem)
        check_value("endpoints.broker_pub", self.broker_pub, endpoint_problem)
        check_value("endpoints.broker_sub", self.broker_sub, endpoint_problem)


@dataclass(frozen=True, kw_only=True)
class LearnerOptions:
    """Per-learner knobs (not part of the run hash)."""

    learner_id: str = ""
    """Unique id; empty means <hostname>-<pid>."""
    data_shard: int = -1
    """Which stream of training batches (default: derived from the learner id) this learner reads; in a
    config file -1 means derived."""
    max_steps: int = 0
    """Stop after this many inner steps (0 = run until stopped)."""
    slowdown: float = 1.0
    """Emulate a slower chip: every step takes this factor longer (its compute, and the emulated
    accelerator step time ``step_time_floor_ms``)."""
    step_time_floor_ms: float = 0.0
    """Emulated accelerator step time: a step never takes less than this."""
    step_noise: float = 0.0
    """Relative noise of the emulated step time: each step's target is multiplied by
    max(0.2, 1 + step_noise · N(0, 1)) (0: none)."""
    threads: int = 1
    """torch intra-op threads of the `ddloco learner` daemon (share the cores between co-located
    learners); the Python API leaves torch's setting to the caller."""
    device: str = "auto"
    """Where the inner steps run: "auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1"..."""
    autocast: str = "auto"
    """Mixed precision of the forward pass: "auto" (bf16 autocast on CUDA, none on CPU), "bf16", "off"."""
    heartbeat_interval_s: float = 0.5
    """How often the learner refreshes its heartbeat and counters in Redis."""
    heartbeat_ttl_s: float = 2.5
    """A learner whose heartbeat is older than this is considered gone."""
    flush_timeout_s: float = 30.0
    """After its last step (--steps), answer every fragment once more so its last steps reach the
    global model; give up after this long or 3 rounds' time (3·H·step time), whichever is longer
    (0 = leave at once; a stopped learner never flushes)."""
    join_timeout_s: float = 120.0
    """Give up (exit non-zero) if the run's config does not appear in Redis, or the shards don't
    serve the current fragments, within this. A missing run config is warned about after 3 s and
    every 30 s (``learner.run_config_missing``, naming the runs that Redis holds)."""
    peer_bind: str = "tcp://127.0.0.1:0"
    """ROUTER endpoint serving this learner's state to joining peers (port 0: any free port)."""
    advertise_host: str = ""
    """Host other learners use to reach ``peer_bind`` (empty: the bound address)."""
    peer_bootstrap: bool = True
    """A joining learner takes parameters, AdamW state and schedule position from a training
    peer (ALGORITHM §8); it falls back to the shards when none answers."""
    peer_timeout_s: float = 2.0
    """A joining learner asks the shards instead when the peer's state stops coming for this
    long (no first answer, or no next chunk)."""
    metrics_port: int = -1
    """Serve Prometheus metrics at ``http://metrics_host:metrics_port/metrics`` while the learner
    runs (-1: no endpoint; 0: any free port, logged)."""
    metrics_host: str = "127.0.0.1"
    """Address of the metrics endpoint (0.0.0.0: every interface, e.g. in a container)."""
    group_sharding: str = "auto"
    """A torchrun learner (``--nproc N``): "ddp" (every rank holds the whole model), "fsdp"
    (parameters, gradients and AdamW moments sharded over the ranks) or "auto" (fsdp on a GPU
    whose memory 16 B per parameter would fill past 70 %, else ddp). Rank 0's choice holds."""
    position_writes: str = "auto"
    """When the learner records its data position: "step" (before each inner step takes its
    batches: a SIGKILLed learner's successor repeats none), "heartbeat" (with the heartbeat: it
    repeats those since the last one) or "auto" (every step while a write costs at most 2 % of a
    step, else with the heartbeat). A torchrun learner (``--nproc``) uses the heartbeat."""
    batch_log: str = ""
    """Append a line ``STREAM INDEX`` to this file for every training batch an inner step is taken
    on (each rank of a group its own stream): which batches of its data stream each process
    trained on, across restarts (one write per batch, O_APPEND; several processes may share the
    file). Empty: none."""

    def __post_init__(self) -> None:
        _check(self.peer_timeout_s > 0, "learner.peer_timeout_s must be > 0")
        _check(self.position_writes in ("auto", "step", "heartbeat"),
               f"learner.position_writes must be auto, step or heartbeat, got {self.position_writes!r}")
        _check(self.group_sharding in ("auto", "ddp", "fsdp"),
               f"learner.group_sharding must be auto, ddp or fsdp, got {self.group_sharding!r}")
        check_value("learner.peer_bind", self.peer_bind, endpoint_problem)
        _check(-1 <= self.metrics_port <= 65535, "learner.metrics_port must be -1 (none), 0 (any) or a port")
        _check(self.slowdown >= 1.0, "learner.slowdown must be >= 1")
        _check(self.step_time_floor_ms >= 0.0, "learner.step_time_floor_ms must be >= 0")
        _check(0.0 <= self.step_noise <= 1.0, "learner.step_noise must be in [0, 1]")
        _check(self.threads >= 1, "learner.threads must be >= 1")
        _check(bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device)),
               f"learner.device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        _check(self.max_steps >= 0, "learner.max_steps must be >= 0")
        _check(self.autocast in ("auto", "bf16", "off"), f"learner.autocast must be auto, bf16 or off, got {self.autocast!r}")
        _check(self.flush_timeout_s >= 0, "learner.flush_timeout_s must be >= 0")
        _check(self.data_shard >= -1, "learner.data_shard must be >= 0 (or -1: derived from the id)")
        _check(self.heartbeat_ttl_s > self.heartbeat_interval_s > 0,
               "learner.heartbeat_ttl_s must exceed learner.heartbeat_interval_s > 0")


@dataclass(frozen=True, kw_only=True)
class SyncerOptions:
    """Per-shard knobs (not part of the run hash)."""

    shard: int = 0
    """k: this shard owns fragments p with p % shards == k."""
    shards: int = 1
    """S: number of shards."""
    checkpoint_dir: str = "runs/checkpoints"
    """Directory of the shard's atomic checkpoint (empty: no checkpoints); a relative path is
    resolved against the working directory at start and logged absolute. On several hosts, give
    storage that follows the shard (a volume); a shard that starts without it recovers its
    fragments from the live learners (ALGORITHM §8)."""
    checkpoint_every_merges: int = 100
    """No fragment of this shard gets more than this many versions (merges) ahead of its checkpoint
    on disk: a write starts once one is this - 1 past the newest checkpoint (and always on
    SIGTERM), which leaves it one merge while the write lands. What a restart can lose when no
    learner holds a copy; a copy a learner holds is taken back (by a restarted shard that lost
    Redis too: a copy one learner alone holds, up to the version in the shard's journal +
    ``JOURNAL_SLACK``, ``syncer.checkpoints``; ALGORITHM §8). Each write holds every owned
    fragment's Θ and master (400 MB a shard at 10^8 parameters and 2 shards): 20 wrote every ~64 s
    at 10^8 on 2 cores, 6.7 % of a shard's CPU (docs/results/scale.md)."""
    checkpoint_interval_s: float = 300.0
    """Also checkpoint when this many seconds passed since the last one with any merge since
    (a slow run's fragments rarely move ``checkpoint_every_merges`` versions)."""
    rpc_bind: str = "tcp://127.0.0.1:0"
    """ROUTER endpoint serving full fragments on request (port 0 = pick a free one)."""
    advertise_host: str = ""
    """Host name learners use to reach rpc_bind (empty: the host in rpc_bind)."""
    initial_step_time_s: float = 0.2
    """Assumed learner step time before any learner has reported one."""
    reopen_after_steps: float = 4.0
    """Re-publish a round's open message after this many learner step times without quorum."""
    lease_ttl_s: float = 3.0
    """The shard's lease in Redis expires this long after its holder stopped renewing it."""
    lease_wait_s: float = 10.0
    """At start, wait this long for another holder's lease to expire before refusing to run."""
    recovery_timeout_s: float = 20.0
    """At start, wait this long for live learners' copies of fragments whose recorded version is
    newer than the checkpoint (or when there is none); a few seconds otherwise."""
    fresh: bool = False
    """Start over from the initial model (ignore the checkpoint and the learners' copies); versions
    still go up, so learners adopt it."""
    tokens_per_step_max: int = 0
    """Robust merge: the most tokens an answer may claim per inner step (0: twice the task's
    first batch × inner_grad_accum)."""
    max_steps_factor: int = 8
    """Robust merge: an answer weighs as at most this × H × (versions since its base + 1) steps."""
    min_answers: int = 4
    """Robust merge: a round merges only once min(this, learners answering) members answered (for
    up to ``min_answers_wait_periods`` round periods; then the quorum K), so no one member fills
    a quorum and a hostile one weighs at most a quarter of a round. 1: the quorum K alone."""
    min_answers_wait_periods: float = 2.0
    """How long (× H × the slowest learner's step time) a round waits for ``min_answers``."""
    downtime_gap_s: float = 5.0
    """(reporting) a gap between merges longer than this counts as global downtime."""
    metrics_port: int = -1
    """Serve Prometheus metrics at ``http://metrics_host:metrics_port/metrics`` (-1: no endpoint;
    0: any free port, logged)."""
    metrics_host: str = "127.0.0.1"
    """Address of the metrics endpoint (0.0.0.0: every interface, e.g. in a container)."""
    merge_threads: int = 0
    """Torch threads of the shard process, where merges run on a worker thread off the socket
    loop (0: torch's setting, which ``ddloco up`` sets to 1 per process)."""
    reply_chunk_values: int = 1 << 20
    """A fragment requested in full (join, repair) larger than this many values is sent in
    chunks of this size (4 MiB of fp32), each its own message the requester assembles (0: whole)."""

    def __post_init__(self) -> None:
        _check(-1 <= self.metrics_port <= 65535, "syncer.metrics_port must be -1 (none), 0 (any) or a port")
        _check(self.merge_threads >= 0, "syncer.merge_threads must be >= 0")
        _check(self.reply_chunk_values >= 0, "syncer.reply_chunk_values must be >= 0")
        _check(self.shards >= 1, "syncer.shards must be >= 1")
        check_value("syncer.rpc_bind", self.rpc_bind, endpoint_problem)
        _check(0 <= self.shard < self.shards, "syncer.shard must be in [0, shards)")
        _check(self.checkpoint_every_merges >= 1, "syncer.checkpoint_every_merges must be >= 1")
        _check(self.checkpoint_interval_s > 0, "syncer.checkpoint_interval_s must be > 0")
        _check(self.tokens_per_step_max >= 0, "syncer.tokens_per_step_max must be >= 0")
        _check(self.max_steps_factor >= 1, "syncer.max_steps_factor must be >= 1")
        _check(self.min_answers >= 1, "syncer.min_answers must be >= 1")
        _check(self.min_answers_wait_periods > 0, "syncer.min_answers_wait_periods must be > 0")
        _check(self.initial_step_time_s > 0, "syncer.initial_step_time_s must be > 0")


@dataclass(frozen=True, kw_only=True)
class UpOptions:
    """`ddloco up`: a whole local cluster."""

    learners: int = 4
    """M: learner processes."""
    syncers: int = 2
    """S: syncer shard processes."""
    steps: int = 400
    """Inner steps per learner (0 = until --minutes)."""
    minutes: float = 4.0
    """Wall-clock cap of the run."""
    report_dir: str = ""
    """Write report.json and plots here (empty: no report)."""
    eval_every_s: float = 8.0
    """Evaluate the global model this often during the run."""
    replace_hung_s: float = 5.0
    """A learner process that is alive but whose heartbeat is older than this (frozen: a hung
    device, SIGSTOP) while the other learners' are fresh is killed and replaced (0: never)."""
    learner_threads: int = 0
    """Torch threads of each learner (0: this machine's cores shared among the learners). Fewer
    leave cores to the shards, the broker and the learners' network threads on one machine."""

    def __post_init__(self) -> None:
        _check(self.replace_hung_s >= 0, "up.replace_hung_s must be >= 0")
        _check(self.learner_threads >= 0, "up.learner_threads must be >= 0 (0: the cores shared among the learners)")
        _check(self.learners >= 1, "up.learners must be >= 1")
        _check(self.syncers >= 1, "up.syncers must be >= 1")
        _check(self.steps >= 0, "up.steps must be >= 0")
        _check(self.minutes > 0, "up.minutes must be > 0")
        _check(self.eval_every_s >= 0, "up.eval_every_s must be >= 0 (0: at every tick of the control loop)")
