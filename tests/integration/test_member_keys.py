"""A learner's own Redis keys, filled by its own (compromised) Redis user, are brought back within
bounds by shard 0's sweep (``syncer.janitor``); an honest learner's keys are never touched."""
from __future__ import annotations

import pytest

from common import control, entries
from common.keys import Keys
from syncer import janitor
from tests.integration.test_redis_acl import _user, redis7  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


def _sweep(r, keys: Keys) -> janitor.MemberKeys:
    j = janitor.MemberKeys(keys)
    j.tidy(r)
    while j.cursor != 0:
        j.tidy(r)
    return j


def test_a_members_own_keys_filled_with_its_credentials_are_brought_back_within_bounds(redis7):  # noqa: F811
    keys, other = Keys("run"), Keys("other")
    admin = control.connect(redis7.url)
    admin.hset(keys.config, "blob", "x" * (200 << 10))           # shared and large: not a member's key
    admin.hset(other.learner("mallory"), "pad", "x" * (200 << 10))   # another run's: not this sweep's
    honest = _user(redis7, "run", "alice")
    control.beat(honest, keys, "alice", {"status": "training", "tokens": 64, "incarnation": "i1"}, ttl_s=30)
    control.add_learner_event(honest, keys, "alice", "join", incarnation="i1")
    for i in range(3):
        honest.hset(keys.life("alice", f"i{i}"), mapping={"tokens": 64, "steps": 4})
        honest.expire(keys.life("alice", f"i{i}"), janitor.LIFE_TTL_S)
    honest_before = {k: admin.dump(k) for k in admin.scan_iter(match=f"{keys.prefix}*")}

    mallory = _user(redis7, "run", "mallory")                    # what its own user may write
    mallory.hset(keys.learner("mallory"), "pad", "x" * (1 << 20))
    for i in range(janitor.LIVES_PER_ID + 40):                  # lives, some without an expiry
        mallory.hset(keys.life("mallory", f"{i:05d}"), "tokens", 1)
        if i % 2:
            mallory.expire(keys.life("mallory", f"{i:05d}"), 1000 + i)
    for _ in range(20):
        mallory.xadd(keys.learner_events("mallory"), {"pad": "y" * (1 << 20)})
    mallory.set(keys.heartbeat("mallory"), "1")                 # a member for ever, unless given an expiry
    bad_before = entries.BAD_ENTRIES.total()

    j = _sweep(admin, keys)
    assert not admin.exists(keys.learner("mallory"))
    lives = [k for k in admin.scan_iter(match=f"{keys.prefix}life:mallory:*")]
    assert len(lives) == janitor.LIVES_PER_ID, len(lives)
    ttls = [admin.ttl(k) for k in lives]
    assert all(0 < t <= janitor.LIFE_TTL_S for t in ttls), sorted(ttls)[:5]
    # the newest kept: every one the sweep gave a day, and the longest-lived of the others
    assert sum(t > 10_000 for t in ttls) == (janitor.LIVES_PER_ID + 40 + 1) // 2
    assert not admin.exists(keys.learner_events("mallory"))
    assert 0 < admin.ttl(keys.heartbeat("mallory")) <= janitor.HB_TTL_MAX_S
    assert j.removed == 1 + 40 + 1
    assert entries.BAD_ENTRIES.total() >= bad_before + 2 + janitor.LIVES_PER_ID // 2
    # honest keys, shared keys and another run's: untouched
    assert {k: admin.dump(k) for k in honest_before} == honest_before
    assert admin.hget(keys.config, "blob") == "x" * (200 << 10)
    assert admin.exists(other.learner("mallory"))


def test_shard_0_sweeps_the_member_keys_as_it_runs(make_cluster):
    from tests.conftest import wait_until
    from tests.integration.test_cluster import ASYNC
    cluster = make_cluster(ASYNC)
    cluster.start_shard(0, 1)
    r = control.connect(cluster.endpoints.redis_url)
    keys = Keys(cluster.endpoints.run_id)
    r.hset(keys.learner("mallory"), "pad", "x" * (1 << 20))
    r.hset(keys.life("mallory", "forever"), "tokens", 1)
    wait_until(lambda: not r.exists(keys.learner("mallory")) and r.ttl(keys.life("mallory", "forever")) > 0,
               4 * janitor.TIDY_EVERY_S, what="the oversized hash removed, the life given an expiry")
    assert not cluster.errors, cluster.errors
