"""Command-line flags made from the config dataclasses: a field is declared once, with its
docstring, and a flag names it.

    Flag("--sync-every", AlgoConfig, "sync_every_steps")   # help: the field's docstring + default

The help of a generated flag is the field's docstring (its first paragraph, without the
``[...]`` notes on where a default came from) and the field's default. Such a flag defaults to
None, so that a value from the TOML file is kept unless the flag is given; ``changes`` turns the
flags given into the keyword arguments of ``common.config.override``. ``FLAG_OF_FIELD`` (built
by ``flag_table``) names, in an error, the flag the user typed instead of the field.

Also the flag groups every daemon shares (``add_common``: the cluster; ``add_algo``: the run's
algorithm and task; ``add_metrics``). Pure declarations: no argv or environment is read here.
Threads: parsers are built on the main thread; the one mutable state, the cache of parsed
docstrings (``_docstrings``), only ever gains the same entries.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Iterable

from common.config import CODECS, LR_SCHEDULES, AlgoConfig, TaskConfig
from common.options import Endpoints, LearnerOptions, SyncerOptions, UpOptions

SECTIONS: dict[type, str] = {AlgoConfig: "algo", TaskConfig: "task", Endpoints: "endpoints",
                             UpOptions: "up", SyncerOptions: "syncer", LearnerOptions: "learner"}
"""Config dataclass -> its TOML section, the name a range check gives its fields (``algo.tau``)."""

_TYPES = {"int": int, "float": float, "str": None}   # a string stays as argparse reads it


@dataclass(frozen=True)
class Flag:
    """One flag that sets one field of a config dataclass."""

    flag: str
    """The long option, e.g. ``--sync-every``; its argparse dest is the name with ``_`` for ``-``."""
    owner: type
    """The dataclass holding the field."""
    field: str
    """The field the flag sets."""
    sets: Any = None
    """A switch (``store_true``): the value the field takes when it is given."""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    note: str = ""
    """What the command line adds to the field's docstring (an environment variable, a use)."""
    keep_default: bool = False
    """The flag defaults to the field's default (no TOML section holds it) instead of None."""

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def default(self) -> Any:
        f = next(f for f in dataclasses.fields(self.owner) if f.name == self.field)
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]

    def help(self) -> str:
        text = field_doc(self.owner, self.field)
        if self.note:
            text = f"{text.rstrip('.')}; {self.note}"
        if self.sets is None and self.default not in ("", None) and "default" not in text:   # told once
            text = f"{text.rstrip('.')} (default {self.default})"
        return text.replace("%", "%%")

    def add_to(self, group: Any) -> None:
        if self.sets is not None:
            group.add_argument(self.flag, action="store_true", help=self.help())
            return
        kind = next(f.type for f in dataclasses.fields(self.owner) if f.name == self.field)
        group.add_argument(self.flag, type=_TYPES[str(kind)], choices=list(self.choices or []) or None, metavar=self.metavar,
                           default=self.default if self.keep_default else None, help=self.help())


@functools.cache
def _docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string right after each field), read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body   # type: ignore[attr-defined]
    out = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            out[node.target.id] = after.value.value
    return out


def field_doc(cls: type, name: str) -> str:
    """The docstring of field ``name`` of ``cls`` as one line: its first paragraph, less its
    ``[...]`` notes."""
    doc = _docstrings(cls).get(name, "").split("\n\n")[0].replace("``", "")
    return re.sub(r"\s*\[[^\]]*\]", "", " ".join(doc.split()))


def add_flags(group: Any, flags: Iterable[Flag]) -> None:
    for f in flags:
        f.add_to(group)


def changes(args: argparse.Namespace, flags: Iterable[Flag], owner: type) -> dict[str, Any]:
    """The fields of ``owner`` set by the flags given: keyword arguments of ``override``."""
    out = {}
    for f in flags:
        value = getattr(args, f.dest, None)
        if f.owner is owner and value is not None and value is not False:   # 0 is a value
            out[f.field] = f.sets if f.sets is not None else value
    return out


def given(args: argparse.Namespace, flags: Iterable[Flag]) -> bool:
    """Any of ``flags`` given on the command line (a 0 does not count, as a switch left off)."""
    return any(getattr(args, f.dest, None) not in (None, False) for f in flags)


def flag_table(flags: Iterable[Flag]) -> dict[str, tuple[str, str]]:
    """A config field, as its range check names it (``algo.tau``), -> (argparse dest, flag)."""
    return {f"{SECTIONS[f.owner]}.{f.field}": (f.dest, f.flag) for f in flags if f.owner in SECTIONS}


