"""What `ddloco slurm submit` asks of Slurm: the run directory's layout and the batch scripts.

Pure: a ``SlurmPlan`` (the submit flags) renders three batch scripts; nothing here runs a
command. The run directory lives on storage every node sees (a shared home or scratch):

    RUN_DIR/plan.json          the plan, and the job ids once submitted
    RUN_DIR/keys/              CurveZMQ keys and Redis passwords (0700; secrets 0600): DDLOCO_KEYS
    RUN_DIR/redis/             the services job's Redis: its config (0600) and append-only file
    RUN_DIR/checkpoints/       the shards' checkpoints (a requeued services job continues from them)
    RUN_DIR/endpoints.env      written by the services job once it started Redis, broker and shards
    RUN_DIR/slurm-events.jsonl each learner job's start and end (job, array task, restart count)
    RUN_DIR/logs/              every job's and daemon's log
    RUN_DIR/jobs/*.sbatch      the scripts below

Jobs: **services** (Redis, broker, syncers: one job on a CPU partition, ``ddloco.slurm.services``
supervising them), **learners** (a job array: task i is learner ``learner-i`` with data shard i,
``--requeue``: a preempted task, or one on a failed node, comes back under the same id; one whose
learner fails (exit 1) requeues itself, at most ``FAILED_REQUEUES_MAX`` times), **scavengers** (an
array on a low-priority partition that others' jobs preempt; ids ``scav-i``).
"""
from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.files import write_atomic

LEARNER_PREFIX = "learner-"
SCAVENGER_PREFIX = "scav-"
SCAVENGER_DATA_SHARD_BASE = 1000
"""A scavenger's data stream is shard 1000 + its index: never one a learner of the array reads."""


@dataclass
class SlurmPlan:
    """The flags of `ddloco slurm submit` (docs/commands.md); saved as RUN_DIR/plan.json."""

    run_dir: str
    run_id: str
    learners: int = 2
    scavengers: int = 0
    shards: int = 2
    task: str = "gpt"
    task_args: list[str] = field(default_factory=list)
    services_partition: str = ""
    services_nodelist: str = ""
    """Pins the services job to these nodes: a requeued services job comes back where the
    learners' URLs point."""
    learner_partition: str = ""
    scavenge_partition: str = ""
    scavenge_qos: str = ""
    services_cpus: int = 2
    learner_cpus: int = 2
    gpus_per_learner: int = 0
    time_limit: str = ""
    account: str = ""
    python: str = ""
    setup: str = ""
    """Shell lines each job runs first (``module load ...``, ``source venv/bin/activate``)."""
    redis_port: int = 6379
    broker_port: int = 5555
    """The broker binds this port (publishers) and the next (subscribers)."""
    shard_port: int = 7000
    """Shard k's RPC binds shard_port + k."""
    peer_port: int = 7100
    """A learner serves joining peers on peer_port + its array index (scavengers: + 500)."""
    learner_flags: list[str] = field(default_factory=list)
    """Extra `ddloco learner` flags (e.g. --step-time-floor-ms 50)."""
    job_ids: dict[str, list[str]] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        return Path(self.run_dir)

    def save(self) -> None:
        write_atomic(self.root / "plan.json", json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: str | Path) -> "SlurmPlan":
        path = Path(run_dir) / "plan.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise SystemExit(f"error: {path} not found: not a run directory of `ddloco slurm submit`") from None


def learner_ids(prefix: str, count: int, start: int = 0) -> list[str]:
    return [f"{prefix}{i}" for i in range(start, start + count)]


def _sbatch_header(plan: SlurmPlan, *, name: str, partition: str, cpus: int, log: str,
                   extra: list[str] = ()) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name=ddloco-{plan.run_id}-{name}", f"#SBATCH --output={log}",
             f"#SBATCH --cpus-per-task={cpus}", "#SBATCH --ntasks=1"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if plan.time_limit:
        lines.append(f"#SBATCH --time={plan.time_limit}")
    if plan.account:
        lines.append(f"#SBATCH --account={plan.account}")
    lines += [f"#SBATCH {x}" for x in extra]
    lines.append("umask 077")
    if plan.setup:   # before `set -u` (module systems and conda activate read unset variables)
        lines += ["{", plan.setup, "} || { echo \"--setup failed\" >&2; exit 1; }"]
    lines += ["set -uo pipefail", f"RUN_DIR={shlex.quote(str(plan.root))}",
              f"PY={shlex.quote(plan.python) if plan.python else '$(command -v python3)'}",
              "export DDLOCO_KEYS=\"$RUN_DIR/keys\" OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1} PYTHONUNBUFFERED=1"]
    return lines


def services_script(plan: SlurmPlan) -> str:
    """Redis, the broker and the shards as one job, supervised by ``ddloco.slurm.services``
    (restarts a crashed daemon; on SIGTERM the shards checkpoint). Requeued, it continues from
    the append-only Redis file and the shards' checkpoints."""
    pin = [f"--nodelist={plan.services_nodelist}"] if plan.services_nodelist else []
    lines = _sbatch_header(plan, name="services", partition=plan.services_partition, cpus=plan.services_cpus,
                           log=f"{plan.root}/logs/services-%j.log", extra=["--requeue", *pin])
    lines.append('exec "$PY" -m ddloco.slurm.services --run-dir "$RUN_DIR"')
    return "\n".join(lines) + "\n"


FAILED_REQUEUES_MAX = 3
"""A learner task that fails (exit 1: a runtime failure, not a refusal or bad flags) is requeued by
its own script at most this many times (Slurm's --requeue covers preemption and node failure)."""


