"""The broker's counters, each declared once: its field in ``BrokerStats`` says what it counts,
and from that one declaration come its Prometheus metric (``readings``), its place in the
``broker.stats`` / ``broker.stopped`` log lines (``as_dict``) and in the run's ``broker`` hash in
Redis (``redis_fields``, read by ``ddloco up`` through ``common.entries.parse_broker_entry``).
A new counter is one more field here.

Owning thread: the broker's loop (``Broker.poll_once``) writes every counter; the metrics
endpoint's thread reads them at a scrape through ``readings``, which copies each count by label
(a dict copy is atomic under the GIL) and never writes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from common import metrics


@dataclass(frozen=True, kw_only=True)
class Counter:
    """How one counter of ``BrokerStats`` is shown."""

    doc: str
    """What it counts: the metric's help."""
    metric: str = ""
    """Its metric, after ``ddloco_`` (a counter: ends in ``_total``); empty: none."""
    label: str = ""
    """A count by this label (the field is a dict: label value -> count); empty: one number."""
    logged: bool = True
    """In the ``broker.stats`` and ``broker.stopped`` log lines."""
    redis: str = ""
    """Its field in the run's ``broker`` hash (a count by label as a JSON object); empty: none."""
    redis_total: str = ""
    """A count by label: its sum goes to this field of the ``broker`` hash too; empty: none."""


def _counter(**spec: Any) -> Any:
    c = Counter(**spec)
    return field(default_factory=dict if c.label else int, metadata={"counter": c})


@dataclass
class BrokerStats:
    messages: int = _counter(doc="Messages forwarded from publishers to subscribers.", redis="messages")
    bytes: int = _counter(doc="Bytes forwarded (all frames).", redis="bytes")
    subscriptions: int = _counter(doc="Subscription messages passed upstream.",
                                  metric="broker_subscriptions_total")
    by_kind: dict[str, int] = _counter(
        doc="Messages forwarded from publishers to subscribers, by kind (topic prefix; other: unknown topics).",
        metric="broker_messages_total", label="kind")
    bytes_by_kind: dict[str, int] = _counter(doc="Bytes forwarded (all frames), by message kind.",
                                             metric="broker_bytes_total", label="kind", logged=False)
    refused: dict[str, int] = _counter(
        doc="Published messages dropped by the role rules (CURVE), by reason.",
        metric="broker_refused_total", label="reason", redis="refused")
    """Published messages dropped by the role rules and the limits, by reason (a fixed set of keys)."""
    auth_failures: dict[str, int] = _counter(doc="CURVE handshakes refused, by reason.",
                                             metric="broker_auth_failures_total", label="reason",
                                             redis="auth_failures_by_reason", redis_total="auth_failures")
    """CURVE handshakes refused by the ZAP handler or before it, by reason (a fixed set of keys)."""

    def _counters(self) -> list[tuple[Counter, Any]]:
        """(declaration, value now) of every counter, a count by label copied."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            out.append((f.metadata["counter"], dict(value) if isinstance(value, dict) else value))
        return out

    def as_dict(self) -> dict[str, Any]:
        """The logged counters by field name (the fields of ``broker.stats`` and ``broker.stopped``)."""
        return {f.name: v for f, (c, v) in zip(fields(self), self._counters()) if c.logged}

    def readings(self) -> list[metrics.Reading]:
        """What ``/metrics`` shows (read on the scrape's thread: copies, no lock)."""
        return [metrics.counter(c.metric, c.doc, v, c.label) for c, v in self._counters() if c.metric]

    def redis_fields(self) -> dict[str, Any]:
        """The counters' fields of the run's ``broker`` hash."""
        out: dict[str, Any] = {}
        for c, v in self._counters():
            if c.redis:
                out[c.redis] = json.dumps(v) if c.label else v
            if c.redis_total:
                out[c.redis_total] = sum(v.values())
        return out


def tally(counts: dict[str, int], key: str, n: int = 1) -> None:
    """Add ``n`` to ``counts[key]`` (a count by label of ``BrokerStats``)."""
    counts[key] = counts.get(key, 0) + n
