"""The broker: a ZeroMQ XSUB/XPUB forwarder with message and byte counters.

Publishers (learners' updates, shards' opens and fragments) connect PUB sockets to the XSUB
endpoint; subscribers connect SUB sockets to the XPUB endpoint. Subscriptions flow back
upstream. The XPUB side never blocks: a slow subscriber loses messages at its high-water mark
(counted by receivers through versions and repaired), it never stalls the others. That is why
XPUB_NODROP is deliberately not set (see DESIGN.md, pitfalls).

With CURVE keys (``keys_dir``) both sockets are CURVE servers: only the run's listed keys connect
(refused handshakes are counted, ``auth_failures``), and a published message goes on only if its
kind suits the publisher's role and its header names the publisher as sender
(``common.security.authorize``); everything else is dropped and counted by reason (``refused``).

What one member can cost it is bounded too (``broker.limits``, docs/SECURITY.md): a shard's
``open``/``frag``/``need`` goes on only from the fragment's owner (``not_owner``; refused while S
is unknown, ``shards_unknown``); every frame is at most ``max_message_bytes`` (libzmq drops the
connection of a publisher that sends a larger one) and a subscription at most 1 KiB; each
member's messages pass a token bucket of its role (``rate_limited``); each member holds at most
``max_subscriptions`` topics (the XPUB is manual: the broker applies a subscription only within
that cap, ``too_many_subscriptions``), and a member refused ``limits.EVICT_AFTER`` subscriptions is
evicted: its key banned, the XPUB bound anew (``evicted``, ``Broker._evict``).

Threads: the broker's loop (the thread that enters ``Broker`` and calls ``poll_once``) owns every
attribute of ``Broker``, its limits and its counters (``broker.stats``); the metrics endpoint's
thread only reads the counters, as copies (``readings``); the ZAP handler's thread owns its
refusal counts (``common.security.ZapHandler.failures``), which the loop copies in one step.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from common import metrics, wire
from common.config import ConfigError, check_value, endpoint_problem, redis_url_problem
from common.log import get_logger
from common.links import keep_alive
from common.security import Security, ZapHandler, authorize, frame_user_id, owner_refusal
from broker import ipc, limits
from broker.stats import BrokerStats, tally


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
    subscriber only; 200 holds the bursts of a run (P/H merged fragments per learner step: two
    with the defaults) while bounding memory when fragments are large."""
    stats_interval_s: float = 10.0
    """Log counters this often (only when they changed)."""
    keys_dir: str = ""
    """CURVE keys made by ``ddloco keys`` (the broker's secret, the run's allow list); empty: no
    authentication or encryption (``--insecure``)."""
    redis_url: str = ""
    run_id: str = ""
    """With both: the counters also go to the run's ``broker`` hash in Redis every second (what
    ``ddloco up`` reports as ``auth_failures`` and ``broker_refused``)."""
    metrics_port: int = -1
    """Serve Prometheus metrics at ``http://metrics_host:metrics_port/metrics`` (-1: none; 0: any
    free port, logged)."""
    metrics_host: str = "127.0.0.1"
    """Address of the metrics endpoint (0.0.0.0: every interface, e.g. in a container)."""
    shards: int = 0
    """S, the run's shard count (fragment p is owned by ``shard<p % S>``); 0: read from the run's
    config in Redis (``--run-id``). Until S is known, shards' messages are refused (CURVE only)."""
    fragments: int = 0
    """P, the run's fragment count, which sizes the rate limits and the subscription cap; 0: read
    from the run's config in Redis, else ``DEFAULT_FRAGMENTS`` is assumed."""
    max_message_bytes: int = 128 << 20
    """Largest frame a publisher may send (ZMQ_MAXMSGSIZE: a larger one drops its connection). The
    largest legitimate frame is the largest fragment at fp32 plus its header
    (``common.wire.max_frame_bytes``; `ddloco up` passes it); the default holds fragments of up to
    32 M values."""
    max_subscriptions: int = 0
    """Topics a member may hold (CURVE only); 0: ``2 x P + 16`` (``broker.limits.subscription_cap``)."""

    def __post_init__(self) -> None:
        check_value("broker.xsub_bind", self.xsub_bind, endpoint_problem)
        check_value("broker.xpub_bind", self.xpub_bind, endpoint_problem)
        if self.redis_url:
            check_value("broker.redis_url", self.redis_url, redis_url_problem)
        for name in ("shards", "fragments", "max_subscriptions"):
            if not 0 <= getattr(self, name) <= MAX_COUNT:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"broker.{name} ({flag}) must be in [0, {MAX_COUNT}], got {getattr(self, name)}")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"broker.max_message_bytes (--max-message-mb) must be >= 1024 bytes, "
                              f"got {self.max_message_bytes}")