def _learner_body(plan: SlurmPlan, *, prefix: str, shard_base: int, port_base: int) -> list[str]:
    ranks = max(1, plan.gpus_per_learner)
    nproc = ["--nproc", str(ranks)] if ranks > 1 else []
    device = ["--device", "cuda"] if plan.gpus_per_learner >= 1 else []
    flags = " ".join(shlex.quote(x) for x in [*nproc, *device, *plan.learner_flags])
    task = " ".join(shlex.quote(x) for x in ["--task", plan.task, *sum((["--task-arg", a] for a in plan.task_args), [])])
    return [
        "IDX=${SLURM_ARRAY_TASK_ID:-0}",
        f"LID={prefix}$IDX",
        "event() {  # one line per start and end of this task, read by `ddloco slurm report`",
        "  printf '{\"t\": %s, \"event\": \"%s\", \"learner\": \"%s\", \"job\": \"%s_%s\", \"restart\": %s, "
        "\"host\": \"%s\", \"rc\": %s}\\n' \"$(date +%s.%N)\" \"$1\" \"$LID\" \"${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}\" "
        "\"$IDX\" \"${SLURM_RESTART_COUNT:-0}\" \"$(hostname)\" \"${2:-null}\" >> \"$RUN_DIR/slurm-events.jsonl\"",
        "}",
        "# the services job writes endpoints.env once it started Redis, the broker and the shards, and this",
        "# learner's own Redis user (it writes only its own keys) to keys/secret/$LID.redis.env",
        "for _ in $(seq 1200); do [ -s \"$RUN_DIR/endpoints.env\" ] && [ -s \"$DDLOCO_KEYS/secret/$LID.redis.env\" ] && break; sleep 0.5; done",
        "[ -s \"$DDLOCO_KEYS/secret/$LID.redis.env\" ] || { echo \"no $DDLOCO_KEYS/secret/$LID.redis.env after 10 min: "
        "is the services job running?\" >&2; exit 1; }",
        "set -a; . \"$RUN_DIR/endpoints.env\"; . \"$DDLOCO_KEYS/secret/$LID.redis.env\"; set +a",
        "event start",
        "SIGNALLED=0",
        "trap 'SIGNALLED=1; event signalled' TERM",
        f"\"$PY\" -m ddloco learner --learner-id \"$LID\" --data-shard $(( {shard_base} + IDX )) --run-id \"$DDLOCO_RUN_ID\" "
        "--broker-pub \"$DDLOCO_BROKER_PUB\" --broker-sub \"$DDLOCO_BROKER_SUB\" "
        f"--peer-bind \"tcp://0.0.0.0:$(( {port_base} + IDX ))\" --advertise-host \"$(hostname)\" --log-format json "
        f"--threads $(( ${{SLURM_CPUS_PER_TASK:-{ranks}}} / {ranks} > 0 ? ${{SLURM_CPUS_PER_TASK:-{ranks}}} / {ranks} : 1 )) "
        f"{task} {flags} &",
        "PID=$!",
        "wait $PID; RC=$?",
        "while kill -0 $PID 2>/dev/null; do wait $PID; RC=$?; done   # a signal interrupted the first wait",
        "wait $PID 2>/dev/null; W=$?; [ $W -ne 127 ] && RC=$W        # its own status, once it has ended",
        "event end $RC",
        f"if [ \"$RC\" = 1 ] && [ $SIGNALLED = 0 ] && [ \"${{SLURM_RESTART_COUNT:-0}}\" -lt {FAILED_REQUEUES_MAX} ]; then",
        "  event requeue-after-failure $RC",
        "  scontrol requeue \"${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${IDX}\" 2>/dev/null || scontrol requeue \"$SLURM_JOB_ID\"",
        "fi",
        "exit $RC",
    ]


def learners_script(plan: SlurmPlan, *, count: int | None = None, start: int = 0) -> str:
    """The learner array: task i is ``learner-i`` (data shard i), requeued when preempted (and by
    its own script after a runtime failure)."""
    n = plan.learners if count is None else count
    gres = [f"--gres=gpu:{plan.gpus_per_learner}"] if plan.gpus_per_learner else []
    lines = _sbatch_header(plan, name="learners", partition=plan.learner_partition, cpus=plan.learner_cpus,
                           log=f"{plan.root}/logs/learner-%A_%a.log",
                           extra=[f"--array={start}-{start + n - 1}", "--requeue", *gres])
    lines += _learner_body(plan, prefix=LEARNER_PREFIX, shard_base=0, port_base=plan.peer_port)
    return "\n".join(lines) + "\n"


def scavengers_script(plan: SlurmPlan, *, count: int | None = None, start: int = 0) -> str:
    """Scavenging: an array on the low-priority partition (or QOS) that others' jobs preempt; a
    preempted task is requeued and joins again when the nodes are idle."""
    n = plan.scavengers if count is None else count
    extra = [f"--array={start}-{start + n - 1}", "--requeue"]
    if plan.scavenge_qos:
        extra.append(f"--qos={plan.scavenge_qos}")
    if plan.gpus_per_learner:
        extra.append(f"--gres=gpu:{plan.gpus_per_learner}")
    lines = _sbatch_header(plan, name="scavengers", partition=plan.scavenge_partition, cpus=plan.learner_cpus,
                           log=f"{plan.root}/logs/scavenger-%A_%a.log", extra=extra)
    lines += _learner_body(plan, prefix=SCAVENGER_PREFIX, shard_base=SCAVENGER_DATA_SHARD_BASE,
                           port_base=plan.peer_port + 500)
    return "\n".join(lines) + "\n"
