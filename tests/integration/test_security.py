"""CurveZMQ, the ZAP allow list and the broker's role rules, with real sockets."""
from __future__ import annotations

import subprocess
import sys

import msgpack
import torch
import zmq

from common import control, wire
from common.keys import Keys
from common.security import Security, authorize, create_keys
from tests.conftest import wait_until
from tests.integration.test_cluster import ASYNC


def _upd(run: str, sender: str, fragment: int = 0) -> list[bytes]:
    return wire.encode(kind=wire.UPDATE, run=run, sender=sender, fragment=fragment, values=torch.zeros(8),
                       codec="fp32", round=0, base=0, steps=1, tokens=16)


def _curve_pub(ctx: zmq.Context, endpoint: str, server_key: bytes, keypair: tuple[bytes, bytes] | None) -> zmq.Socket:
    s = ctx.socket(zmq.PUB)
    s.setsockopt(zmq.LINGER, 0)
    if keypair is not None:
        s.curve_serverkey, (s.curve_publickey, s.curve_secretkey) = server_key, keypair
    s.connect(endpoint)
    return s


def test_only_listed_keys_get_through_the_broker_and_each_role_sends_only_its_kinds(make_cluster):
    """A publisher with an unlisted key, or without CURVE, is refused at the handshake (counted);
    a listed learner cannot publish a shard's kinds, answer under another id or invent kinds
    (dropped, counted by reason); the listed learner's own answers do arrive."""
    cluster = make_cluster(ASYNC, secure=True)
    ep, run = cluster.endpoints, cluster.endpoints.run_id
    create_keys(ep.keys_dir, learners=["alice", "mallory"], broker=False, monitors=())
    mon = Security(ep.keys_dir, "monitor")
    alice, mallory = Security(ep.keys_dir, "alice"), Security(ep.keys_dir, "mallory")
    broker_key = mon.allow.public("broker")
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        mon.client(sub, "broker")
        sub.connect(ep.broker_sub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        outsider = _curve_pub(ctx, ep.broker_pub, broker_key, zmq.curve_keypair())   # a key nobody listed
        plain = _curve_pub(ctx, ep.broker_pub, broker_key, None)                      # no CURVE at all
        good = _curve_pub(ctx, ep.broker_pub, broker_key, (alice.public, alice.secret))
        bad = _curve_pub(ctx, ep.broker_pub, broker_key, (mallory.public, mallory.secret))
        b = cluster.broker
        try:
            wait_until(lambda: b.stats.auth_failures.get("unknown_key", 0) >= 1
                       and b.stats.auth_failures.get("handshake", 0) >= 1, 10, what="both outsiders refused")
        except AssertionError as e:
            raise AssertionError(f"{e}: counted {b.stats.auth_failures}") from None
        forged = wire.encode(kind=wire.FRAG, run=run, sender="mallory", fragment=0, values=torch.ones(8),
                             codec="fp32", epoch=1, version=10**6)
        invented = [f"{run}|zzz.0000".encode(), msgpack.packb({"from": "mallory"})]
        garbage = [f"{run}|upd.0000".encode(), b"\xc1not msgpack"]
        # a PUB drops what it sends before the broker's subscription reaches it (its handshake done):
        # mallory's socket is ready once one of its malformed messages is counted
        wait_until(lambda: bad.send_multipart(garbage) or b.stats.refused.get("malformed", 0) >= 1, 10,
                   what="mallory's socket connected")
        malformed0 = b.stats.refused.get("malformed", 0)
        sent = 0
        while (sub.poll(0) == 0 or sent < 20) and sent < 500:  # the subscription reaches the broker, then 20
            for s in (outsider, plain):
                s.send_multipart(_upd(run, "alice"))
            bad.send_multipart(forged)
            bad.send_multipart(_upd(run, "alice"))          # impersonation
            bad.send_multipart(invented)
            bad.send_multipart(garbage)
            good.send_multipart(_upd(run, "alice"))
            sent += 1
            wait_until(lambda: b.stats.refused.get("malformed", 0) >= malformed0 + sent, 10, what="the broker's pass")
        got = []
        while sub.poll(200):
            got.append(wire.decode(sub.recv_multipart()))
        assert got and {(m.kind, m.sender) for m in got} == {("upd", "alice")}, got[:3]
        assert len(got) <= sent                  # nothing from the outsiders or from mallory's lies
        refused = b.stats.refused
        assert refused["wrong_role"] == refused["sender_mismatch"] == refused["unknown_kind"] == sent, refused
    finally:
        ctx.destroy(linger=0)


def test_authorize_rules():
    head = lambda sender: msgpack.packb({"from": sender})  # noqa: E731
    assert authorize("learner:a", b"r|upd.0001", head("a")) is None
    assert authorize("shard:shard0", b"r|frag.0001", head("shard0")) is None
    assert authorize("learner:a", b"r|frag.0001", head("a")) == "wrong_role"
    assert authorize("shard:shard0", b"r|upd.0001", head("shard0")) == "wrong_role"
    assert authorize("learner:a", b"r|upd.0001", head("b")) == "sender_mismatch"
    assert authorize("learner:a", b"r|get.0001", head("a")) == "unknown_kind"
    assert authorize("learner:a", b"r|upd.0001", b"\xc1") == "malformed"
    assert authorize("", b"r|upd.0001", head("a")) == "unauthenticated"
    assert authorize("monitor:monitor", b"r|have.0001", head("monitor")) == "wrong_role"


def test_a_shard_rpc_and_a_learner_peer_endpoint_refuse_unlisted_keys(make_cluster):
    """Fragment requests with an unlisted key get no answer; the shard's ZAP handler counts them."""
    from common.rpc import fetch_fragments
    cluster = make_cluster(ASYNC, secure=True)
    shard = cluster.start_shard(0, 1)
    r = control.connect(cluster.endpoints.redis_url)
    keys = Keys(cluster.endpoints.run_id)
    mon = Security(cluster.endpoints.keys_dir, "monitor")
    got = fetch_fragments(r, keys, 4, timeout_s=20, security=mon)   # listed: served
    assert sorted(got) == [0, 1, 2, 3]
    stranger = Security(cluster.endpoints.keys_dir, "monitor")
    stranger.public, stranger.secret = zmq.curve_keypair()
    try:
        fetch_fragments(r, keys, 4, timeout_s=1.5, security=stranger)
        raise AssertionError("an unlisted key was served")
    except TimeoutError:
        pass
    zap = next(iter(shard.security._zap.values()))
    wait_until(lambda: zap.failures.get("unknown_key", 0) >= 1, 5, what="the refusal counted")


def test_daemons_refuse_to_start_without_keys_unless_insecure(tmp_path):
    res = subprocess.run([sys.executable, "-m", "ddloco", "broker", "--xsub", "tcp://127.0.0.1:0",
                          "--xpub", "tcp://127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--keys DIR" in res.stderr and "--insecure" in res.stderr, res.stderr
    res = subprocess.run([sys.executable, "-m", "ddloco", "keys", "--dir", str(tmp_path / "k"), "--shards", "2",
                          "--learners", "2"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in (tmp_path / "k" / "public").rglob("*.key"))
    assert names == ["broker.key", "learner-0.key", "learner-1.key", "monitor.key", "shard0.key", "shard1.key"]
    assert oct((tmp_path / "k" / "secret" / "shard0.key_secret").stat().st_mode & 0o777) == "0o600"
    res = subprocess.run([sys.executable, "-m", "ddloco", "learner", "--keys", str(tmp_path / "k"),
                          "--learner-id", "nobody", "--run-id", "x", "--redis-url", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no secret key for 'nobody'" in res.stderr, res.stderr[-2000:]


def test_a_small_seeded_fuzz_run_crashes_nothing_and_training_goes_on(make_cluster):
    """`ddloco fuzz`'s engine against an in-process cluster with CURVE (broker, shard RPC, two
    learners' peer endpoints): every thread survives, malformed input is counted and dropped,
    a learner asked for its state in a loop serves at most one per second, merges go on."""
    from ddloco.fuzz import ClusterWatch, run_fuzz
    from learner.network import PEER_SERVE_INTERVAL_S
    cluster = make_cluster(ASYNC, secure=True)
    cluster.start_shard(0, 1)
    learners = [cluster.learner(n, i, step_time_floor_ms=5) for i, n in enumerate(("a", "b"))]
    for lr in learners:
        cluster.start_learner(lr)
    r = control.connect(cluster.endpoints.redis_url)
    keys = Keys(cluster.endpoints.run_id)
    wait_until(lambda: all(h.get("peer") and h.get("status") == "training"
                           for h in control.live_learners(r, keys).values()) and len(control.live_learners(r, keys)) == 2,
               60, what="both learners training, peer endpoints advertised")
    numels = [f.numel for f in cluster.shards[0].plan]
    watch = ClusterWatch(r, keys, cluster.endpoints.broker_pub, pids=lambda: {})  # threads, not processes
    rep = run_fuzz(cluster.endpoints, count=6000, seconds=60, seed=3, say=lambda s: None, watch=watch, numels=numels)
    assert rep.total == 6000 and rep.inputs["shard"] > 500 and rep.inputs["peer"] > 500, rep.inputs
    assert rep.training_went_on, (rep.merges, rep.learner_steps)
    assert not cluster.errors, cluster.errors
    assert rep.shards_refused.get("malformed", 0) > 0 and sum(cluster.broker.stats.refused.values()) > 0, rep.to_dict()
    served = sum(lr.stats.bootstraps_served for lr in learners)
    assert served <= 2 * (rep.seconds / PEER_SERVE_INTERVAL_S + 1), served
