"""The run's global token count (the learners' LR schedule runs on it), kept so that no Redis
restart can lose or double-count a token, and so that no learner moves it by more than about
one learner's share.

Every learner process reports its *own cumulative* token count (it knows it exactly) in its own
hash (``learner:<id>``, field ``tokens``, with its ``incarnation``); it writes no shared key. The
shards (trusted) read it with the live learners and accept it into the ``tokens:by`` hash, one
field per process (``keys.token_share``: learner id and incarnation), with every learner id's
accepted total capped at ``SHARE_CAP_FACTOR`` × the lower median of the ids' totals
(``accept_claims``): a compromised learner that claims 10^18 tokens adds at most twice a median
learner's count, and what it had added stays frozen once it is gone. A field only rises (max
per field), and the same script raises the ``tokens`` total by what the fields rose, so the total
is always the sum of the fields and a write is idempotent. Every shard remembers the whole hash
(read at each control refresh, checkpointed) and writes it back after Redis restarted empty,
which also carries the count over to a resumed run (``ddloco up --resume``).

A learner's view of the count never goes back (``advance_seen``): right after an empty restart
the total holds only the shares written so far, and the learner keeps counting on from what it
had seen until the total is above it again.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from common.entries import BAD_ENTRIES, parse_int
from common.keys import Keys, token_share

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


SHARE_CAP_FACTOR = 2.0
"""A learner id's accepted tokens are at most this × the lower median of the ids' totals."""


def learner_of(field: str) -> str:
    """The learner id of a ``tokens:by`` field (``<id>:<incarnation>``)."""
    return field.rpartition(":")[0] or field


def accept_claims(accepted: Mapping[str, Any], claims: Mapping[str, Any], *, live: Iterable[str] = (),
                  floor: int = 0, factor: float = SHARE_CAP_FACTOR) -> dict[str, int]:
    """The ``tokens:by`` shares after taking in ``claims`` (field -> the cumulative count a learner
    process reports), given the shares ``accepted`` so far. A share never goes down; a learner
    id's total (all its processes) rises to at most ``factor`` × the lower median of the totals
    as claimed of the ``live`` ids and of the ids with tokens (``EARLIER`` left out), and never
    less than ``floor``: one id cannot raise the count by more than about ``factor`` learners'
    shares, not even while the others are still joining at 0. Fields not in ``claims``
    (processes that are gone) keep what they had."""
    out = {k: int(v) for k, v in accepted.items()}
    totals: dict[str, int] = {}
    for f, v in out.items():
        totals[learner_of(f)] = totals.get(learner_of(f), 0) + v
    wanted = {**{lid: 0 for lid in live}, **totals}
    for f, c in claims.items():
        wanted[learner_of(f)] = wanted.get(learner_of(f), 0) + max(0, int(c) - out.get(f, 0))
    counted = sorted(v for lid, v in wanted.items() if (v > 0 or lid in live) and lid != EARLIER)
    if not counted:
        return out
    cap = max(int(floor), int(factor * counted[(len(counted) - 1) // 2]))
    for f, c in sorted(claims.items()):
        lid = learner_of(f)
        rise = min(max(0, int(c) - out.get(f, 0)), max(0, cap - totals.get(lid, 0)))
        if rise:
            out[f] = out.get(f, 0) + rise
            totals[lid] = totals.get(lid, 0) + rise
    return out


def claims_of(learners: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """``{<id>:<incarnation>: tokens}`` of learner hashes (``control.live_learners``); a hash
    without an incarnation or with a count that is not a non-negative integer is left out."""
    return claims_of_lives({(lid, h.get("incarnation") or ""): h.get("tokens") for lid, h in learners.items()})


def claims_of_lives(counts: Mapping[tuple[str, str], Any]) -> dict[str, int]:
    """``{<id>:<incarnation>: tokens}`` of ``{(id, incarnation): tokens as read}``; what is not a
    non-negative integer below 2^62, or has no incarnation, is left out."""
    out: dict[str, int] = {}
    for (lid, inc), value in counts.items():
        try:
            n = int(str(value))
        except ValueError:
            continue
        if inc and 0 <= n < 2 ** 62:
            out[token_share(lid, inc)] = n
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


def parse_total(raw: Any) -> int | None:
    """The run's count as read from ``keys.tokens`` (0 when absent); None when it is not a count
    (counted: common.entries.BAD_ENTRIES)."""
    total = parse_int(raw, hi=SHARE_MAX) if raw is not None else 0
    if total is None:
        BAD_ENTRIES.reject("tokens", "bad_total", value=raw)
    return total


def read_total(r: Any, keys: Keys) -> int:
    """The run's token count as Redis holds it (0 when absent or not a count: counted)."""
    return parse_total(r.get(keys.tokens)) or 0


def advance_seen(seen: tuple[int, int], total: int, ours: int) -> tuple[int, int]:
    """A learner's view of the run's count, ``(count, its own tokens then)``, after reading
    ``total`` with ``ours`` tokens of its own: the total, unless that is below what the view
    had already counted (Redis restarted empty and the other shares are not back yet). The
    estimate ``count + (own tokens now − own tokens then)`` never goes back."""
    count, ours_then = seen
    return max(int(total), count + (ours - ours_then)), ours
