"""The chaos harness's SPEC and its seeded schedule."""
from __future__ import annotations

import pytest

from common.config import ConfigError
from ddloco.chaos import ChaosSpec, parse_chaos, plan_faults

SPEC = "seed=7,learner_mtbf_s=60,stalls=3,stall_s=20,shard_kills=1,shard_wipes=1,broker_restarts=1,redis_restarts=1"


def test_parse_reads_every_documented_key():
    s = parse_chaos(SPEC)
    assert s == ChaosSpec(seed=7, learner_mtbf_s=60.0, stalls=3, stall_s=20.0, shard_kills=1, shard_wipes=1,
                          broker_restarts=1, redis_restarts=1)
    assert parse_chaos(str(s)) == s


@pytest.mark.parametrize("bad, match", [("seed=1,bogus=2", "bogus"), ("stalls=two", "stalls must be an integer"),
                                        ("learner_mtbf_s=-1", ">= 0"), ("seed", "key=value")])
def test_parse_refuses_bad_input_naming_it(bad, match):
    with pytest.raises(ConfigError, match=match):
        parse_chaos(bad)


def test_schedule_is_seeded_counts_what_was_asked_and_stays_inside_the_run():
    learners = [f"learner-{i}" for i in range(4)]
    a = plan_faults(parse_chaos(SPEC), duration_s=240, learners=learners, shards=2)
    assert a == plan_faults(parse_chaos(SPEC), duration_s=240, learners=learners, shards=2)
    assert a != plan_faults(parse_chaos(SPEC.replace("seed=7", "seed=8")), duration_s=240, learners=learners,
                            shards=2)
    kinds = [f.kind for f in a]
    for kind, n in (("stall", 3), ("shard_kill", 1), ("shard_wipe", 1), ("broker_restart", 1),
                    ("redis_restart", 1)):
        assert kinds.count(kind) == n, kind
    kills = [f for f in a if f.kind == "learner_kill"]
    assert 4 <= len(kills) <= 40          # 4 learners x 204 s / 60 s MTBF ~ 14 expected
    assert all(0.05 * 240 <= f.at_s <= 0.85 * 240 for f in a)
    assert all(f.target in learners for f in a if f.kind in ("learner_kill", "stall"))
    assert all(f.target in ("shard0", "shard1") for f in a if f.kind.startswith("shard"))
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    assert plan_faults(ChaosSpec(), duration_s=240, learners=learners, shards=2) == []