MAX_COUNT = 1 << 20
"""Largest S or P the broker accepts (from its options or the run's config in Redis)."""
DEFAULT_FRAGMENTS = 64
"""P assumed for the limits when neither the options nor Redis tell it."""
MAX_SUBSCRIPTION_BYTES = 1024
"""ZMQ_MAXMSGSIZE of the XPUB side: subscribers send only subscriptions (1 byte + a short topic;
the limit is on the wire's frames, CURVE's handshake commands included, hence not 1 + MAX_TOPIC_BYTES)."""
MAX_FRAMES = 16
"""A message of more frames is dropped (``too_many_frames``): topic, header and a codec's frames."""


KNOWN_KINDS = frozenset(wire.KINDS)
"""Message kinds counted by name; any other topic is counted as "other"."""


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
        self._last_redis = 0.0
        self._redis: Any = None
        self.security = Security(options.keys_dir, "broker") if options.keys_dir else None
        self.zap: ZapHandler | None = None
        self._handshake_failures: dict[str, int] = {}
        self.metrics: metrics.MetricsServer | None = None
        self.shards = options.shards
        """S as known now (0: unknown); pinned once known (a later change in Redis is logged, not followed)."""
        self.fragments = options.fragments
        self.rates = limits.RateLimits(limits.member_rates(self.fragments or DEFAULT_FRAGMENTS))
        self.subs = limits.Subscriptions(options.max_subscriptions
                                         or limits.subscription_cap(self.fragments or DEFAULT_FRAGMENTS))

    def __enter__(self) -> "Broker":
        self._ctx = zmq.Context()
        if self.security is not None:
            self.zap = self.security.start_zap(self._ctx)
        self._make_sockets(self._ctx)
        if self.options.redis_url and self.options.run_id:
            from common import control
            self._redis = control.connect(self.options.redis_url)
            self._read_run_facts()
        self._bind()
        self._log_start()
        try:
            self.metrics = metrics.start(role="broker", run_id=self.options.run_id, member="broker",
                                         read=self.readings, host=self.options.metrics_host,
                                         port=self.options.metrics_port,
                                         info={"curve": str(self.security is not None).lower()})
        except BaseException:
            self.__exit__(None, None, None)
            raise
        if self.metrics is not None:
            self.log.info("broker.metrics", url=self.metrics.url)
        return self

    def _make_sockets(self, ctx: zmq.Context) -> None:
        """XSUB and XPUB with their buffers and size limits; CURVE servers with keys (the XPUB
        then manual: subscriptions applied by the broker, per member, ``broker.limits``)."""
        self.xsub = self._socket(ctx, zmq.XSUB)
        self.xsub.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
        self.xpub = self._xpub_socket(ctx)

    def _socket(self, ctx: zmq.Context, kind: int) -> zmq.Socket:
        s = ctx.socket(kind)
        keep_alive(s)   # a subscriber whose link went dark is dropped, not buffered for
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, self.options.hwm_messages)
        s.setsockopt(zmq.RCVHWM, self.options.hwm_messages)
        if self.security is not None:
            self.security.server(s, "broker")
        return s

    def _xpub_socket(self, ctx: zmq.Context) -> zmq.Socket:
        s = self._socket(ctx, zmq.XPUB)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
        if self.security is not None:
            s.setsockopt(zmq.XPUB_MANUAL, 1)
        return s

    def _bind(self) -> None:
        """Bind both sockets (an ipc:// path only if it is free, its socket file then this user's
        alone: ``broker.ipc``) and poll them, with the handshakes refused before ZAP (a client
        without CURVE, garbage) watched on their monitor sockets."""
        for sock, name, endpoint in ((self.xsub, "broker.xsub_bind (--xsub)", self.options.xsub_bind),
                                     (self.xpub, "broker.xpub_bind (--xpub)", self.options.xpub_bind)):
            check_value(name, endpoint, ipc.bind_problem)
            sock.bind(endpoint)
            ipc.restrict(endpoint)
        self.xsub_endpoint = self.xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.xpub_endpoint = self.xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.poller = zmq.Poller()
        self.poller.register(self.xsub, zmq.POLLIN)
        self.poller.register(self.xpub, zmq.POLLIN)
        self._monitors = []
        if self.security is not None:
            events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            self._monitors = [s.get_monitor_socket(events) for s in (self.xsub, self.xpub)]
            for m in self._monitors:
                self.poller.register(m, zmq.POLLIN)

    def _log_start(self) -> None:
        self.log.info("broker.started", xsub=self.xsub_endpoint, xpub=self.xpub_endpoint,
                      hwm=self.options.hwm_messages, curve=self.security is not None, shards=self.shards,
                      fragments=self.fragments, max_message_bytes=self.options.max_message_bytes,
                      max_subscriptions=self.subs.cap)
        if self.security is None:
            self.log.warning("broker.insecure", detail="no CURVE: anyone who reaches these ports can publish "
                             "and subscribe (--insecure)")

    def readings(self) -> list[metrics.Reading]:
        """What ``/metrics`` shows, read on the scrape's thread (``BrokerStats.readings``)."""
        return self.stats.readings()

    def __exit__(self, *exc) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        self.log.info("broker.stopped", **self.stats.as_dict())
        if self._ctx is not None:
            for m in self._monitors:
                m.close(linger=0)
            if self.security is not None:
                self.security.stop_zap(self._ctx)
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
                if self.security is not None:
                    reason = self._refusal(frames) or self._limit_refusal(frames)
                    if reason is not None:
                        self._count(reason)
                        continue
                try:
                    self.xpub.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass  # XPUB drops at HWM on its own; Again only without subscribers
                n += 1
                self.stats.messages += 1
                nbytes = sum(len(f.buffer) for f in frames)
                self.stats.bytes += nbytes
                kind = wire.topic_kind(bytes(frames[0].buffer))
                if kind not in KNOWN_KINDS:
                    kind = "other"   # whatever a publisher invents: bounded memory, bounded log lines
                tally(self.stats.by_kind, kind)
                tally(self.stats.bytes_by_kind, kind, nbytes)
        for m in self._monitors:
            if m in events:
                self._on_monitor(m)
        if self.xpub in events:
            while True:
                try:
                    sub = self.xpub.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.stats.subscriptions += 1
                if self.security is None:
                    self.xsub.send_multipart(sub)
                else:
                    self._on_subscription(sub)
        self._maybe_log_stats()
        return n

    def _on_monitor(self, m: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message
        for _ in range(1000):
            try:
                ev = recv_monitor_message(m, zmq.NOBLOCK)
            except zmq.Again:
                return
            except (zmq.ZMQError, ValueError):
                continue
            del ev   # a client without CURVE, or not speaking ZMTP: refused before ZAP
            tally(self._handshake_failures, "handshake")

    @staticmethod
    def _refusal(frames: list[zmq.Frame]) -> str | None:
        if len(frames) < 2:
            return "malformed"
        return authorize(frame_user_id(frames[0]), bytes(frames[0].buffer), bytes(frames[1].buffer))

    def _count(self, reason: str) -> None:
        tally(self.stats.refused, reason)

    def _limit_refusal(self, frames: list[zmq.Frame]) -> str | None:
        """After the role rules: the owner rule, the frame count and the member's rate."""
        if len(frames) > MAX_FRAMES:
            return "too_many_frames"
        user = frame_user_id(frames[0])
        reason = owner_refusal(user, bytes(frames[0].buffer), self.shards)
        if reason is not None:
            return reason
        role = user.partition(":")[0]
        return None if self.rates.allow(user, role, time.monotonic()) else "rate_limited"

    def _on_subscription(self, frames: list[zmq.Frame]) -> None:
        """One message from a subscriber (manual XPUB): a (un)subscription applied to its pipe
        within its member's cap, a topic passed upstream once (``broker.limits.Subscriptions``);
        anything else is dropped."""
        data = bytes(frames[0].buffer) if len(frames) == 1 else b""
        if not data or data[0] not in (0, 1):
            self._count("malformed")
            return
        user = frame_user_id(frames[0])
        topic = data[1:]
        if not user:          # libzmq: a subscriber disconnected (its pipe's filter is gone already)
            return
        verdict = self.subs.subscribe(user, topic) if data[0] == 1 else self.subs.unsubscribe(user, topic)
        if verdict.reason is not None:
            self._count(verdict.reason)
            # not while P is unknown: the cap is then a guess (P = 64) a shard of a larger run exceeds
            if (self.fragments or self.options.max_subscriptions) and self.subs.evict_due(user):
                self._evict(user)
                return
        if verdict.honor:
            self.xpub.setsockopt(zmq.SUBSCRIBE if data[0] == 1 else zmq.UNSUBSCRIBE, topic)
        if verdict.forward:
            self.xsub.send(data)

    def _evict(self, user: str) -> None:
        """A member that keeps asking for subscriptions beyond its cap: libzmq keeps a record of
        every one its connection sent (manual XPUB) until that connection closes, and a bound
        socket cannot close one peer's connection. So the member's key is banned (ZAP refuses it
        from now on, for both sockets) and the XPUB is bound anew: every connection to it closes,
        freeing the records, and the honest subscribers reconnect and subscribe again at once
        (libzmq's reconnect, ~0.1 s: the messages of that gap are missed, which receivers repair
        as for any drop at the high-water mark). Its publisher connection stays until it drops."""
        assert self.zap is not None and self._ctx is not None
        self.zap.ban(user)
        self._count("evicted")
        self.log.warning("broker.member_evicted", member=user, refused_subscriptions=self.subs.evict_after,
                         detail="subscriptions beyond its cap: its key is refused from now on")
        old, endpoint = self.xpub, self.xpub_endpoint
        self.poller.unregister(old)
        if self._monitors:
            old.disable_monitor()
            monitor = self._monitors.pop()   # the XPUB's (appended last)
            self.poller.unregister(monitor)
            monitor.close(linger=0)
        old.close(linger=0)
        self.xpub = self._xpub_socket(self._ctx)
        _bind_again(self.xpub, endpoint)
        self.poller.register(self.xpub, zmq.POLLIN)
        if self.security is not None:
            monitor = self.xpub.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            self._monitors.append(monitor)
            self.poller.register(monitor, zmq.POLLIN)

    def _read_run_facts(self) -> None:
        """S and P from the run's config in Redis, until both are known (then pinned)."""
        import json
        import redis as redis_lib
        from common.keys import Keys
        if self.shards and self.fragments:
            return
        try:
            shards, blob = self._redis.hmget(Keys(self.options.run_id).config, ["shards", "blob"])
        except redis_lib.RedisError:
            return
        s = _count_value(shards)
        if not self.shards and s:
            self.shards = s
            self.log.info("broker.shards", shards=s, source="redis")
        try:
            p = _count_value(json.loads(blob)["config"]["algo"]["fragments"]) if blob else 0
        except (ValueError, KeyError, TypeError):
            p = 0
        if not self.fragments and p:
            self.fragments = p
            self.rates = limits.RateLimits(limits.member_rates(p))
            if not self.options.max_subscriptions:
                self.subs.cap = limits.subscription_cap(p)
            self.log.info("broker.fragments", fragments=p, max_subscriptions=self.subs.cap, source="redis")

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if self.zap is not None:
            self.stats.auth_failures = {**self.zap.failures, **self._handshake_failures}
        if self._redis is not None and now - self._last_redis >= 1.0:
            self._last_redis = now
            self._read_run_facts()
            self._publish_stats()
        last_t, last_n = self._last_stats
        if now - last_t >= self.options.stats_interval_s and self.stats.messages != last_n:
            self._last_stats = (now, self.stats.messages)
            self.log.info("broker.stats", **self.stats.as_dict())


    def _publish_stats(self) -> None:
        import json
        import redis as redis_lib
        from common.keys import Keys
        try:
            self._redis.hset(Keys(self.options.run_id).broker, mapping={
                **self.stats.redis_fields(), "curve": int(self.security is not None), "updated_at": time.time(),
                "limits": json.dumps({"shards": self.shards, "fragments": self.fragments,
                                      "max_message_bytes": self.options.max_message_bytes,
                                      "max_subscriptions": self.subs.cap})})
        except redis_lib.RedisError:
            pass  # Redis restarting: the next second writes it again


def _bind_again(sock: zmq.Socket, endpoint: str, timeout_s: float = 5.0) -> None:
    """Bind ``sock`` where a just-closed socket was bound: libzmq closes the old listener on its
    I/O thread, so a TCP port may still be taken for a few milliseconds (an ipc:// path is taken
    over at once: libzmq replaces the file it finds there, and does not remove it on close)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            break
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    ipc.restrict(endpoint)


def _count_value(raw: Any) -> int:
    """A count read from Redis (S or P): an int in [1, MAX_COUNT], else 0 (unknown)."""
    try:
        v = int(raw)
    except (TypeError, ValueError):
        return 0
    return v if 1 <= v <= MAX_COUNT else 0


def run_broker(options: BrokerOptions, stop: threading.Event) -> BrokerStats:
    with Broker(options) as b:
        while not stop.is_set():
            b.poll_once(100)
        return b.stats
