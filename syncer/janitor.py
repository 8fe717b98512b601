"""What a learner's Redis user may write, kept within bounds (docs/SECURITY.md "Redis").

A learner's user writes only its own keys (``learner:<id>``, ``hb:<id>``, ``life:<id>:*``,
``events:<id>``, ``common.redis_acl``), but Redis has no quota per user: a compromised learner
could fill them without end, or leave them without the expiry an honest learner sets. Shard 0
sweeps the run's keys a batch at a time (``SCAN``, every ``TIDY_EVERY_S``) and, for those keys:

- a key larger than its kind's bound (``MAX_BYTES``, ~16 × what an honest learner writes there)
  is removed (the learner's own record: an honest one writes it again at its next beat);
- a ``life:`` key without an expiry, or with one beyond a day, gets the day an honest learner
  gives it; a learner id keeps at most ``LIVES_PER_ID`` of those a sweep has seen (the longest
  time to live; one beyond that is removed as soon as it is seen);
- a heartbeat without an expiry, or with one beyond ``HB_TTL_MAX_S``, gets ``HB_TTL_MAX_S`` (an
  id whose heartbeat never expires would stay a member after it stopped).

Each is counted (``ddloco_shard_bad_entries_total{reason}``: ``member_key.too_large``,
``member_key.no_expiry``, ``member_key.too_many_lives``) and logged once. Keys are removed with
UNLINK (freed off Redis's main thread). An honest learner's keys never come near the bounds.
Owning thread: the shard's loop (``ControlPlane._refresh_control``).
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
HB_TTL_MAX_S = 60
"""Longest heartbeat expiry left in place (an honest one: ``learner.heartbeat_ttl_s``, 2.5 s)."""
MAX_IDS_TRACKED = 1000
"""Learner ids whose lives one sweep counts (with LIVES_PER_ID each: bounded whatever is in Redis)."""


class MemberKeys:
    """The sweep's state: the SCAN cursor and, for the sweep under way, each id's life keys with
    their time to live."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.cursor = 0
        self.lives: dict[str, dict[str, int]] = {}
        """Per learner id, the life keys this sweep has seen and kept -> their time to live (ms)."""
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
            self.lives = {}   # a full sweep done: the next one counts the lives afresh (expired ones gone)

    def _apply(self, r: Any, mine: list[tuple[str, tuple[str, str]]], sizes: list[Any], ttls: list[Any]) -> None:
        pipe = r.pipeline(transaction=False)
        for (key, (kind, lid)), size, ttl in zip(mine, sizes, ttls):
            if not isinstance(size, int) or not isinstance(ttl, int) or ttl == -2:
                continue   # gone meanwhile
            if size > MAX_BYTES[kind]:
                entries.BAD_ENTRIES.reject("member_key", "too_large", key=key, bytes=size)
                self._remove(pipe, key)
                continue
            if kind == "hb" and (ttl == -1 or ttl > HB_TTL_MAX_S * 1000):
                entries.BAD_ENTRIES.reject("member_key", "no_expiry", key=key)
                pipe.expire(key, HB_TTL_MAX_S)
            if kind != "life":
                continue
            if ttl == -1 or ttl > LIFE_TTL_S * 1000:
                entries.BAD_ENTRIES.reject("member_key", "no_expiry", key=key)
                pipe.expire(key, LIFE_TTL_S)
                ttl = LIFE_TTL_S * 1000
            self._count_life(pipe, lid, key, ttl)
        pipe.execute(raise_on_error=False)

    def _count_life(self, pipe: Any, lid: str, key: str, ttl: int) -> None:
        """Keep at most LIVES_PER_ID lives of ``lid`` (those with the longest time to live): one
        beyond is removed at once, so neither Redis nor this record grows past the bound."""
        if lid not in self.lives and len(self.lives) >= MAX_IDS_TRACKED:
            return
        kept = self.lives.setdefault(lid, {})
        kept[key] = ttl      # SCAN may return a key twice: counted once
        if len(kept) <= LIVES_PER_ID:
            return
        oldest = min(kept, key=kept.__getitem__)
        del kept[oldest]
        entries.BAD_ENTRIES.reject("member_key", "too_many_lives", learner=lid)
        self._remove(pipe, oldest)

    def _remove(self, pipe: Any, key: str) -> None:
        pipe.unlink(key)
        self.removed += 1
