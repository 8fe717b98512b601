"""The run's global token count (the learners' LR schedule runs on it), kept so that no Redis
restart can lose or double-count a token.

Every learner process writes its *own cumulative* token count (it knows it exactly) into the
``tokens:by`` hash, one field per process (``keys.token_share``: learner id and incarnation). A
field only rises (max per field), and the same script raises the ``tokens`` total by what the
fields rose, so the total is always the sum of the fields and a write is idempotent: after Redis
restarted empty a learner's next heartbeat puts its share back exactly, tokens trained between
the restart and that write included. A process that is gone cannot write its share again: every
shard remembers the whole hash (read at each control refresh, checkpointed) and writes it back
the same way, which also carries the count over to a resumed run (``ddloco up --resume``).

A learner's view of the count never goes back (``advance_seen``): right after an empty restart
the total holds only the shares written so far, and the learner keeps counting on from what it
had seen until the total is above it again.
"""
from __future__ import annotations

from typing import Any, Mapping

from common.entries import BAD_ENTRIES, parse_int
from common.keys import Keys

_RECORD = """
local total = tonumber(redis.call('GET', KEYS[2]) or '0')
if not total or total < 0 then  -- not a count (a member overwrote it): the sum of the shares
  total = 0
  local all = redis.call('HGETALL', KEYS[1])
  for j = 2, #all, 2 do
    local s = tonumber(all[j])
    if s and s > 0 then total = total + s end
  end
end
for i = 1, #ARGV, 2 do
  local v = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') or 0  -- not a number: replaced
  if v > old then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    total = total + (v - old)
  end
end
redis.call('SET', KEYS[2], total)
return total
"""

EARLIER = "earlier"
"""The share of a count restored from a shard checkpoint written before shares existed."""


def record(r_or_pipe: Any, keys: Keys, shares: Mapping[str, int]) -> Any:
    """Raise each share of the run's count to at least its value (never lower one) and the total
    with them, atomically; returns the total now held (on a pipeline: its entry in ``execute()``)."""
    args: list[Any] = []
    for field, value in shares.items():
        args += [field, int(value)]
    res = r_or_pipe.eval(_RECORD, 2, keys.token_shares, keys.tokens, *args)
    return int(res) if isinstance(res, (int, str, bytes)) else res


def merge_shares(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, int]:
    """Every share of either map at the larger of its two values (what a shard remembers after
    reading the hash: nothing it knew is forgotten, nothing is counted twice)."""
    out = {k: int(v) for k, v in ours.items()}
    for k, v in theirs.items():
        share = parse_share(k, v)
        if share is not None:
            out[k] = max(out.get(k, 0), share)
    return out


SHARE_MAX = 2**53
"""No learner process trains more tokens than this: a share above it is not one."""


def parse_share(field: str, raw: Any) -> int | None:
    """A ``tokens:by`` value as a learner writes it (an int in [0, SHARE_MAX]); else counted
    (common.entries.BAD_ENTRIES) and None."""
    share = parse_int(raw, hi=SHARE_MAX)
    if share is None:
        BAD_ENTRIES.reject("tokens", "bad_share", field=field, value=raw)
    return share


def read_total(r: Any, keys: Keys) -> int:
    """The run's token count as Redis holds it (0 when absent or not a count: counted)."""
    raw = r.get(keys.tokens)
    total = parse_int(raw, hi=SHARE_MAX) if raw is not None else 0
    if total is None:
        BAD_ENTRIES.reject("tokens", "bad_total", value=raw)
    return total or 0


def advance_seen(seen: tuple[int, int], total: int, ours: int) -> tuple[int, int]:
    """A learner's view of the run's count, ``(count, its own tokens then)``, after reading
    ``total`` with ``ours`` tokens of its own: the total, unless that is below what the view
    had already counted (Redis restarted empty and the other shares are not back yet). The
    estimate ``count + (own tokens now − own tokens then)`` never goes back."""
    count, ours_then = seen
    return max(int(total), count + (ours - ours_then)), ours
