"""Learners' data positions in a real Redis (common/positions.py): the shards' record only rises,
and a joining learner takes the larger of its own hash and that record."""
from __future__ import annotations

import pytest

from common import control, positions
from common.config import AlgoConfig, RunConfig
from common.entries import BAD_ENTRIES
from common.keys import Keys
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(90)


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


def test_a_shard_restarted_from_its_checkpoint_puts_back_the_position_of_a_learner_that_is_down(
        make_cluster, redis_server):
    """A learner trains 30 batches and leaves; its shard stops (checkpoint) and Redis restarts
    empty: the restarted shard writes the position back from its checkpoint, and the learner,
    started again, goes on at batch 30."""
    cluster = make_cluster(RunConfig(algo=AlgoConfig(fragments=4, sync_every_steps=4, inner_warmup_steps=1)))
    shard = cluster.start_shard(0, 1)
    learner = cluster.learner("l0", 0, max_steps=30, flush_timeout_s=0)
    cluster.start_learner(learner).join(timeout=60)
    assert learner.stats.batches == 30
    wait_until(lambda: shard.data_positions.get("l0") == 30, 10, what="the shard read l0's final position")
    cluster.stop_shard(0)
    wait_until(lambda: shard._ctx is None, 10, what="the shard stopped (its checkpoint written)")
    redis_server.restart_empty()
    cluster.start_shard(0, 1)
    r = control.connect(redis_server.url)
    keys = Keys(cluster.endpoints.run_id)
    wait_until(lambda: positions.resume_at(r, keys, "l0") == 30, 10, what="l0's position put back")
    again = cluster.learner("l0", 0, max_steps=5, flush_timeout_s=0)
    cluster.start_learner(again).join(timeout=60)
    assert (again.data_position, again.stats.batches) == (30, 5)
    assert not cluster.errors, cluster.errors