ALGO_FLAGS = (
    Flag("--fragments", AlgoConfig, "fragments"),
    Flag("--sync-every", AlgoConfig, "sync_every_steps"),
    Flag("--tau", AlgoConfig, "tau"),
    Flag("--quorum", AlgoConfig, "quorum"),
    Flag("--codec", AlgoConfig, "uplink_codec", choices=CODECS),
    Flag("--no-grace", AlgoConfig, "grace_enabled", sets=False, note="this flag turns it off"),
    Flag("--lockstep", AlgoConfig, "lockstep", sets=True),
    Flag("--seed", TaskConfig, "seed"),
    Flag("--inner-lr", AlgoConfig, "inner_lr"),
    Flag("--weight-decay", AlgoConfig, "inner_weight_decay"),
    Flag("--grad-clip", AlgoConfig, "inner_grad_clip"),
    Flag("--grad-accum", AlgoConfig, "inner_grad_accum"),
    Flag("--lr-schedule", AlgoConfig, "lr_schedule", choices=LR_SCHEDULES),
    Flag("--lr-warmup-tokens", AlgoConfig, "lr_warmup_tokens"),
    Flag("--lr-decay-tokens", AlgoConfig, "lr_decay_tokens"),
)
"""The run's algorithm (must match the run's): every process that may start a run takes them."""

ENDPOINT_FLAGS = (Flag("--run-id", Endpoints, "run_id"),)
"""Cluster flags named in errors (the rest of ``add_common`` is checked before any config is made)."""



def metrics_flags(owner: type) -> tuple[Flag, Flag]:
    """The Prometheus endpoint of a daemon (fields of the same name in every daemon's options)."""
    return (Flag("--metrics-port", owner, "metrics_port", metavar="PORT", note="env DDLOCO_METRICS_PORT"),
            Flag("--metrics-host", owner, "metrics_host", metavar="HOST", note="env DDLOCO_METRICS_HOST"))


def add_common(p: argparse.ArgumentParser, command: str = "") -> None:
    """The cluster flags; ``command`` tailors what they say (a flag a command accepts but does not
    use is hidden from its --help)."""
    hidden = argparse.SUPPRESS
    g = p.add_argument_group("cluster")
    g.add_argument("--config", metavar="FILE.toml", help="TOML config file (sections task, algo, endpoints, "
                   "learner, syncer, up); flags override it")
    g.add_argument("--run-id", help="with --redis-url: write the broker's counters to this run's entry in Redis"
                   if command == "broker" else "run identifier (namespaces Redis keys, messages and the work "
                   "directory runs/RUN_ID-<time>; default: a new one, demo-<6 hex digits>)" if command == "up"
                   else "run identifier (namespaces Redis keys and messages; default demo)")
    redis_default = {"up": "default: an embedded Redis", "broker": "used with --run-id only"}.get(
        command, "default redis://127.0.0.1:6379/0")
    g.add_argument("--redis-url", help="Redis URL, e.g. redis://host:6379/0, redis://user:password@host:6379/0 or "
                   f"rediss://... (TLS); env DDLOCO_REDIS_URL keeps a password off the command line ({redis_default})")
    g.add_argument("--keys", metavar="DIR", help=hidden if command == "status" else
                   "not used by up: it makes a key pair per member in runs/<run>/keys" if command == "up" else
                   "CurveZMQ keys made by `ddloco keys` (env DDLOCO_KEYS): this member's secret and the run's "
                   "allow list")
    g.add_argument("--insecure", action="store_true", help=hidden if command == "status" else
                   "no CURVE authentication or encryption (env DDLOCO_INSECURE=1); logged. Without it a daemon "
                   "refuses to start with no --keys")
    pub_help, sub_help = _broker_help(command)
    g.add_argument("--broker-pub", metavar="ENDPOINT", help=pub_help)
    g.add_argument("--broker-sub", metavar="ENDPOINT", help=sub_help)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default info)")
    g.add_argument("--log-format", default="auto", choices=["auto", "json", "console"],
                   help="auto: console on a terminal, JSON lines otherwise")


def _broker_help(command: str) -> tuple[str, str]:
    """What --broker-pub / --broker-sub say for ``command``."""
    if command == "up":
        return ("endpoint the broker binds for publishers (its XSUB) and every learner and shard publishes "
                "to, e.g. tcp://127.0.0.1:5555 (default: a free port on 127.0.0.1; a port in use is refused)",
                "endpoint the broker binds for subscribers (its XPUB) and every learner and shard "
                "subscribes at, e.g. tcp://127.0.0.1:5556 (default: a free port on 127.0.0.1)")
    if command in ("status", "broker"):   # status reads Redis only; the broker binds --xsub / --xpub
        return argparse.SUPPRESS, argparse.SUPPRESS
    return ("the broker's XSUB endpoint, where this process publishes, e.g. tcp://host:5555 (default port 5555)",
            "the broker's XPUB endpoint, where this process subscribes, e.g. tcp://host:5556 (default port 5556)")


def add_algo(p: argparse.ArgumentParser) -> None:
    """The run's algorithm and task (they must match the run's)."""
    add_flags(p.add_argument_group("algorithm (must match the run's)"), ALGO_FLAGS)
    g = p.add_argument_group("task (must match the run's)")
    g.add_argument("--task", metavar="TASK", help="built-in task (gpt, gpt-moe, text, digits, hf) or MODULE:ATTR, a "
                   "ddloco.Task or a callable returning one, imported from the current directory or PYTHONPATH "
                   "(default gpt; env DDLOCO_TASK)")
    g.add_argument("--task-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="keyword argument of the task callable, repeatable (env DDLOCO_TASK_ARGS, space-separated)")


def add_metrics(p: argparse.ArgumentParser, owner: type = SyncerOptions) -> None:
    add_flags(p.add_argument_group("metrics"), metrics_flags(owner))
