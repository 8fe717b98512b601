"""Typed configuration: frozen keyword-only dataclasses, loadable from TOML, overridable by flags.

Two kinds of config:
- ``RunConfig`` (task + algorithm) is shared by every process of a run. Its hash (task name,
  task config, seed, the task's data digest, every algorithm field) is stored in Redis once
  (SET NX); a learner or shard whose hash differs is refused with a clear error.
- ``LearnerOptions``, ``SyncerOptions``, ``Endpoints`` and ``UpOptions`` are per process
  (``common.options``; the value checks are ``common.config_values``; both re-exported here).

TOML layout (every section and key optional)::

    [task]      # TaskConfig
    [algo]      # AlgoConfig
    [endpoints] # Endpoints
    [learner]   # LearnerOptions
    [syncer]    # SyncerOptions
    [up]        # UpOptions
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, TypeVar

from common.config_values import (REDIS_URL_FORMS, ZMQ_ENDPOINT_FORMS, ConfigError, _check,  # noqa: F401
                                  check_value, endpoint_problem, redact_url, redis_url_problem)
from common.options import Endpoints, LearnerOptions, SyncerOptions, UpOptions  # noqa: F401

CODECS = ("fp32", "bf16", "int8", "int4")
"""Codec names (``common.quant`` implements them; kept here so config does not import torch)."""


MERGE_RULES = ("rda", "mean")
"""How a round's outer gradients combine (common.merge)."""

