"""Peer bootstrap's frame layout (common/wire.py): one encoder per message and its exact inverse,
a version in every head; a message of another version is refused and counted like a malformed one,
on both sides of a real ROUTER/DEALER pair."""
from __future__ import annotations

import queue
import threading
import zlib

import msgpack
import pytest
import zmq

from common import wire
from common.config import Endpoints
from learner.messages import PeerStateArrived, PeerStateWanted
from learner.network import NetworkThread
from learner.stats import LearnerStats

pytestmark = pytest.mark.timeout(30)


def _other_version(frames: list) -> list:
    head = msgpack.unpackb(frames[1], raw=False)
    return [frames[0], msgpack.packb({**head, "v": wire.PEER_VERSION + 1}, use_bin_type=True), *frames[2:]]


def test_every_peer_message_decodes_to_what_was_encoded() -> None:
    ask = wire.decode_peer(wire.encode_peer_ask("joiner-1"))
    assert (ask.verb, ask.head) == (wire.PEER_ASK, {"from": "joiner-1"})
    assert wire.decode_peer(wire.encode_peer_busy()).verb == wire.PEER_BUSY
    state = wire.decode_peer(wire.encode_peer_state({"a": {"__t": 0}, 3: [1, 2]}, [8, 0], 2))
    assert state.head == {"skeleton": {"a": {"__t": 0}, 3: [1, 2]}, "sizes": [8, 0], "pieces": 2}
    piece = bytes(range(200))
    chunk = wire.decode_peer(wire.encode_peer_chunk(1, 4096, memoryview(piece)))
    assert chunk.head == {"i": 1, "off": 4096, "crc": zlib.crc32(piece)} and chunk.piece == piece


@pytest.mark.parametrize("frames", [wire.encode_peer_ask("x"), wire.encode_peer_busy(),
                                    wire.encode_peer_state({}, [], 0),
                                    wire.encode_peer_chunk(0, 0, b"abc")])
def test_a_peer_message_of_another_version_is_refused(frames: list) -> None:
    with pytest.raises(wire.PeerVersionError, match="version"):
        wire.decode_peer(_other_version(frames))


@pytest.mark.parametrize("frames", [[b"state?", b"mallory"], [b"state?"], [b"hello", b"\x80"],
                                    [b"chunk", msgpack.packb({"v": wire.PEER_VERSION, "i": 0, "off": 0})]])
def test_a_malformed_peer_message_is_a_wire_error(frames: list) -> None:
    with pytest.raises(wire.WireError):
        wire.decode_peer(frames)


def test_a_damaged_chunk_is_a_payload_error() -> None:
    frames = wire.encode_peer_chunk(0, 0, b"abcd")
    with pytest.raises(wire.PayloadError):
        wire.decode_peer([frames[0], frames[1], b"abce"])


@pytest.fixture
def pair():
    """A real ROUTER (the serving learner's) and DEALER (a joiner's), inproc."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://peer")
    dealer.connect("inproc://peer")
    yield ctx, router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _network() -> NetworkThread:
    return NetworkThread(learner_id="l", endpoints=Endpoints(run_id="r"), codec="fp32", numels=[4],
                         inbox=queue.SimpleQueue(), outbox=queue.SimpleQueue(), stats=LearnerStats(),
                         shard_endpoints=lambda: (0, {}), stop=threading.Event())


def test_a_request_of_another_version_is_counted_as_malformed_and_not_served(pair) -> None:
    _, router, dealer = pair
    nt = _network()
    dealer.send_multipart(_other_version(wire.encode_peer_ask("joiner")))
    dealer.send_multipart([b"state?", b"joiner"])                 # no version at all
    dealer.send_multipart(wire.encode_peer_ask("joiner"))
    assert router.poll(5000)
    while nt.inbox.qsize() == 0:
        router.poll(1000)
        nt.on_peer_request(router)
    assert nt.malformed == 2
    wanted = nt.inbox.get_nowait()
    assert isinstance(wanted, PeerStateWanted) and wanted.requester == "joiner"
    assert nt.inbox.qsize() == 0


def test_a_reply_of_another_version_ends_the_ask_counted_as_malformed(pair) -> None:
    _, router, dealer = pair
    nt = _network()
    nt._poller = zmq.Poller()
    nt._poller.register(dealer, zmq.POLLIN)
    nt._asks[dealer] = {"peer": "p", "header": None, "chunks": {}}
    dealer.send_multipart(wire.encode_peer_ask("l"))
    identity = router.recv_multipart()[0]
    router.send_multipart([identity, *_other_version(wire.encode_peer_state({}, [], 0))])
    assert dealer.poll(5000)
    nt.on_peer_reply(dealer)
    assert nt.malformed == 1 and dealer not in nt._asks
    arrived = nt.inbox.get_nowait()
    assert isinstance(arrived, PeerStateArrived) and arrived.state is None and "version" in arrived.error
