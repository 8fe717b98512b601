"""Learners' data positions (docs/architecture.md, "Data position"): how many batches of its data
stream a learner id has trained on, over all its lives, so that a restarted learner (or a hot
spare or a fresh process under the same id) goes on at the next batch.

A learner writes its position in its own hash (``learner:<id>``, field ``data_position``) with
every heartbeat and when it leaves, and, before each inner step, the position after that step's
batches (field ``position_ahead``, ``learner/position_ahead.py``): a SIGKILLed life's successor
starts after every batch it took. Redis may restart empty while a learner is down, and a learner
that is down cannot write its position back, so the shards keep a copy: at each control refresh
they read the positions of the learner processes they read the token counts of (live ones, and
those that just left: their ``life`` hashes, which hold the final position of a stopped learner),
raise their ``positions`` hash with them (a field only rises: a position never goes back),
checkpoint the map and write it back after Redis restarted empty. A joining learner takes the
larger of its hash's and the shards' record.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from common.entries import BAD_ENTRIES, parse_int
from common.keys import Keys

MAX_POSITION = 2**62
"""Larger than any real stream position (a value above is not one)."""

_RAISE = """
for i = 1, #ARGV, 2 do
  local v = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') or 0
  if v > old then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 0
"""


def parse(learner_id: str, raw: Any) -> int | None:
    """A position as read (None: absent, or not a position: counted as a bad entry)."""
    if raw is None:
        return None
    position = parse_int(raw, hi=MAX_POSITION)
    if position is None:
        BAD_ENTRIES.reject("learner", "bad_number", learner=learner_id, field="data_position", value=raw)
    return position


def raised(known: Mapping[str, int], reported: Iterable[tuple[str, Any]]) -> dict[str, int]:
    """``known`` positions, each raised to the largest of those ``reported`` for its learner id
    ((id, position as read) pairs; what is not a position is left out)."""
    out = dict(known)
    for learner_id, raw in reported:
        position = parse(learner_id, raw)
        if position is not None and position > out.get(learner_id, -1):
            out[learner_id] = position
    return out


def record(r_or_pipe: Any, keys: Keys, positions: Mapping[str, int]) -> Any:
    """Raise each learner id's field of the ``positions`` hash to at least its value (never lower one)."""
    if not positions:
        return None
    args: list[Any] = []
    for learner_id, position in positions.items():
        args += [learner_id, int(position)]
    return r_or_pipe.eval(_RAISE, 1, keys.positions, *args)


def resume_at(r: Any, keys: Keys, learner_id: str) -> int:
    """Where learner ``learner_id`` goes on: the largest of its own hash's positions (as trained,
    and written ahead of a step) and the shards' record of it (0: a new id)."""
    pipe = r.pipeline(transaction=False)
    pipe.hmget(keys.learner(learner_id), "data_position", "position_ahead")
    pipe.hget(keys.positions, learner_id)
    (own, ahead), recorded = pipe.execute()
    return max(parse(learner_id, own) or 0, parse(learner_id, ahead) or 0, parse(learner_id, recorded) or 0)
