"""A shard's lease in Redis: one live process per shard index (two shards must never own one
fragment). The value names its holder, ``host:pid:epoch``, and expires unless renewed; a value no
shard could have written (``lease_is_plausible``) is counted and taken back.
"""
from __future__ import annotations

import re
import time

import redis

from common import retry
from common.entries import BAD_ENTRIES, LEASE_TTL_MAX_S


class LeaseHeld(RuntimeError):
    """Another live process holds this shard's lease (two shards must never own one fragment)."""


_RENEW_LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not cur then return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 or 0 end
local ttl = redis.call('PTTL', KEYS[1])
local e = tonumber(string.match(cur, '^[^:]+:%d+:(%d+)$'))
if ttl < 0 or ttl > tonumber(ARGV[3]) or not e or e < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""
"""Renew our lease. Another value is a successor's (we stalled past the TTL: lost) only when a
shard could have written it: a ``host:pid:epoch`` holder of an epoch not older than ours, with a
TTL no longer than LEASE_TTL_MAX_S; anything else is taken back at once (returns 2)."""

_LEASE_HOLDER = re.compile(r"[^:]+:\d+:(\d+)")


def lease_is_plausible(value: str, pttl_ms: int) -> bool:
    """Whether a lease key's value could be a shard's: a ``host:pid:epoch`` holder with a TTL
    (every shard sets one) no longer than LEASE_TTL_MAX_S."""
    return bool(_LEASE_HOLDER.fullmatch(value)) and 0 < pttl_ms <= LEASE_TTL_MAX_S * 1000


def acquire_lease(r: redis.Redis, key: str, holder: str, *, ttl_s: float, wait_s: float) -> None:
    """Take the lease, waiting up to ``wait_s`` for a crashed holder's lease to expire. A value no
    shard writes (``lease_is_plausible``: no TTL, a longer one, not a holder) is stale: it is
    counted and taken once it stayed unchanged for ``ttl_s`` (so no member's write keeps a shard out)."""
    deadline = retry.Deadline.after(wait_s)
    stale: tuple[str, float] | None = None   # (implausible value, when first seen)
    cur: str | None = None

    def take() -> bool | None:
        nonlocal stale, cur
        if r.set(key, holder, nx=True, px=int(ttl_s * 1000)):
            return True
        pipe = r.pipeline(transaction=False)
        cur, pttl = pipe.get(key).pttl(key).execute()
        if cur is None or lease_is_plausible(cur, pttl):
            return None
        now = time.monotonic()
        if stale is None or stale[0] != cur:
            stale = (cur, now)
            BAD_ENTRIES.reject("lease", "not_a_lease", key=key, value=cur, ttl_ms=pttl)
        deadline.extend_to(stale[1] + ttl_s + 1.0)
        if now - stale[1] >= ttl_s and r.eval(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2], "
                "'PX', ARGV[3]) end return 0", 1, key, cur, holder, int(ttl_s * 1000)):
            return True
        return None

    if retry.until(take, deadline, interval_s=min(0.2, ttl_s / 4)) is None:
        raise LeaseHeld(f"refused: {key} is held by {cur!r} (is this shard already running?)")


def renew_lease(r: redis.Redis, key: str, holder: str, *, ttl_s: float) -> bool:
    """Extend our lease (re-take it if Redis lost it, or if it holds a value no successor shard
    could have written: counted); False if another shard's process holds it."""
    m = _LEASE_HOLDER.fullmatch(holder)
    res = r.eval(_RENEW_LEASE, 1, key, holder, int(ttl_s * 1000), int(LEASE_TTL_MAX_S * 1000),
                 int(m.group(1)) if m else 0)
    if res == 2:
        BAD_ENTRIES.reject("lease", "taken_back", key=key)
    return bool(res)


def release_lease(r: redis.Redis, key: str, holder: str) -> None:
    """Give the lease up if it is still ours (graceful stop: a successor starts at once)."""
    r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
           1, key, holder)