LR_SCHEDULES = ("constant", "cosine", "linear")
"""Inner learning-rate schedules on the run's global token count (learner.inner)."""


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which task every learner trains.

    TOML: ``[task]`` with ``spec`` and ``seed``; every other key is a task arg. The run's
    identity is (``name``, ``config``, ``seed``, ``data_digest``): ``spec`` and ``args`` say how
    to load the task and may differ between machines (a path, a module location) as long as the
    task they load reports the same name and config and loads the same data.
    """

    spec: str = "gpt"
    """Built-in task (gpt, gpt-moe, text, digits) or MODULE:ATTR (a Task or a callable returning
    one); empty when the task was handed over as a Python object."""
    seed: int = 0
    """Run seed: the model initialisation (torch's RNG when ``model()`` runs) and the batch streams."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task callable (``--task-arg KEY=VALUE``)."""
    name: str = ""
    """``Task.name`` of the loaded task (filled in when the task is bound to the run)."""
    config: dict[str, Any] = field(default_factory=dict)
    """``Task.config`` of the loaded task (filled in when bound); processes whose task reports
    another name or config are refused."""
    data_digest: str = ""
    """``Task.data_digest`` of the task that started the run: a hash of its data (the built-ins
    hash the corpus bytes or the digits arrays they loaded); processes whose data hashes
    differently are refused. Empty: the task gives none, the data is not checked."""
    data_source: str = ""
    """``Task.data_source``: where this process's data came from, named when digests differ (not
    part of the identity: paths may differ between machines)."""

    def __post_init__(self) -> None:
        _check(isinstance(self.spec, str), f"task.spec must be a string, got {self.spec!r}")
        _check(isinstance(self.data_digest, str) and isinstance(self.data_source, str),
               "task.data_digest and task.data_source must be strings")
        _check(isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
               f"task.seed must be an int >= 0, got {self.seed!r}")
        _check(isinstance(self.args, dict), "task.args must be a table")
        _check(isinstance(self.config, dict), "task.config must be a table")


RESERVED_TASK_KEYS = ("spec", "seed")
"""Keys of the TOML ``[task]`` table that are not task args."""


def task_config_from_table(table: Mapping[str, Any] | None) -> TaskConfig:
    """``[task]`` TOML table -> TaskConfig: ``spec`` and ``seed``, every other key a task arg;
    a ``[task.args]`` sub-table holds args too (and the only way to pass an arg named spec or seed)."""
    table = dict(table or {})
    sub = table.pop("args", {})
    if not isinstance(sub, Mapping):
        raise ConfigError("[task] args must be a table ([task.args])")
    args = {**{k: v for k, v in table.items() if k not in RESERVED_TASK_KEYS}, **sub}
    kept = {k: table[k] for k in RESERVED_TASK_KEYS if k in table}
    return TaskConfig(**kept, args=args)


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """Decoupled DiLoCo hyper-parameters (ALGORITHM.md); identical on every process of a run."""

    fragments: int = 24
    """P: number of balanced parameter fragments."""
    sync_every_steps: int = 12
    """H: each fragment is merged about once every H learner steps [ours: 12; the paper's 24
    measured worse at M = 4 on every seed at 1.6 M tokens, on two of three at 4x that,
    docs/ALGORITHM.md section 10]."""
    tau: int = 2
    """tau: at most tau rounds in flight per shard; grace budget is tau learner steps."""
    quorum: int = 1
    """K: minimum answers before a round may merge (K = M is lock-step DiLoCo)."""
    grace_gamma: float = 0.8
    """gamma: fraction of the slack (tau*xi_step - xi_quorum - xi_sync) spent in the grace window."""
    grace_enabled: bool = True
    """Adaptive grace window on/off (off: merge as soon as the quorum is reached)."""
    outer_lr: float = 1.0
    """eta: outer learning rate [ours: 1.0; DiLoCo's 0.7 with mu 0.9 overshoots at H = 24, see
    docs/ALGORITHM.md section 10]."""
    outer_momentum: float = 0.0
    """mu: outer (Nesterov) momentum [ours: 0; any momentum measured worse at H = 24]."""
    inner_lr: float = 3e-3
    """AdamW learning rate of the inner loop."""
    inner_weight_decay: float = 0.0
    """AdamW weight decay of the inner loop."""
    inner_warmup_steps: int = 20
    """Per-life ramp of the inner learning rate, in a learner's own steps: protects the freshly
    zeroed AdamW moments of a learner that (re)starts [ours; 0 or 1 = none]. The run's schedule
    is the lr_* fields, on the global token count."""
    inner_beta1: float = 0.9
    """AdamW beta1 of the inner loop (nanoGPT's)."""
    inner_beta2: float = 0.95
    """AdamW beta2 of the inner loop (nanoGPT's)."""
    inner_grad_clip: float = 0.0
    """Clip the inner gradient's global norm to this (0 = no clipping)."""
    inner_grad_accum: int = 1
    """Micro-batches accumulated per inner step (their tokens all count)."""
    lr_schedule: str = "constant"
    """Inner learning-rate schedule on the run's global token count: constant, cosine or linear."""
    lr_warmup_tokens: int = 0
    """Linear warm-up of the schedule over the run's first N tokens (all learners together)."""
    lr_decay_tokens: int = 0
    """cosine / linear: the global token count at which the decay reaches lr_min_ratio."""
    lr_min_ratio: float = 0.1
    """cosine / linear: the final learning rate as a fraction of inner_lr."""
    uplink_codec: str = "int4"
    """Codec of learners' fragment deltas: fp32, bf16, int8, int4."""
    downlink_codec: str = "int4"
    """Codec of the broadcast merged fragments: fp32 (the full value), or bf16 / int8 / int4:
    the quantized update Θ_new − Θ_old, which the syncer and every learner add to Θ_old alike
    (bit-identical replicas; the syncer keeps the exact fp32 result as its master, ALGORITHM §7).
    Joins and repairs always fetch the full value in fp32."""
    merge_rule: str = "rda"
    """How outer gradients of non-embedding tensors combine: "rda" (radial-directional
    average) or "mean" (weighted average). Embedding tensors always use the weighted average."""
    outer_nesterov: bool = True
    """Outer SGD with Nesterov momentum (False: plain heavy-ball momentum)."""
    outer_warmup_merges: int = 0
    """Outer learning rate ramps linearly over a fragment's first N merges (0 = no warm-up)."""
    carry_local_steps: bool = True
    """On receipt of a merged fragment, keep the steps not yet contributed on top of it:
    theta <- Theta_new + (theta - reference), where reference is the snapshot the learner last
    answered with (or its previous base when it has not answered since) [ours]. False: the
    paper's overwrite, which loses the steps taken between an answer and the merge's arrival."""
    mix_alpha: float = 0.0
    """alpha: learner keeps alpha*theta + (1-alpha)*Theta on receipt (0 = overwrite)."""
    history_versions: int = 1
    """Versions of each fragment's value a shard keeps to rebuild answers' deltas against their
    base. Learners answer only from a base equal to the open round's version, and a fragment opens
    no round while it merges, so the current version is all a merge reads (1, the default); each
    extra version costs the shard one more copy of its share of the model."""
    lockstep: bool = False
    """Lock-step baseline: learners stop every H steps until every fragment is merged, and each
    round waits for every learner (K = M whatever ``quorum`` says: a killed learner's replacement
    is waited for; one that left after its training ended on its own is not). This is Decoupled DiLoCo
    with K = M (token weights, RDA, the outer step), not the plain-average synchronous DiLoCo."""

    def __post_init__(self) -> None:
        _check(self.fragments >= 1, "algo.fragments must be >= 1")
        _check(self.sync_every_steps >= 1, "algo.sync_every_steps must be >= 1")
        _check(self.tau >= 1, "algo.tau must be >= 1")
        _check(self.quorum >= 1, "algo.quorum must be >= 1")
        _check(0.0 <= self.grace_gamma <= 1.0, "algo.grace_gamma must be in [0, 1]")
        _check(self.outer_lr > 0, "algo.outer_lr must be > 0")
        _check(0.0 <= self.outer_momentum < 1.0, "algo.outer_momentum must be in [0, 1)")
        _check(self.inner_lr > 0, "algo.inner_lr must be > 0")
        _check(self.uplink_codec in CODECS, f"algo.uplink_codec must be one of {CODECS}")
        _check(self.downlink_codec in CODECS, f"algo.downlink_codec must be one of {CODECS}")
        _check(0.0 <= self.mix_alpha < 1.0, "algo.mix_alpha must be in [0, 1)")
        _check(self.merge_rule in MERGE_RULES, f"algo.merge_rule must be one of {MERGE_RULES}, got {self.merge_rule!r}")
        _check(self.outer_warmup_merges >= 0, "algo.outer_warmup_merges must be >= 0")
        _check(not (self.carry_local_steps and self.mix_alpha > 0),
               "algo.carry_local_steps and algo.mix_alpha > 0 are exclusive (two rules for the same receipt)")
        _check(self.history_versions >= 1, "algo.history_versions must be >= 1")
        _check(0.0 <= self.inner_beta1 < 1.0 and 0.0 <= self.inner_beta2 < 1.0, "algo.inner_beta1/2 must be in [0, 1)")
        _check(self.inner_grad_clip >= 0, "algo.inner_grad_clip must be >= 0")
        _check(self.inner_grad_accum >= 1, "algo.inner_grad_accum must be >= 1")
        _check(self.lr_schedule in LR_SCHEDULES, f"algo.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        _check(self.lr_warmup_tokens >= 0, "algo.lr_warmup_tokens must be >= 0")
        _check(self.lr_schedule == "constant" or self.lr_decay_tokens > self.lr_warmup_tokens,
               "algo.lr_decay_tokens must exceed algo.lr_warmup_tokens for a cosine or linear schedule")
        _check(0.0 <= self.lr_min_ratio <= 1.0, "algo.lr_min_ratio must be in [0, 1]")


def _digest(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that must be identical on every process of one run."""

    task: TaskConfig = field(default_factory=TaskConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def identity(self) -> dict[str, Any]:
        """What every process of the run must agree on: all but how the task is loaded and where
        its data lies (``data_digest`` is left out when empty: the digest of a run whose task gives
        none is what it was before data digests existed)."""
        d = self.to_dict()
        d["task"] = {k: v for k, v in d["task"].items() if k not in ("spec", "args", "data_source")
                     and not (k == "data_digest" and not v)}
        del d["algo"]["history_versions"]   # a shard's memory, not what any process computes
        return d

    def digest(self) -> str:
        """Stable hash of the run's identity; processes with another digest are refused."""
        return _digest(self.identity())

    def legacy_digests(self) -> set[str]:
        """Digests of this run as older code computed them, so that a shard checkpoint written
        then still resumes: before the task's data digest was recorded, and while
        ``algo.history_versions`` (8 by default then) was part of the identity."""
        out = set()
        for task in (self.task, dataclasses.replace(self.task, data_digest="")):
            ident = dataclasses.replace(self, task=task).identity()
            out.add(_digest(ident))
            for kept in {8, self.algo.history_versions}:
                out.add(_digest({**ident, "algo": {**ident["algo"], "history_versions": kept}}))
        out.discard(self.digest())
        return out



T = TypeVar("T")


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, *, section: str) -> T:
    """Build ``cls`` from a TOML section; unknown keys are an error naming the section."""
    data = dict(data or {})
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) in [{section}]: {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for key, value in data.items():
        _check_type(section, key, known[key].type, value)
    try:
        return cls(**data)
    except TypeError as e:  # a value of the wrong type reached a range check
        raise ConfigError(f"[{section}]: a value has the wrong type ({e})") from None


_SCALAR_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _check_type(section: str, key: str, annotation: Any, value: Any) -> None:
    """A TOML value of the wrong type is refused naming the field (no silent casts)."""
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    allowed = _SCALAR_TYPES.get(name)
    if allowed is None:
        return
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        want = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}[name]
        raise ConfigError(f"[{section}] {key} must be {want}, got {value!r} ({type(value).__name__})")


def override(obj: T, **changes: Any) -> T:
    """Replace the fields given (None means keep), re-running validation."""
    kept = {k: v for k, v in changes.items() if v is not None}
    return dataclasses.replace(obj, **kept) if kept else obj  # type: ignore[type-var]


@dataclass(frozen=True, kw_only=True)
class ConfigFile:
    """Every section of a TOML config file, resolved to dataclasses with defaults."""

    run: RunConfig = field(default_factory=RunConfig)
    endpoints: Endpoints = field(default_factory=Endpoints)
    learner: LearnerOptions = field(default_factory=LearnerOptions)
    syncer: SyncerOptions = field(default_factory=SyncerOptions)
    up: UpOptions = field(default_factory=UpOptions)


_SECTIONS = ("task", "algo", "endpoints", "learner", "syncer", "up")


def load_config(path: str | Path | None) -> ConfigFile:
    """Load a TOML file (or defaults when ``path`` is None)."""
    if path is None:
        return ConfigFile()
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section(s) in {p}: {', '.join(unknown)}; known: {', '.join(_SECTIONS)}")
    return ConfigFile(
        run=RunConfig(task=task_config_from_table(data.get("task")),
                      algo=from_mapping(AlgoConfig, data.get("algo"), section="algo")),
        endpoints=from_mapping(Endpoints, data.get("endpoints"), section="endpoints"),
        learner=from_mapping(LearnerOptions, data.get("learner"), section="learner"),
        syncer=from_mapping(SyncerOptions, data.get("syncer"), section="syncer"),
        up=from_mapping(UpOptions, data.get("up"), section="up"),
    )


def run_config_from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Inverse of ``RunConfig.to_dict`` (used to pass a run config to child processes)."""
    return RunConfig(task=from_mapping(TaskConfig, d.get("task"), section="task"),
                     algo=from_mapping(AlgoConfig, d.get("algo"), section="algo"))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cannot write {type(v).__name__} to TOML")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def dump_toml(cfg: ConfigFile) -> str:
    """Inverse of ``load_config``: every section with every resolved value."""
    sections = {"task": cfg.run.task, "algo": cfg.run.algo, "endpoints": cfg.endpoints,
                "learner": cfg.learner, "syncer": cfg.syncer, "up": cfg.up}
    lines: list[str] = []
    for name, obj in sections.items():
        lines.append(f"[{name}]")
        if isinstance(obj, TaskConfig):  # spec and seed, then the task args in their own table
            lines += [f"spec = {_toml_value(obj.spec)}", f"seed = {_toml_value(obj.seed)}", "", "[task.args]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in obj.args.items()]
        else:
            lines += [f"{f.name} = {_toml_value(getattr(obj, f.name))}" for f in fields(obj)]
        lines.append("")
    return "\n".join(lines)
