"""The broker's per-member limits and the owner rule, as pure decisions at a fixed ``now``."""
from __future__ import annotations

import pytest

from broker.limits import Rate, RateLimits, Subscriptions, Verdict, member_rates, subscription_cap
from common.security import owner_refusal, sent_by_owner, topic_fragment

pytestmark = pytest.mark.timeout(10)


def test_only_the_owner_shard_may_speak_for_a_fragment():
    assert owner_refusal("shard:shard1", b"r|frag.0003", 2) is None            # 3 % 2 = 1
    assert owner_refusal("shard:shard0", b"r|frag.0003", 2) == "not_owner"
    assert owner_refusal("shard:shard0", b"r|open.0003", 2) == "not_owner"
    assert owner_refusal("shard:shard0", b"r|need.0003", 2) == "not_owner"
    assert owner_refusal("shard:shard0", b"r|frag.0003", 0) == "shards_unknown"   # S unknown: refused
    assert owner_refusal("shard:shard1", b"r|frag.x", 2) == "not_owner"
    assert owner_refusal("learner:a", b"r|upd.0003", 0) is None              # not a shard's kind
    assert topic_fragment(b"r|frag.0012") == 12 and topic_fragment(b"r|frag.") is None


def test_a_learner_accepts_a_shard_message_only_from_the_owner():
    assert sent_by_owner("shard1", 5, 2) and sent_by_owner("shard0", 4, 2)
    assert not sent_by_owner("shard0", 5, 2)
    assert not sent_by_owner("shard1", 5, 0)           # S unknown: nobody
    assert not sent_by_owner("mallory", 5, 1)


def test_a_member_beyond_its_rate_is_refused_and_another_member_is_not():
    limits = RateLimits({"learner": Rate(per_s=10, burst=5)})
    now = 100.0
    got = [limits.allow("learner:m", "learner", now) for _ in range(20)]
    assert got.count(True) == 5                          # the burst, then nothing at the same instant
    assert limits.allow("learner:h", "learner", now)     # another member has its own bucket
    assert sum(limits.allow("learner:m", "learner", now + 1.0) for _ in range(20)) == 5   # refilled 10, cap 5
    for i in range(1, 5):                                # 10/s: 5 tokens each half second
        assert sum(limits.allow("learner:m", "learner", now + 1.0 + 0.5 * i) for _ in range(20)) == 5
    assert limits.allow("monitor:x", "monitor", now)     # a role without a rate is not limited


def test_default_rates_and_cap_grow_with_the_fragments():
    r = member_rates(24)
    assert r["learner"].per_s == 240 and r["learner"].burst == 160
    assert r["shard"].per_s > r["learner"].per_s
    assert subscription_cap(24) == 64


def test_subscriptions_beyond_the_cap_are_refused_and_a_topic_goes_upstream_once():
    subs = Subscriptions(cap=3, max_topic_bytes=16)
    assert [subs.subscribe("m", b"t%d" % i).honor for i in range(5)] == [True, True, True, False, False]
    assert subs.subscribe("m", b"t9").reason == "too_many_subscriptions"
    assert subs.subscribe("m", b"t0") == Verdict(True, False)      # one it holds: applied again (a new pipe)
    assert subs.subscribe("m", b"x" * 17).reason == "topic_too_long"
    assert subs.subscribe("h", b"t0") == Verdict(True, False)      # another member: applied, already upstream
    assert subs.subscribe("h", b"u") == Verdict(True, True)        # a new topic: upstream once
    assert subs.unsubscribe("m", b"t0") == Verdict(True, False)    # applied to its pipe, never withdrawn upstream
    assert subs.unsubscribe("m", b"t9") == Verdict(False, False)   # never held
    assert subs.subscribe("m", b"t8").reason == "too_many_subscriptions"   # unsubscribing frees no room
    assert subs.upstream == {b"t0", b"t1", b"t2", b"u"}


def test_a_member_is_due_for_eviction_after_distinct_refused_topics_only():
    """An honest member that reconnects and asks again for topics refused before (a cap set too
    low) comes no nearer to eviction; one asking for ever new topics is evicted once per
    EVICT_AFTER of them."""
    from broker.limits import Subscriptions
    subs = Subscriptions(cap=2, evict_after=4)
    for _ in range(10):                          # the same 5 topics, 10 reconnections
        for t in (b"a", b"b", b"c", b"d", b"e"):
            subs.subscribe("shard:0", t)
    assert not subs.evict_due("shard:0")         # 3 distinct topics refused
    for i in range(3):
        subs.subscribe("learner:m", b"x%d" % i)  # 2 applied, 1 refused
    assert not subs.evict_due("learner:m")
    for i in range(3, 6):
        subs.subscribe("learner:m", b"x%d" % i)
    assert subs.evict_due("learner:m")           # 4 distinct refused
    assert not subs.evict_due("learner:m")       # counted again from zero
