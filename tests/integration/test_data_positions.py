"""Learners' data positions in a real Redis (common/positions.py): the shards' record only rises,
and a joining learner takes the larger of its own hash and that record."""
from __future__ import annotations

import pytest

from common import control, positions
from common.entries import BAD_ENTRIES
from common.keys import Keys

pytestmark = pytest.mark.timeout(30)


def test_positions_are_raised_per_learner_id_never_lowered():
    known = positions.raised({}, [("a", "12"), ("b", "7"), ("a", "9")])   # two lives of a: the later is further
    assert known == {"a": 12, "b": 7}
    assert positions.raised(known, [("a", "11"), ("b", None), ("c", "0")]) == {"a": 12, "b": 7, "c": 0}
    before = BAD_ENTRIES.total()
    assert positions.raised(known, [("a", "-3"), ("b", "x"), ("b", "1e30")]) == known   # not positions
    assert BAD_ENTRIES.total() == before + 3


def test_a_learner_resumes_at_the_shards_record_after_redis_restarted_empty(redis_server):
    keys = Keys("pos")
    r = control.connect(redis_server.url)
    assert positions.resume_at(r, keys, "a") == 0                     # a new id: its stream from 0
    r.hset(keys.learner("a"), "data_position", 40)
    positions.record(r, keys, {"a": 32, "b": 16})                     # the shards read a a beat earlier
    assert positions.resume_at(r, keys, "a") == 40                    # its own hash is newer
    positions.record(r, keys, {"a": 8})                               # a stale record lowers nothing
    assert r.hget(keys.positions, "a") == "32"
    redis_server.restart_empty()
    r = control.connect(redis_server.url)
    assert positions.resume_at(r, keys, "b") == 0                     # lost with Redis...
    pipe = r.pipeline(transaction=False)
    positions.record(pipe, keys, {"a": 40, "b": 16})                  # ...until a shard writes it back
    pipe.execute()
    assert (positions.resume_at(r, keys, "a"), positions.resume_at(r, keys, "b")) == (40, 16)
