"""What a compromised learner can write into the run's Redis (its Redis user reaches every key of
the run) is input: each malformed entry is counted and ignored, no learner, shard or reader dies on
it, and training goes on. Real redis-server, a real CURVE cluster of threads (broker, 2 shards, 2
learners) that takes every write in turn."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common import control
from common import entries
from common.keys import Keys
from ddloco.status import collect_status
from tests.conftest import wait_until
from tests.integration.test_cluster import ASYNC

pytestmark = pytest.mark.timeout(180)


def _progress(cluster, learners) -> tuple[int, int]:
    return min(lr.stats.steps for lr in learners), sum(s.stats.merges for s in cluster.shards.values())


def _goes_on(cluster, learners, what: str, counted: tuple[str, ...] = ()) -> None:
    """Every learner steps and the shards merge after ``what`` was written, while each of
    ``counted`` (kind.reason) is counted; nothing died."""
    steps, merges = _progress(cluster, learners)
    try:
        wait_until(lambda: cluster.errors or (_progress(cluster, learners)[0] >= steps + 8
                                              and _progress(cluster, learners)[1] >= merges + 2
                                              and all(_rejected(c) >= 1 for c in counted)),
                   40, what=f"training going on after {what}")
    except AssertionError as e:
        raise AssertionError(f"{e}: progress {_progress(cluster, learners)} from {(steps, merges)}, counted "
                             f"{entries.BAD_ENTRIES.snapshot()}") from None
    assert not cluster.errors, f"after {what}: {cluster.errors!r}"


def _rejected(kind_reason: str) -> int:
    return entries.BAD_ENTRIES.snapshot().get(kind_reason, 0)


def test_malformed_redis_entries_are_counted_and_ignored_and_training_goes_on(make_cluster):
    cluster = make_cluster(ASYNC, secure=True)
    for k in (0, 1):
        cluster.start_shard(k, 2)
    learners = [cluster.learner(n, i, step_time_floor_ms=5) for i, n in enumerate(("a", "b"))]
    for lr in learners:
        cluster.start_learner(lr)
    r = control.connect(cluster.endpoints.redis_url)
    keys = Keys(cluster.endpoints.run_id)
    wait_until(lambda: cluster.errors or _progress(cluster, learners)[1] >= 4, 60, what="the cluster merging")
    assert not cluster.errors, cluster.errors

    # a fake shard entry: an endpoint with no listed key (SecurityError in every learner before)
    r.sadd(keys.shards, 9)
    r.hset(keys.shard(9), mapping={"rpc": "tcp://127.0.0.1:1", "shards": 99})
    # a shard index that is not one (every learner's control thread and `up` died on int("x"))
    r.sadd(keys.shards, "x", "-3")
    # a shard hash of garbage
    r.sadd(keys.shards, 5)
    r.hset(keys.shard(5), mapping={"rpc": "not an endpoint", "shards": "zz"})
    # shard 9 claims 99 shards: outvoted by the two shards
    _goes_on(cluster, learners, "fake shard entries", ("shards.not_an_index", "shard.bad_count",
                                                       "shard.count_disagrees"))
    assert control.shard_endpoints(r, keys)[0] == 2 and sorted(control.shard_endpoints(r, keys)[1]) == [0, 1]

    # fragment versions, a ghost learner's counters, the eval, broker, layout and token entries
    r.hset(keys.fragment(0), "version", "-5")
    r.hset(keys.fragment(1), "version", "abc")
    r.hset(keys.fragment(2), mapping={"round": "1e999", "failed_rounds": "x"})
    r.sadd(keys.learners, "ghost")
    r.set(keys.heartbeat("ghost"), "1", ex=60)
    r.hset(keys.learner("ghost"), mapping={"step_ema_s": "nan", "steps": "x", "tokens": "-1", "status": "s" * 10_000,
                                           "updated_at": "inf", "pid": "3.5", "merged_contributions": "many"})
    r.hset(keys.eval, mapping={"loss": "abc", "at": "later"})
    # the broker rewrites its hash every second: read the garbage back in the same transaction
    broker_garbage = r.pipeline(transaction=True).hset(keys.broker, mapping={
        "auth_failures": "lots", "refused": "[1, 2", "auth_failures_by_reason": "{}"}).hgetall(keys.broker).execute()[1]
    r.hset(keys.config, mapping={"layout": "not json", "blob": "{not json"})
    r.hset(keys.token_shares, "evil:0", "garbage")
    r.set(keys.tokens, "a lot")
    _goes_on(cluster, learners, "garbage counters", ("learner.bad_number", "learner.text_too_long",
                                                     "tokens.bad_share"))
    # the config blob and the layout are set once per run: the shards write them back
    wait_until(lambda: control.run_layout(r, keys) is not None, 10, what="the layout written back")
    assert control.fetch_run_config(r, keys).digest() == cluster.shards[0].run.digest()
    st = collect_status(r, keys)           # `ddloco status` and `up`'s monitor read all of it
    res = subprocess.run([sys.executable, "-m", "ddloco", "status", "--json", "--redis-url",
                          cluster.endpoints.redis_url, "--run-id", keys.run_id], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ghost" in json.loads(res.stdout)["learners"], res.stdout[-2000:]   # stdout is the JSON alone
    assert st["learners"]["ghost"]["steps"] == 0 and st["learners"]["ghost"]["status"] == "?"
    assert st["eval"] is None and all(f["version"] >= 0 for f in st["fragments"].values())
    assert entries.parse_broker_entry(broker_garbage)["auth_failures"] == 0
    assert entries.parse_broker_entry(r.hgetall(keys.broker))["auth_failures"] >= 0
    assert int(r.get(keys.tokens)) > 0      # not a count: rebuilt from the shares at the next write
    assert entries.parse_fragment_entry(2, {"version": "-5", "failed_rounds": "x"})["failed_rounds"] == 0
    for reason in ("fragment.bad_failed_rounds", "fragment.bad_version", "learner.bad_number",
                   "learner.text_too_long", "eval.bad_number", "broker.bad_number", "broker.bad_counts",
                   "config.bad_layout", "config.not_a_run_config", "config.rewritten", "tokens.bad_share"):
        assert _rejected(reason) >= 1, (reason, entries.BAD_ENTRIES.snapshot())

    # a lease of shard 1 with no TTL (it stopped the shard, and kept it out for good): taken back
    r.set(keys.shard_lease(1), "evil")
    wait_until(lambda: _rejected("lease.taken_back") >= 1, 10, what="shard 1 taking its lease back")
    assert r.get(keys.shard_lease(1)) == cluster.shards[1].lease_holder
    _goes_on(cluster, learners, "a lease without TTL")

    # the epoch counter at INCR's limit, and a no-TTL lease, when shard 0 starts again
    cluster.stop_shard(0)
    wait_until(lambda: r.get(keys.shard_lease(0)) is None, 20, what="shard 0 stopped, its lease released")
    r.set(keys.epochs, str(2**63 - 1))
    r.set(keys.shard_lease(0), "evil")
    r.hset(keys.fragment(0), "version", "-5")       # what the starting shard reads as the run's record
    r.hset(keys.fragment(2), "version", str(2**70))
    old_epoch = cluster.shards[0].epoch
    shard = cluster.start_shard(0, 2)
    assert old_epoch < shard.epoch < 2**53, shard.epoch
    assert _rejected("epochs.implausible") >= 1 and _rejected("lease.not_a_lease") >= 1
    assert _rejected("fragment.bad_version") >= 2
    _goes_on(cluster, learners, "shard 0 restarted past a bad epoch counter and lease")
    snapshot = entries.BAD_ENTRIES.snapshot()
    assert all(lr.readings() for lr in learners) and int(r.hget(keys.shard(1), "bad_entries")) >= 1, snapshot


def test_up_survives_the_writes_that_killed_it_and_reports(tmp_path):
    """`ddloco up` (its monitor, its learners, its shards as processes) while a member writes a
    shard index that is not one, a fake shard, a lease without TTL and an epoch counter at INCR's
    limit: the run ends well with its report (before: a traceback from `up` and no report)."""
    from tests.conftest import TINY_TOML
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    up = subprocess.Popen([sys.executable, "-m", "ddloco", "up", "--config", "tiny.toml", "--learners", "2",
                           "--syncers", "2", "--steps", "300", "--step-time-floor-ms", "25", "--minutes", "3",
                           "--report", "rep", "--run-id", "insider", "--quiet"],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        access = wait_until(lambda: next(iter((tmp_path / "runs").glob("insider-*/access.env")), None)
                            if (tmp_path / "runs").exists() else None, 60, what="up's access.env")
        url = dict(line.split("=", 1) for line in access.read_text().split())["DDLOCO_REDIS_URL"]
        r = control.connect(url)
        keys = Keys("insider")
        wait_until(lambda: sum(v or 0 for v in control.fragment_versions(r, keys, range(4)).values()) >= 4, 90,
                   what="the run merging")
        r.sadd(keys.shards, "x", 9)
        r.hset(keys.shard(9), mapping={"rpc": "tcp://127.0.0.1:1", "shards": 99})
        r.set(keys.shard_lease(1), "evil")
        r.set(keys.epochs, str(2**63 - 1))
        r.hset(keys.learner("l0"), "steps", "x")
        out, err = up.communicate(timeout=200)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["steps_total"] == 600 and rep["every_fragment_merged"], rep


def test_a_lease_only_a_shard_could_have_written_is_respected_and_any_other_is_taken_back(redis_server):
    """A shard's lease is `host:pid:epoch` with a TTL <= LEASE_TTL_MAX_S: a successor's (newer
    epoch) ends the holder's ownership; a value of an older epoch, without TTL or not a holder is
    taken back at the next renewal, and at start once it stayed for one lease TTL."""
    r = control.connect(redis_server.url)
    key, ours = Keys("lease").shard_lease(0), "host:10:5"
    control.acquire_lease(r, key, ours, ttl_s=1.0, wait_s=1.0)
    for planted, ttl_ms in (("host:11:4", 1000), ("anything", 1000), ("host:12:7", None), ("host:13:9", 10**9)):
        r.set(key, planted, px=ttl_ms)
        assert control.renew_lease(r, key, ours, ttl_s=1.0), planted
        assert r.get(key) == ours and 0 < r.pttl(key) <= 1000
    r.set(key, "host:14:6", px=1000)                       # a successor: a newer epoch, a shard's TTL
    assert not control.renew_lease(r, key, ours, ttl_s=1.0) and r.get(key) == "host:14:6"
    r.set(key, "evil")                                     # no TTL: no shard ever writes that
    control.acquire_lease(r, key, "host:15:8", ttl_s=1.0, wait_s=0.1)   # waits one TTL, then takes it
    assert r.get(key) == "host:15:8"
    r.set(key, "host:16:9", px=5000)                      # a live holder's lease is waited for, then refused
    with pytest.raises(control.LeaseHeld):
        control.acquire_lease(r, key, "host:17:10", ttl_s=1.0, wait_s=0.3)
