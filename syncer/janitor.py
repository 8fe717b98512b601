"""What a learner's Redis user may write, kept within bounds (docs/SECURITY.md "Redis").

A learner's user writes only its own keys (``learner:<id>``, ``hb:<id>``, ``life:<id>:*``,
``events:<id>``, ``common.redis_acl``), but Redis has no quota per user: a compromised learner
could fill them without end, or leave them without the expiry an honest learner sets. Shard 0
sweeps the run's keys a batch at a time (``SCAN``, every ``TIDY_EVERY_S``) and, for those keys:

- a key larger than its kind's bound (``MAX_BYTES``, ~16 × what an honest learner writes there)
  is removed (the learner's own record: an honest one writes it again at its next beat);
- a ``life:`` key without an expiry, or with one beyond a day, gets the day an honest learner
  gives it; after each full sweep, a learner id holding more than ``LIVES_PER_ID`` of them keeps
  its newest (the longest time to live) and loses the rest.

Each is counted (``ddloco_shard_bad_entries_total{reason}``: ``member_key.too_large``,
``member_key.no_expiry``, ``member_key.too_many_lives``) and logged once. An honest learner's keys
never come near the bounds. Owning thread: the shard's loop (``ControlPlane._refresh_control``).
"""
from __future__ import annotations

from typing import Any

from common import entries
from common.keys import Keys

TIDY_EVERY_S = 5.0
"""How often shard 0 looks at the next batch of keys."""
SCAN_COUNT = 2000
"""Keys looked at per batch (SCAN's COUNT hint)."""
MAX_BYTES = {"learner": 64 << 10, "hb": 4 << 10, "life": 64 << 10, "events": 16 << 20}
"""Largest a member's key may be (Redis ``MEMORY USAGE``): an honest learner hash or life holds
~4 KB of counters, its event stream at most ``common.keys.EVENTS_MAXLEN`` short entries."""
LIVES_PER_ID = 256
"""``life:`` keys kept per learner id (an honest id makes one per process start, each expiring
after a day: 256 restarts a day is a learner killed every 6 minutes)."""
LIFE_TTL_S = 24 * 3600
"""The expiry an honest learner gives its life keys."""
MAX_IDS_TRACKED = 100_000
"""Learner ids whose lives one sweep counts (bounded whatever is in Redis)."""


class MemberKeys:
    """The sweep's state: the SCAN cursor and, for the sweep under way, each id's life keys with
    their time to live."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.cursor = 0
        self.lives: dict[str, list[tuple[int, str]]] = {}
        self.removed = 0

    def _kind(self, key: str) -> tuple[str, str] | None:
        """(kind, learner id) of a member's key of this run; None for any other key."""
        rest = key[len(self.keys.prefix):] if key.startswith(self.keys.prefix) else ""
        kind, sep, tail = rest.partition(":")
        if not sep or kind not in MAX_BYTES or not tail:
            return None
        return kind, tail.split(":", 1)[0] if kind == "life" else tail

    def tidy(self, r: Any) -> None:
        """One batch of the sweep (raises ``redis.RedisError``: the caller's, as for any refresh)."""
        self.cursor, batch = r.scan(self.cursor, match=f"{self.keys.prefix}*", count=SCAN_COUNT)
        mine = [(k, kind) for k in batch if (kind := self._kind(k)) is not None]
        if mine:
            pipe = r.pipeline(transaction=False)
            for key, _ in mine:
                pipe.memory_usage(key, samples=0)
                pipe.pttl(key)
            res = pipe.execute(raise_on_error=False)
            self._apply(r, mine, res[0::2], res[1::2])
        if self.cursor == 0:
            self._end_sweep(r)

    def _apply(self, r: Any, mine: list[tuple[str, tuple[str, str]]], sizes: list[Any], ttls: list[Any]) -> None:
        pipe = r.pipeline(transaction=False)
        for (key, (kind, lid)), size, ttl in zip(mine, sizes, ttls):
            if not isinstance(size, int) or not isinstance(ttl, int) or ttl == -2:
                continue   # gone meanwhile
            if size > MAX_BYTES[kind]:
                entries.BAD_ENTRIES.reject("member_key", "too_large", key=key, bytes=size)
                pipe.delete(key)
                self.removed += 1
                continue
            if kind != "life":
                continue
            if ttl == -1 or ttl > LIFE_TTL_S * 1000:
                entries.BAD_ENTRIES.reject("member_key", "no_expiry", key=key)
                pipe.expire(key, LIFE_TTL_S)
                ttl = LIFE_TTL_S * 1000
            if lid in self.lives or len(self.lives) < MAX_IDS_TRACKED:
                self.lives.setdefault(lid, []).append((ttl, key))
        pipe.execute(raise_on_error=False)

    def _end_sweep(self, r: Any) -> None:
        """A full sweep done: an id with more than LIVES_PER_ID lives keeps its newest."""
        lives, self.lives = self.lives, {}
        extra: list[str] = []
        for lid, found in lives.items():
            if len(found) > LIVES_PER_ID:
                entries.BAD_ENTRIES.reject("member_key", "too_many_lives", learner=lid, lives=len(found))
                extra += [key for _, key in sorted(found, reverse=True)[LIVES_PER_ID:]]
        for i in range(0, len(extra), 1000):
            r.delete(*extra[i:i + 1000])
        self.removed += len(extra)
