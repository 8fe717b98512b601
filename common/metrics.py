"""Prometheus metrics of one daemon: its own registry, read from its counters at scrape time.

A daemon (broker, syncer shard, learner) keeps plain counters in its stats object, updated on
its own loop as before: nothing here runs per message. A scrape of ``http://HOST:PORT/metrics``
calls the daemon's ``read()``, which lists ``Reading``s (counter, gauge or histogram values read
from those counters), and this module writes them in the Prometheus text format with
prometheus_client. Every series carries ``run_id``, ``role`` and ``member`` (``broker``,
``shard<k>``, the learner id), so several daemons in one process (shards as threads, the Python
API) keep separate registries and separate endpoints. Names are ``ddloco_<role>_<what>``;
counters end in ``_total``, units are in the name (``_seconds``, ``_bytes``).

    server = metrics.start(role="syncer", run_id=run, member="shard0", read=shard.readings,
                           host="127.0.0.1", port=9100)      # port 0: any free one (server.url)
    ...
    server.stop()

prometheus_client is imported only when an endpoint starts (a learner's boot pays nothing).
"""
from __future__ import annotations

import bisect
import math
import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from common.config import ConfigError

PREFIX = "ddloco_"
LABELS = ("run_id", "role", "member")
"""The labels of every series: which run, which kind of daemon, which one."""
ROUND_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
"""Buckets of the shards' round latency (open to merge): a round lasts about H learner steps,
tens of milliseconds to minutes."""


class Histogram:
    """Seconds in fixed buckets, observed by the daemon's own loop: one writer and no lock; a
    scrape copies the bucket counts (a list copy is atomic under the GIL), so ``+Inf`` always
    equals the count it exports."""

    def __init__(self, bounds_s: Iterable[float] = ROUND_BUCKETS_S) -> None:
        self.bounds = tuple(sorted(bounds_s))
        self.counts = [0] * (len(self.bounds) + 1)
        """counts[i]: observations in (bounds[i-1], bounds[i]]; the last one above every bound."""
        self.sum_s = 0.0
        self.last_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds
        self.last_s = seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        """([(le, observations <= le), ..., ("+Inf", all)], sum of the seconds)."""
        counts, total = list(self.counts), self.sum_s
        out, acc = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts):
            acc += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), acc))
        return out, total


@dataclass(frozen=True)
class Reading:
    """One metric as a daemon reads it: a number, numbers by one label, or a histogram."""

    name: str
    """After ``ddloco_``; a counter's ends in ``_total``."""
    kind: str
    """"counter", "gauge" or "histogram"."""
    doc: str
    value: float | Mapping[str, float] | Histogram
    label: str = ""
    """With a mapping: the label its keys are the values of (``kind``, ``outcome``...)."""


def counter(name: str, doc: str, value: float | Mapping[str, float], label: str = "") -> Reading:
    if not name.endswith("_total"):
        raise ValueError(f"a counter's name ends in _total: {name!r}")
    return Reading(name, "counter", doc, value, label)


def gauge(name: str, doc: str, value: float | Mapping[str, float], label: str = "") -> Reading:
    return Reading(name, "gauge", doc, value, label)


def histogram(name: str, doc: str, value: Histogram) -> Reading:
    return Reading(name, "histogram", doc, value)


def version() -> str:
    """The installed decoupled-diloco version ("unknown" when run from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("decoupled-diloco")
    except PackageNotFoundError:
        return "unknown"


class DaemonCollector:
    """A prometheus_client collector over one daemon's ``read()`` (no ``describe``: nothing is
    read when it is registered, only at each scrape)."""

    def __init__(self, *, role: str, run_id: str, member: Callable[[], str], read: Callable[[], Iterable[Reading]],
                 info: Mapping[str, str] | None = None) -> None:
        self.role = role
        self.run_id = run_id
        self.member = member
        self.read = read
        self.info = dict(info or {})
        self.version = version()

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        base = [self.run_id, self.role, self.member()]
        up = GaugeMetricFamily(PREFIX + "up", "1 while this daemon serves metrics.", labels=LABELS)
        up.add_metric(base, 1)
        yield up
        extra = sorted(self.info)
        info = GaugeMetricFamily(PREFIX + "info", "Build and role of this daemon (always 1).",
                                 labels=(*LABELS, "version", *extra))
        info.add_metric([*base, self.version, *(str(self.info[k]) for k in extra)], 1)
        yield info
        for r in self.read():
            name = PREFIX + r.name
            if r.kind == "histogram":
                fam = HistogramMetricFamily(name, r.doc, labels=LABELS)
                buckets, total = r.value.cumulative()
                fam.add_metric(base, buckets, total)
                yield fam
                continue
            cls = CounterMetricFamily if r.kind == "counter" else GaugeMetricFamily
            if isinstance(r.value, Mapping):
                fam = cls(name, r.doc, labels=(*LABELS, r.label))
                for key, v in sorted(dict(r.value).items()):
                    fam.add_metric([*base, str(key)], float(v))
            else:
                fam = cls(name, r.doc, labels=LABELS)
                fam.add_metric(base, float(r.value))
            yield fam


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True   # a scrape in progress never holds the daemon's exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:   # no access log on stderr: the daemons log JSON
        pass


class MetricsServer:
    """``/metrics`` of one registry, served by a WSGI server on a daemon thread until ``stop``."""

    def __init__(self, registry: Any, host: str, port: int) -> None:
        from prometheus_client import make_wsgi_app
        server_cls = _Server6 if ":" in host else _Server
        try:
            self._httpd = make_server(host, port, make_wsgi_app(registry), server_cls, handler_class=_QuietHandler)
        except (OSError, OverflowError) as e:   # port taken or out of range, address not on this host
            raise ConfigError(f"metrics endpoint {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
        self.host = host
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.25},
                                        name=f"metrics-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5.0)
        self._httpd.server_close()


def make_registry(collector: DaemonCollector) -> Any:
    """A registry of its own for one daemon, with the process' CPU and memory (Linux /proc)."""
    from prometheus_client import CollectorRegistry, ProcessCollector
    registry = CollectorRegistry()
    registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


def serve(registry: Any, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` (port 0: any free port, see ``.url``);
    ConfigError when the address cannot be bound."""
    return MetricsServer(registry, host, port)


def start(*, role: str, run_id: str, member: str | Callable[[], str], read: Callable[[], Iterable[Reading]],
          host: str, port: int, info: Mapping[str, str] | None = None) -> MetricsServer | None:
    """A daemon's endpoint as its options say: ``port`` < 0 none (None), 0 any free port."""
    if port < 0:
        return None
    who = member if callable(member) else (lambda: member)
    return serve(make_registry(DaemonCollector(role=role, run_id=run_id, member=who, read=read, info=info)),
                 host, port)
