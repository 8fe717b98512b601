"""What `ddloco up` starts, decided from its options before anything starts: a pure plan.

``plan_up`` turns the ``[up]`` options and the command's flags into an ``UpPlan``: the learner
ids and their slots (data shard, slowdown, metrics port), every daemon's metrics port, the
threads per learner and the command line of each daemon. It touches no process, socket or file
(the ports come from the ``port`` callable), so it is unit tested with plain inputs. An ``UpPlan``
is immutable once made; the supervisor's threads call its argv methods.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True, kw_only=True)
class UpPlan:
    """The processes of one `up` run and how each one is started."""

    learner_ids: tuple[str, ...]
    """The run's learners: ``learner-0`` .. ``learner-{M-1}``, learner i reading data shard i."""
    extra_ids: tuple[str, ...]
    """``--extra``'s temporary learners: ``extra-0`` ..."""
    syncers: int
    """Syncer shards: ``shard0`` .. ``shard{S-1}``."""
    steps: int
    """Each learner's step budget (0: until the time cap)."""
    threads_per_learner: int
    """Torch threads of each learner: this machine's CPUs shared among the learners."""
    slots: Mapping[str, Mapping[str, Any]]
    """Learner id -> its slot: ``index`` (data shard), ``slowdown`` (or None), ``metrics_port``;
    a restarted learner, or the spare that replaces it, takes its slot again."""
    metrics_ports: Mapping[str, int]
    """Daemon name (broker, shardK, a learner or extra id) -> its /metrics port on 127.0.0.1."""
    common_args: tuple[str, ...]
    """The flags every daemon gets: its config file, JSON logs, ``--insecure``."""
    step_time_floor_ms: float | None = None
    """``--step-time-floor-ms`` of every learner (None: none)."""
    python: str = sys.executable
    """The interpreter that runs ``-m ddloco``."""

    @property
    def metrics_urls(self) -> dict[str, str]:
        return {name: f"http://127.0.0.1:{port}/metrics" for name, port in self.metrics_ports.items()}

    def ddloco(self, *args: str) -> list[str]:
        return [self.python, "-m", "ddloco", *args]

    def metrics_args(self, name: str) -> list[str]:
        if name not in self.metrics_ports:
            return []
        return ["--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_ports[name])]

    def learner_argv(self, lid: str, index: int) -> list[str]:
        """Learner ``lid`` on data shard ``index`` (a standby: ``lid`` "standby", index 0)."""
        argv = self.ddloco("learner", *self.common_args, "--learner-id", lid, "--data-shard", str(index),
                           "--threads", str(self.threads_per_learner), "--steps", str(self.steps))
        if self.slots.get(lid, {}).get("slowdown"):
            argv += ["--slowdown", str(self.slots[lid]["slowdown"])]
        if self.step_time_floor_ms:
            argv += ["--step-time-floor-ms", str(self.step_time_floor_ms)]
        return argv + self.metrics_args(lid)

    def broker_argv(self, *, xsub_bind: str, xpub_bind: str, run_id: str, fragments: int,
                    max_message_mb: float) -> list[str]:
        return self.ddloco("broker", *self.common_args, "--xsub", xsub_bind, "--xpub", xpub_bind,
                           "--run-id", run_id, "--shards", str(self.syncers), "--fragments", str(fragments),
                           "--max-message-mb", str(max_message_mb), *self.metrics_args("broker"))

    def shard_argv(self, k: int) -> list[str]:
        return self.ddloco("syncer", *self.common_args, "--shard", str(k), "--shards", str(self.syncers),
                           *self.metrics_args(f"shard{k}"))


def plan_up(*, learners: int, syncers: int, steps: int, config_path: str, insecure: bool,
            port: Callable[[], int], cpu_count: int, slowdowns: list[float] | None = None,
            extra_learners: int = 0, step_time_floor_ms: float | None = None, learner_threads: int = 0,
            python: str = sys.executable) -> UpPlan:
    """The plan of an `up` run of ``learners`` learners and ``syncers`` shards: learner i gets data
    shard i and slowdown ``slowdowns[i % len]``; every daemon a metrics port from ``port()``
    (broker, shards, learners, extra learners, in that order)."""
    learner_ids = tuple(f"learner-{i}" for i in range(learners))
    extra_ids = tuple(f"extra-{j}" for j in range(extra_learners))
    slow = slowdowns or []
    names = ("broker", *(f"shard{k}" for k in range(syncers)), *learner_ids, *extra_ids)
    ports = {name: port() for name in names}
    slots = {lid: {"index": i, "slowdown": slow[i % len(slow)] if slow else None, "metrics_port": ports[lid]}
             for i, lid in enumerate(learner_ids)}
    common_args = ("--config", config_path, "--log-format", "json") + (("--insecure",) if insecure else ())
    return UpPlan(learner_ids=learner_ids, extra_ids=extra_ids, syncers=syncers, steps=steps,
                  threads_per_learner=learner_threads or max(1, cpu_count // learners), slots=slots,
                  metrics_ports=ports,
                  common_args=common_args, step_time_floor_ms=step_time_floor_ms, python=python)


def forks_learners(*, has_fork: bool, device: str, cuda_visible: bool) -> bool:
    """Whether `up` starts its learners as forks of one prepared standby process: CPU learners on
    a machine where no GPU is visible. A process that set CUDA up cannot be forked; and where a GPU
    is visible, torch's autograd starts a thread per device at the standby's dry-run backward
    even for a CPU model, so every fork's first backward fails ("Unable to handle autograd's
    threading in combination with fork-based multiprocessing", seen on a GPU machine with
    `--device cpu`): there the learners start as processes of their own."""
    return has_fork and device == "cpu" and not cuda_visible
