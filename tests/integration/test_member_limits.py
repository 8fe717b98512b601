"""What one listed member can do through the broker, with real keys and real sockets: a shard
speaks only for its own fragments, frames, subscriptions and message rates are bounded per
member, and honest members' traffic goes on meanwhile (docs/SECURITY.md, measures)."""
from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
import zmq

from common import wire
from common.config import Endpoints
from common.security import Security, create_keys
from tests.conftest import wait_until
from tests.integration.test_cluster import ASYNC

pytestmark = pytest.mark.timeout(90)


def _socket(ctx: zmq.Context, kind: int, keys_dir: str, name: str, endpoint: str) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 100_000)
    Security(keys_dir, name).client(s, "broker")
    s.connect(endpoint)
    return s


def _upd(run: str, sender: str, fragment: int = 0, numel: int = 8) -> list:
    return wire.encode(kind=wire.UPDATE, run=run, sender=sender, fragment=fragment, values=torch.zeros(numel),
                       codec="fp32", round=0, base=0, steps=1, tokens=16)


def _frag(run: str, sender: str, fragment: int) -> list:
    return wire.encode(kind=wire.FRAG, run=run, sender=sender, fragment=fragment, values=torch.ones(8),
                       codec="fp32", epoch=1, version=10**6)


def _drain(sub: zmq.Socket, wait_ms: int = 200) -> list[wire.Message]:
    got = []
    while sub.poll(wait_ms):
        got.append(wire.decode(sub.recv_multipart()))
    return got


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_a_shard_key_cannot_publish_for_a_fragment_another_shard_owns(make_cluster, ctx):
    """shard1's key sends frag/open/need for fragment 0 (shard0's of S = 2): refused at the broker
    and counted ``not_owner``; its own fragment 1 goes through."""
    cluster = make_cluster(ASYNC, secure=True, broker={"shards": 2})
    ep, run, b = cluster.endpoints, cluster.endpoints.run_id, cluster.broker
    sub = _socket(ctx, zmq.SUB, ep.keys_dir, "monitor", ep.broker_sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub = _socket(ctx, zmq.PUB, ep.keys_dir, "shard1", ep.broker_pub)
    wait_until(lambda: pub.send_multipart(_frag(run, "shard1", 1)) or sub.poll(50), 10, what="the link up")
    _drain(sub, 100)
    for sent in range(1, 21):
        pub.send_multipart(_frag(run, "shard1", 0))
        pub.send_multipart(wire.encode(kind=wire.OPEN, run=run, sender="shard1", fragment=2, round=5, version=10**6))
        pub.send_multipart(wire.encode(kind=wire.NEED, run=run, sender="shard1", fragment=0, epoch=9))
        pub.send_multipart(_frag(run, "shard1", 1))
        wait_until(lambda: b.stats.refused.get("not_owner", 0) >= 3 * sent, 10, what="the broker's pass")
    got = _drain(sub)
    assert len(got) == 20 and {(m.kind, m.fragment) for m in got} == {("frag", 1)}, got[:3]
    assert b.stats.refused["not_owner"] == 3 * sent, b.stats.refused


def test_a_secure_broker_refuses_shards_messages_until_it_knows_the_shard_count(make_cluster, ctx):
    cluster = make_cluster(ASYNC, secure=True)          # no shard started: S is not in Redis
    ep, run, b = cluster.endpoints, cluster.endpoints.run_id, cluster.broker
    sub = _socket(ctx, zmq.SUB, ep.keys_dir, "monitor", ep.broker_sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")                 # a subscriber: the publisher sends at all
    pub = _socket(ctx, zmq.PUB, ep.keys_dir, "shard0", ep.broker_pub)
    wait_until(lambda: pub.send_multipart(_frag(run, "shard0", 0)) or b.stats.refused.get("shards_unknown", 0) >= 3,
               10, what="shard0's frames refused while S is unknown")
    assert b.stats.messages == 0 and not sub.poll(100)


def _learner_thread(endpoints: Endpoints, numels: list[int], shards: int):
    from learner.core import LearnerStats
    from learner.network import NetworkThread, Outbox
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    nt = NetworkThread(learner_id="l0", endpoints=endpoints, codec="fp32", numels=numels, inbox=inbox,
                       outbox=Outbox(), stats=LearnerStats(), shard_endpoints=lambda: (shards, {}),
                       stop=threading.Event())
    nt.shards = shards
    return nt, inbox


def test_a_learner_drops_a_shards_message_about_a_fragment_it_does_not_own(ctx):
    """The learner's own check (behind the broker's): a frag, open or need whose sender is not
    ``shard<p % S>`` is dropped and counted; the owner's arrives."""
    nt, inbox = _learner_thread(Endpoints(run_id="r"), [8, 8, 8, 8], shards=2)
    rx, tx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    rx.bind("inproc://broadcasts")
    tx.connect("inproc://broadcasts")
    tx.send_multipart(_frag("r", "shard0", 1))                                        # 1 is shard1's
    tx.send_multipart(wire.encode(kind=wire.OPEN, run="r", sender="shard1", fragment=2, round=3, version=4))
    tx.send_multipart(wire.encode(kind=wire.NEED, run="r", sender="shard0", fragment=3))
    tx.send_multipart(_frag("r", "shard1", 1))                                        # the owner
    wait_until(lambda: rx.poll(0) and (nt.receive_broadcasts(rx) or True) and inbox.qsize() >= 1, 5,
               what="the owner's fragment")
    nt.receive_broadcasts(rx)
    assert nt.not_owner == 3
    arrived = inbox.get_nowait()
    assert (type(arrived).__name__, arrived.fragment) == ("FragmentArrived", 1) and inbox.empty()


def test_a_fragment_reply_from_a_shard_that_does_not_own_it_is_dropped(ctx):
    """A fragment fetched by RPC is taken only from its owner's socket, in the owner's name, and
    only while it is asked for."""
    from common.redis_server import free_port
    from common.rpc import FragmentClient
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    client = FragmentClient(ctx, run_id="r", sender="l0", numels=[8, 8, 8, 8])
    client.set_endpoints(2, {0: endpoint})                # shard0 of 2 owns fragments 0 and 2
    assert client.request(0) and client.request(2)
    assert router.poll(5000)
    who = router.recv_multipart()[0]
    for sender, fragment in (("shard1", 0), ("shard0", 1), ("shard0", 2), ("shard0", 2)):
        router.send_multipart([who, *_frag("r", sender, fragment)])
    sock = client.sockets[0]
    got: list = []
    wait_until(lambda: sock.poll(0) and got.extend(client.receive(sock)) is None and got, 5, what="a reply")
    while sock.poll(200):
        got.extend(client.receive(sock))
    assert [m.fragment for m in got] == [2] and client.not_owner == 2
    assert client.unasked == 1                 # the second copy of 2: not asked any more
    client.close()


def test_a_frame_over_the_size_limit_is_dropped_and_the_broker_keeps_serving(make_cluster, ctx):
    cluster = make_cluster(ASYNC, secure=True, broker={"max_message_bytes": 1 << 20})
    ep, run, b = cluster.endpoints, cluster.endpoints.run_id, cluster.broker
    create_keys(ep.keys_dir, learners=["alice", "mallory"], broker=False, monitors=())
    sub = _socket(ctx, zmq.SUB, ep.keys_dir, "monitor", ep.broker_sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    alice = _socket(ctx, zmq.PUB, ep.keys_dir, "alice", ep.broker_pub)
    mallory = _socket(ctx, zmq.PUB, ep.keys_dir, "mallory", ep.broker_pub)
    big = _upd(run, "mallory", numel=(1 << 20) // 4 + 1024)          # a 1 MiB + 4 KiB payload frame
    got: list[wire.Message] = []
    for _ in range(30):
        mallory.send_multipart(big)
        alice.send_multipart(_upd(run, "alice"))
        if sub.poll(100):
            got.extend(_drain(sub, 50))
    got.extend(_drain(sub))
    senders = [m.sender for m in got]
    assert "alice" in senders and "mallory" not in senders, senders[:5]
    assert b.stats.bytes < (1 << 20), b.stats.bytes    # the broker itself never took one of mallory's frames


def test_subscriptions_beyond_a_members_cap_are_not_honored(make_cluster, ctx):
    cluster = make_cluster(ASYNC, secure=True, broker={"max_subscriptions": 4})
    ep, run, b = cluster.endpoints, cluster.endpoints.run_id, cluster.broker
    create_keys(ep.keys_dir, learners=["alice", "mallory"], broker=False, monitors=())
    greedy = _socket(ctx, zmq.SUB, ep.keys_dir, "mallory", ep.broker_sub)
    for p in range(12):
        greedy.setsockopt(zmq.SUBSCRIBE, wire.topic(run, wire.UPDATE, p))
    honest = _socket(ctx, zmq.SUB, ep.keys_dir, "monitor", ep.broker_sub)
    honest.setsockopt(zmq.SUBSCRIBE, b"")
    wait_until(lambda: b.stats.refused.get("too_many_subscriptions", 0) >= 8 and b.stats.subscriptions >= 13, 10,
               what="the subscriptions seen by the broker")
    alice = _socket(ctx, zmq.PUB, ep.keys_dir, "alice", ep.broker_pub)
    seen: set[int] = set()
    for _ in range(200):
        for p in range(12):
            alice.send_multipart(_upd(run, "alice", p))
        seen |= {m.fragment for m in _drain(honest, 20)}
        if seen == set(range(12)):
            break
    assert seen == set(range(12))
    greedy_got = {m.fragment for m in _drain(greedy)}
    assert greedy_got == {0, 1, 2, 3}, greedy_got
    assert b.stats.refused["too_many_subscriptions"] == 8, b.stats.refused


def test_a_member_that_keeps_subscribing_beyond_its_cap_is_evicted_and_the_honest_ones_go_on(make_cluster, ctx):
    """libzmq records every subscription a connection sends until it closes: a member refused
    EVICT_AFTER times is banned and the XPUB bound anew (its record freed); the honest subscriber
    reconnects by itself and receives again, the banned key is refused at every reconnection."""
    from broker.limits import EVICT_AFTER
    cluster = make_cluster(ASYNC, secure=True, broker={"max_subscriptions": 4})
    ep, run, b = cluster.endpoints, cluster.endpoints.run_id, cluster.broker
    create_keys(ep.keys_dir, learners=["alice", "mallory"], broker=False, monitors=())
    honest = _socket(ctx, zmq.SUB, ep.keys_dir, "monitor", ep.broker_sub)
    honest.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, wire.UPDATE))
    alice = _socket(ctx, zmq.PUB, ep.keys_dir, "alice", ep.broker_pub)
    received = lambda: alice.send_multipart(_upd(run, "alice")) or honest.poll(20)  # noqa: E731
    wait_until(received, 10, what="the honest subscriber receives")
    _drain(honest, 50)
    greedy = _socket(ctx, zmq.SUB, ep.keys_dir, "mallory", ep.broker_sub)
    for i in range(4 + 3 * EVICT_AFTER):
        greedy.setsockopt(zmq.SUBSCRIBE, f"{run}|zzz.{i:09d}".encode())
    wait_until(lambda: b.stats.refused.get("evicted", 0) >= 1, 10, what="mallory evicted")
    assert b.zap is not None and "learner:mallory" in b.zap.banned
    assert b.stats.refused["too_many_subscriptions"] == EVICT_AFTER, b.stats.refused   # its later ones: never read
    wait_until(lambda: b.zap.failures.get("banned", 0) >= 1, 10, what="mallory's reconnection refused")
    wait_until(received, 10, what="the honest subscriber back after the XPUB was bound anew")
    assert b.stats.refused["evicted"] == 1
    greedy.setsockopt(zmq.SUBSCRIBE, b"")      # the banned key gets nothing, whatever it asks for
    for _ in range(20):
        alice.send_multipart(_upd(run, "alice"))
    assert not _drain(greedy, 300)


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_the_xpub_is_bound_again_at_the_same_address_right_after_it_closed(ctx, tmp_path, transport):
    """The eviction's rebinding: a TCP port the closed socket still held a moment, an ipc path
    whose file it left behind (owner-only afterwards, as at start)."""
    import os
    import stat
    from broker.daemon import _bind_again
    from common.redis_server import free_port
    endpoint = f"tcp://127.0.0.1:{free_port()}" if transport == "tcp" else f"ipc://{tmp_path}/xpub.sock"
    old = ctx.socket(zmq.XPUB)
    old.bind(endpoint)
    old.close(linger=0)
    new = ctx.socket(zmq.XPUB)
    new.setsockopt(zmq.LINGER, 0)
    _bind_again(new, endpoint)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    assert new.poll(5000), "no subscription reached the socket bound again"
    assert new.recv() == b"\x01t"
    if transport == "ipc":
        assert stat.S_IMODE(os.stat(f"{tmp_path}/xpub.sock").st_mode) == 0o600


def test_a_flood_beyond_a_members_rate_is_dropped_and_an_honest_members_answers_pass(make_cluster, ctx):
    """P = 1: a learner may send 10 messages/s, 68 at once. Mallory sends thousands; alice sends
    one every 0.2 s: every one of alice's arrives, mallory's are cut to its bucket."""
    cluster = make_cluster(ASYNC, secure=True, broker={"fragments": 1})
    ep, run, b = cluster.endpoints, cluster.endpoints.run_id, cluster.broker
    create_keys(ep.keys_dir, learners=["alice", "mallory"], broker=False, monitors=())
    sub = _socket(ctx, zmq.SUB, ep.keys_dir, "monitor", ep.broker_sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    alice = _socket(ctx, zmq.PUB, ep.keys_dir, "alice", ep.broker_pub)
    mallory = _socket(ctx, zmq.PUB, ep.keys_dir, "mallory", ep.broker_pub)
    wait_until(lambda: alice.send_multipart(_upd(run, "alice")) or sub.poll(50), 10, what="the link up")
    _drain(sub, 100)
    flood = _upd(run, "mallory")
    started = time.monotonic()
    for i in range(10):
        for _ in range(500):
            mallory.send_multipart(flood)
        alice.send_multipart(_upd(run, "alice", 0))
        wait_until(lambda: b.stats.refused.get("rate_limited", 0) >= 100 * (i + 1), 10, what="the flood cut")
        sub.poll(200)
    elapsed = time.monotonic() - started
    got = _drain(sub)
    alices = sum(m.sender == "alice" for m in got)
    mallorys = sum(m.sender == "mallory" for m in got)
    assert alices == 10, (alices, b.stats.refused)
    assert mallorys <= 68 + 10 * elapsed + 10, (mallorys, elapsed)
    assert b.stats.refused["rate_limited"] >= 1000, b.stats.refused


def test_a_peer_that_never_reads_gets_one_state_in_flight_not_one_per_second(ctx):
    """A learner's real network thread serving a 64 MiB state: a client that asks every 20 ms and
    reads nothing makes it snapshot once (the serve waits for the reader; the rest are "busy"),
    not once per second with every state queued."""
    from common.redis_server import free_port
    from learner.network import PeerState, PeerStateWanted
    ep = Endpoints(run_id="r", broker_pub=f"tcp://127.0.0.1:{free_port()}", broker_sub=f"tcp://127.0.0.1:{free_port()}")
    nt, inbox = _learner_thread(ep, [8], shards=1)
    runner = threading.Thread(target=nt.run, daemon=True)
    runner.start()
    wanted = []

    def training() -> None:            # the training thread's part: a fresh snapshot per request
        while not nt.stop.is_set():
            try:
                item = inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, PeerStateWanted):
                wanted.append(item)
                nt.outbox.put(PeerState(item.identity, item.requester,
                                        {"model": {"w": torch.zeros(16 << 20)}, "optimizer": {"state": {}},
                                         "versions": [0]}))
    threading.Thread(target=training, daemon=True).start()
    try:
        wait_until(lambda: nt.peer_endpoint, 10, what="the peer endpoint bound")
        asker = ctx.socket(zmq.DEALER)
        asker.setsockopt(zmq.LINGER, 0)
        asker.setsockopt(zmq.RCVHWM, 1)        # takes nothing from the connection once one message waits
        asker.connect(nt.peer_endpoint)
        wait_until(lambda: asker.send_multipart(wire.encode_peer_ask("mallory")) or nt.peer_requests_refused >= 150, 30,
                   interval_s=0.02, what="3 s of requests")
        assert len(wanted) == 1, f"{len(wanted)} snapshots for a client that never read"
        assert nt._serving is not None and nt._serving["next"] < len(nt._serving["pieces"])
    finally:
        nt.stop.set()
        runner.join(10)


def test_a_peer_that_stops_reading_holds_no_snapshot_and_is_served_no_state_again(ctx, monkeypatch):
    """Once its serve is abandoned, what the learner still queues for that connection is copies
    of at most PEER_SNDHWM chunks of 1 MiB (the 96 MiB snapshot itself is freed), and the member
    that stopped reading gets "busy" from then on: no fresh snapshot per second for it."""
    from common.redis_server import free_port
    from learner import peer_link
    from learner.network import PeerState, PeerStateWanted
    monkeypatch.setattr(peer_link, "PEER_STALL_S", 1.0)
    ep = Endpoints(run_id="r", broker_pub=f"tcp://127.0.0.1:{free_port()}", broker_sub=f"tcp://127.0.0.1:{free_port()}")
    nt, inbox = _learner_thread(ep, [8], shards=1)
    runner = threading.Thread(target=nt.run, daemon=True)
    runner.start()
    snapshots = []

    def training() -> None:
        while not nt.stop.is_set():
            try:
                item = inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, PeerStateWanted):   # 96 MiB, every page touched (a mapping of its own)
                snapshots.append(1)
                nt.outbox.put(PeerState(item.identity, item.requester, {
                    "model": {"w": torch.ones(24 << 20)}, "optimizer": {"state": {}}, "versions": [0]}))
                del item
    threading.Thread(target=training, daemon=True).start()
    try:
        wait_until(lambda: nt.peer_endpoint, 10, what="the peer endpoint bound")
        before = _rss_mib()
        asker = ctx.socket(zmq.DEALER)
        asker.setsockopt(zmq.LINGER, 0)
        asker.setsockopt(zmq.RCVHWM, 1)
        asker.connect(nt.peer_endpoint)
        ask = lambda: asker.send_multipart(wire.encode_peer_ask("mallory"))  # noqa: E731
        wait_until(lambda: ask() or nt.peer_serves_abandoned >= 1, 20, interval_s=0.05, what="the serve abandoned")
        refused = nt.peer_requests_refused
        wait_until(lambda: ask() or nt.peer_requests_refused >= refused + 60, 20, interval_s=0.05,
                   what="3 s more of requests")
        assert len(snapshots) == 1, f"{len(snapshots)} snapshots for a member that stopped reading"
        wait_until(lambda: _rss_mib() < before + 48, 10,
                   what=f"the abandoned snapshot freed (resident {_rss_mib():.0f} MiB, {before:.0f} before the ask)")
    finally:
        nt.stop.set()
        runner.join(10)


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def test_a_subscriber_that_leaves_does_not_cut_another_members_subscription(make_cluster, ctx):
    """libzmq reports a subscriber's disconnection without naming it: the topic another member
    still holds must keep flowing (it goes upstream once and stays)."""
    cluster = make_cluster(ASYNC, secure=True, broker={"shards": 1})
    ep, run = cluster.endpoints, cluster.endpoints.run_id
    create_keys(ep.keys_dir, learners=["alice", "bob"], broker=False, monitors=())
    subs = {}
    for name in ("alice", "bob"):
        subs[name] = _socket(ctx, zmq.SUB, ep.keys_dir, name, ep.broker_sub)
        subs[name].setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, wire.OPEN))
    pub = _socket(ctx, zmq.PUB, ep.keys_dir, "shard0", ep.broker_pub)
    opened = lambda: pub.send_multipart(wire.encode(kind=wire.OPEN, run=run, sender="shard0", fragment=0))  # noqa: E731
    for name in ("alice", "bob"):
        wait_until(lambda: opened() or subs[name].poll(50), 10, what=f"{name} subscribed")
    _drain(subs["bob"], 100)
    before = cluster.broker.stats.subscriptions
    subs["alice"].close(linger=0)
    wait_until(lambda: cluster.broker.stats.subscriptions > before, 10, what="alice's leaving seen by the broker")
    _drain(subs["bob"], 100)
    for _ in range(5):
        opened()
    assert len(_drain(subs["bob"], 500)) == 5


def test_a_keyed_broker_without_a_shard_count_refuses_to_start(tmp_path):
    """It would refuse every shard message: one line and exit 2 instead of a run that never merges."""
    import subprocess
    import sys
    create_keys(tmp_path / "k", shards=1)
    res = subprocess.run([sys.executable, "-m", "ddloco", "broker", "--keys", str(tmp_path / "k"),
                          "--xsub", "tcp://127.0.0.1:0", "--xpub", "tcp://127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--shards S, or --run-id" in res.stderr, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
