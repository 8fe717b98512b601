"""A daemon's counters, each declared once: a field of its stats dataclass, declared with
``declare``, whose ``Counter`` (the field's metadata) says how it is shown. From that one
declaration come its Prometheus metric (``readings``), its place in the daemon's hash in Redis
(``hash_fields``) and in its stats log lines (``log_fields``). A new counter is one more field.

    @dataclass
    class ShardStats:
        merges: int = counters.declare(0, doc="Rounds merged.", metric="shard_merges_total", redis="merges")
        bytes_in: int = counters.declare(0, doc="Message bytes: in, out.", metric="shard_bytes_total",
                                         label="direction", key="in", redis="bytes_in")
        bytes_out: int = counters.declare(0, doc="Bytes sent.", metric="shard_bytes_total",
                                          label="direction", key="out", redis="bytes_out")

Several fields may make one metric by one label (``key``: the label value each field gives); the
metric's help is the ``doc`` of the first of them. The functions here read a stats object and
never write it; each copies what it reads (a dict copy is atomic under the GIL), so the owner
thread may go on counting.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from common import metrics

KINDS = ("counter", "gauge", "histogram")


@dataclass(frozen=True, kw_only=True)
class Counter:
    """How one counter (or gauge, or histogram) of a stats dataclass is shown."""

    doc: str
    """What it counts: the metric's help (of a metric made of several fields: the first one's)."""
    metric: str = ""
    """Its metric, after ``ddloco_`` (a counter's ends in ``_total``); empty: none."""
    kind: str = "counter"
    """The metric's kind: counter, gauge or histogram (the field is a ``metrics.Histogram``)."""
    label: str = ""
    """The metric's label: the field is a dict (label value -> count), or with ``key``, one value of it."""
    key: str = ""
    """The label value this field's number is, in a metric several fields make; empty: the field is the metric."""
    logged: bool = False
    """In the daemon's stats log lines (``log_fields``)."""
    redis: str = ""
    """Its field in the daemon's hash in Redis; empty: none. A dict is one JSON object there, or,
    with ``{}`` in the name, one field per key (``rejected_{}``); a histogram, its sum of seconds."""
    redis_total: str = ""
    """A dict: the sum of its values goes to this field of the hash too; empty: none."""
    digits: int | None = None
    """Rounded to this many digits in the hash; None: as it is."""
    whole: bool = False
    """A whole number in the hash (``int``: the fraction dropped)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"counter kind {self.kind!r}: one of {', '.join(KINDS)}")
        if self.kind == "counter" and self.metric and not self.metric.endswith("_total"):
            raise ValueError(f"a counter's metric ends in _total: {self.metric!r}")
        if self.key and not (self.metric and self.label):
            raise ValueError(f"counter key {self.key!r} without a metric and its label")


def declare(default: Any, **spec: Any) -> Any:
    """A stats dataclass field starting at ``default`` (a class or function: made anew for each
    object, like ``dict``), shown as ``Counter(**spec)`` says."""
    meta = {"counter": Counter(**spec)}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def declared(stats: Any) -> list[tuple[str, Counter, Any]]:
    """(field name, declaration, value now) of every counter of ``stats``, a dict copied."""
    out = []
    for f in fields(stats):
        value = getattr(stats, f.name)
        out.append((f.name, f.metadata["counter"], dict(value) if isinstance(value, dict) else value))
    return out


def log_fields(stats: Any) -> dict[str, Any]:
    """The logged counters by field name."""
    return {name: v for name, c, v in declared(stats) if c.logged}


def readings(stats: Any) -> list[metrics.Reading]:
    """The counters' metrics, in the order of their first field."""
    made: dict[str, tuple[Counter, Any]] = {}
    for _, c, v in declared(stats):
        if not c.metric:
            continue
        if c.key:
            made.setdefault(c.metric, (c, {}))[1][c.key] = v
        else:
            made[c.metric] = (c, v)
    return [_reading(c, v) for c, v in made.values()]


def _reading(c: Counter, value: Any) -> metrics.Reading:
    if c.kind == "histogram":
        return metrics.histogram(c.metric, c.doc, value)
    make = metrics.counter if c.kind == "counter" else metrics.gauge
    return make(c.metric, c.doc, value, c.label)


def hash_fields(stats: Any) -> dict[str, Any]:
    """The counters' fields of the daemon's hash in Redis."""
    out: dict[str, Any] = {}
    for _, c, v in declared(stats):
        if isinstance(v, dict) and "{}" in c.redis:
            out.update({c.redis.format(k): n for k, n in v.items()})
        elif c.redis:
            out[c.redis] = _hash_value(c, v)
        if c.redis_total:
            out[c.redis_total] = sum(v.values())
    return out


def _hash_value(c: Counter, v: Any) -> Any:
    if isinstance(v, metrics.Histogram):
        v = v.sum_s
    if isinstance(v, dict):
        return json.dumps(v)
    if c.whole:
        return int(v)
    return v if c.digits is None else round(v, c.digits)
