"""The broker: a ZeroMQ XSUB/XPUB forwarder with message and byte counters.

Publishers (learners' updates, shards' opens and fragments) connect PUB sockets to the XSUB
endpoint; subscribers connect SUB sockets to the XPUB endpoint. Subscriptions flow back
upstream. The XPUB side never blocks: a slow subscriber loses messages at its high-water mark
(counted by receivers through versions and repaired), it never stalls the others. That is why
XPUB_NODROP is deliberately not set (see DESIGN.md, pitfalls).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import zmq

from common import wire
from common.log import get_logger


@dataclass(frozen=True, kw_only=True)
class BrokerOptions:
    """Broker sockets and buffers."""

    xsub_bind: str = "tcp://0.0.0.0:5555"
    """Publishers connect here."""
    xpub_bind: str = "tcp://0.0.0.0:5556"
    """Subscribers connect here."""
    hwm_messages: int = 200
    """High-water mark of each direction, in messages. A subscriber that stops reading (a frozen
    learner) costs the broker at most this many queued messages before it drops for that one
    subscriber only; 200 holds the bursts of a run (one merged fragment per learner step at
    most) while bounding memory when fragments are large."""
    stats_interval_s: float = 10.0
    """Log counters this often (only when they changed)."""


KNOWN_KINDS = frozenset(wire.KINDS)
"""Message kinds counted by name; any other topic is counted as "other"."""


@dataclass
class BrokerStats:
    messages: int = 0
    bytes: int = 0
    subscriptions: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"messages": self.messages, "bytes": self.bytes, "subscriptions": self.subscriptions,
                "by_kind": dict(self.by_kind)}


class Broker:
    """``with Broker(opts) as b: while not stop.is_set(): b.poll_once(100)``."""

    def __init__(self, options: BrokerOptions) -> None:
        self.options = options
        self.stats = BrokerStats()
        self.log = get_logger("broker")
        self._ctx: zmq.Context | None = None
        self.xsub_endpoint = ""
        self.xpub_endpoint = ""
        self._last_stats = (0.0, -1)

    def __enter__(self) -> "Broker":
        self._ctx = zmq.Context()
        self.xsub = self._ctx.socket(zmq.XSUB)
        self.xpub = self._ctx.socket(zmq.XPUB)
        for s in (self.xsub, self.xpub):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, self.options.hwm_messages)
            s.setsockopt(zmq.RCVHWM, self.options.hwm_messages)
        self.xsub.bind(self.options.xsub_bind)
        self.xpub.bind(self.options.xpub_bind)
        self.xsub_endpoint = self.xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.xpub_endpoint = self.xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.xsub, zmq.POLLIN)
        self.poller.register(self.xpub, zmq.POLLIN)
        self.log.info("broker.started", xsub=self.xsub_endpoint, xpub=self.xpub_endpoint,
                      hwm=self.options.hwm_messages)
        return self

    def __exit__(self, *exc) -> None:
        self.log.info("broker.stopped", **self.stats.as_dict())
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def poll_once(self, timeout_ms: int = 100) -> int:
        """Forward whatever is ready; returns the number of messages forwarded."""
        n = 0
        events = dict(self.poller.poll(timeout_ms))
        if self.xsub in events:
            for _ in range(1000):  # bounded burst, then let subscriptions through
                try:
                    frames = self.xsub.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self.xpub.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass  # XPUB drops at HWM on its own; Again only without subscribers
                n += 1
                self.stats.messages += 1
                self.stats.bytes += sum(len(f.buffer) for f in frames)
                kind = bytes(frames[0].buffer).partition(b"|")[2].partition(b".")[0].decode(errors="replace")
                if kind not in KNOWN_KINDS:
                    kind = "other"   # whatever a publisher invents: bounded memory, bounded log lines
                self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1
        if self.xpub in events:
            while True:
                try:
                    sub = self.xpub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.stats.subscriptions += 1
                self.xsub.send_multipart(sub)
        self._maybe_log_stats()
        return n

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        last_t, last_n = self._last_stats
        if now - last_t >= self.options.stats_interval_s and self.stats.messages != last_n:
            self._last_stats = (now, self.stats.messages)
            self.log.info("broker.stats", **self.stats.as_dict())


def run_broker(options: BrokerOptions, stop: threading.Event) -> BrokerStats:
    with Broker(options) as b:
        while not stop.is_set():
            b.poll_once(100)
        return b.stats
