"""What one member may cost the broker: decisions without sockets, tested at a fixed ``now``.

- ``RateLimits``: a token bucket per authenticated member name (the ZAP User-Id), refilled at
  the rate of its role; a message beyond it is dropped and counted (``rate_limited``). Members
  are named by the allow list, so the table holds at most one bucket per listed key.
- ``Subscriptions``: the distinct topics each member holds, at most ``cap``, each at most
  ``max_topic_bytes`` long. The broker's XPUB runs in manual mode: a subscription takes effect
  (and goes upstream to the publishers, once per topic) only when ``subscribe`` says so. libzmq
  still records every subscription a connection sends, applied or not, until that connection
  closes: a member refused ``evict_after`` times is evicted (``Subscriptions.evict_due``: the
  broker bans its key and closes the connections it held, which frees that record).

Owning thread: the broker's loop (``Broker.poll_once``); nothing else reads or writes these.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Rate:
    """A token bucket's shape: ``per_s`` messages per second on average, ``burst`` at once."""

    per_s: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.per_s > 0 and self.burst >= 1):
            raise ValueError(f"a rate needs per_s > 0 and burst >= 1, got {self.per_s}/s burst {self.burst}")


def member_rates(fragments: int, *, learner_per_fragment_s: float = 10.0, shard_per_fragment_s: float = 50.0) -> dict[str, Rate]:
    """Default rates by role for a run of ``fragments`` fragments (P).

    A learner answers each open round of a fragment once, and a fragment has one round open at
    a time: even the fastest runs measured merge well under one round per fragment per second
    (11.4 merges/s over P = 24 fragments in `make demo`), so 10 x P answers/s is >= 10 x an
    honest learner's peak; the burst (4 x P + 64) holds one answer and one copy (``have``) of
    every fragment at once (a restarted shard asks for all of them). Shards are trusted but
    bounded too: opens, re-opens and merged fragments, 50 x P/s, burst 10 x P + 256."""
    p = max(1, int(fragments))
    return {"learner": Rate(per_s=learner_per_fragment_s * p, burst=4 * p + 64),
            "shard": Rate(per_s=shard_per_fragment_s * p, burst=10 * p + 256)}


class RateLimits:
    """One token bucket per member; ``allow(member, role, now)`` takes a token or says no."""

    def __init__(self, rates: dict[str, Rate]) -> None:
        self.rates = dict(rates)
        self._buckets: dict[str, tuple[float, float]] = {}
        """member -> (tokens, time of the last refill)."""

    def allow(self, member: str, role: str, now: float) -> bool:
        rate = self.rates.get(role)
        if rate is None:
            return True
        tokens, at = self._buckets.get(member, (rate.burst, now))
        tokens = min(rate.burst, tokens + max(0.0, now - at) * rate.per_s)
        if tokens < 1.0:
            self._buckets[member] = (tokens, now)
            return False
        self._buckets[member] = (tokens - 1.0, now)
        return True


def subscription_cap(fragments: int) -> int:
    """Topics a member may hold for a run of P fragments: a shard subscribes to the answers and
    copies of each fragment it owns (2 x P when it owns them all), a learner to three prefixes;
    16 spare for monitors and tools."""
    return 2 * max(1, int(fragments)) + 16


MAX_TOPIC_BYTES = 256
"""Longest topic honored: ``<run>|<kind>.<pppp>`` with a run id of at most 128 characters fits."""
EVICT_AFTER = 64
"""Distinct topics refused after which a member is evicted: an honest member is never refused one
(a learner holds 3 topics, a shard 2 per owned fragment, all within the cap), and each refused one
costs libzmq's record of the connection a trie node per byte of its topic (at most the XPUB's
1 KiB frame limit) until the connection closes: at most ~4 MiB before the eviction frees it."""


@dataclass(frozen=True)
class Verdict:
    """What to do with one subscription message: apply it to the subscriber's pipe (``honor``),
    pass it to the publishers (``forward``), or neither with the reason it was refused."""

    honor: bool
    forward: bool
    reason: str | None = None


class Subscriptions:
    """The distinct topics each member has held (at most ``cap``) and the topics sent upstream.

    libzmq reports a subscriber's disconnection as one unsubscription per topic of that pipe,
    without the member and whether or not other pipes still hold the topic (or whether the broker
    had applied it), so a topic is never withdrawn upstream on such a report: a topic goes
    upstream once, on its first holder, and stays. A member's topics count toward its cap for its
    lifetime (an unsubscription applies to its pipe but does not free room): the publishers then
    hold at most ``cap`` topics per member name, whatever members subscribe, unsubscribe or
    reconnect."""

    def __init__(self, cap: int, max_topic_bytes: int = MAX_TOPIC_BYTES, evict_after: int = EVICT_AFTER) -> None:
        self.cap = cap
        self.max_topic_bytes = max_topic_bytes
        self.evict_after = evict_after
        self.by_member: dict[str, set[bytes]] = {}
        self.upstream: set[bytes] = set()
        self.refused: dict[str, set[bytes]] = {}
        """The distinct topics refused per member since it was last evicted (at most ``evict_after``
        each; members are listed keys: bounded). Distinct: an honest member that reconnects and
        asks again for what was refused before does not come nearer to eviction."""

    def subscribe(self, member: str, topic: bytes) -> Verdict:
        if len(topic) > self.max_topic_bytes:
            return self._refuse(member, "topic_too_long", topic)
        mine = self.by_member.setdefault(member, set())
        if topic not in mine and len(mine) >= self.cap:
            return self._refuse(member, "too_many_subscriptions", topic)
        mine.add(topic)
        first = topic not in self.upstream
        self.upstream.add(topic)
        return Verdict(True, first)

    def _refuse(self, member: str, reason: str, topic: bytes = b"") -> Verdict:
        seen = self.refused.setdefault(member, set())
        if len(seen) < self.evict_after:
            seen.add(topic[:self.max_topic_bytes + 1])
        return Verdict(False, False, reason)

    def evict_due(self, member: str) -> bool:
        """The member has been refused ``evict_after`` distinct topics: evict it (the count starts
        again, so one eviction per ``evict_after`` refusals at most)."""
        if len(self.refused.get(member, ())) < self.evict_after:
            return False
        self.refused.pop(member, None)
        return True

    def unsubscribe(self, member: str, topic: bytes) -> Verdict:
        """A member's own unsubscription: applied to its pipe if it held the topic; never upstream."""
        return Verdict(topic in self.by_member.get(member, ()), False)
