"""The broker's counters, each declared once (``common.counters``): its field in ``BrokerStats``
says what it counts, and from that one declaration come its Prometheus metric (``readings``), its
place in the ``broker.stats`` / ``broker.stopped`` log lines (``as_dict``) and in the run's
``broker`` hash in Redis (``redis_fields``, read by ``ddloco up`` through
``common.entries.parse_broker_entry``). A new counter is one more field here.

Owning thread: the broker's loop (``Broker.poll_once``) writes every counter; the metrics
endpoint's thread reads them at a scrape through ``readings``, which copies each count by label
(a dict copy is atomic under the GIL) and never writes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common import counters, metrics
from common.counters import Counter  # noqa: F401 (importable here)


def _counter(**spec: Any) -> Any:
    """A count (by label: a dict of counts), in the log lines unless ``logged=False``."""
    return counters.declare(dict if spec.get("label") else 0, **{"logged": True, **spec})


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

    def as_dict(self) -> dict[str, Any]:
        """The logged counters by field name (the fields of ``broker.stats`` and ``broker.stopped``)."""
        return counters.log_fields(self)

    def readings(self) -> list[metrics.Reading]:
        """What ``/metrics`` shows (read on the scrape's thread: copies, no lock)."""
        return counters.readings(self)

    def redis_fields(self) -> dict[str, Any]:
        """The counters' fields of the run's ``broker`` hash."""
        return counters.hash_fields(self)


def tally(counts: dict[str, int], key: str, n: int = 1) -> None:
    """Add ``n`` to ``counts[key]`` (a count by label of ``BrokerStats``)."""
    counts[key] = counts.get(key, 0) + n
