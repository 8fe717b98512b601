"""The learner's outbox: answers bounded per fragment, a wake-up the network thread can poll."""
from __future__ import annotations

import contextlib
import os
import queue
import select

import pytest
import torch

from learner.network import Answer, Fetch, Outbox


def _answer(fragment: int, round: int) -> Answer:
    x = torch.zeros(4)
    return Answer(fragment=fragment, epoch=1, round=round, attempt=0, base=0, base_values=x, snapshot=x,
                  steps=1, tokens=1)


def _network(codec: str, numels: list[int]):
    """A learner's network thread (not started: the test drives ``send``), its outbox and stats."""
    import threading
    from common.config import Endpoints
    from learner.core import LearnerStats
    from learner.network import NetworkThread
    stats, box = LearnerStats(), Outbox()
    net = NetworkThread(learner_id="l", endpoints=Endpoints(run_id="r"), codec=codec, numels=numels,
                        inbox=queue.SimpleQueue(), outbox=box, stats=stats, shard_endpoints=lambda: (0, {}),
                        stop=threading.Event())
    return net, box, stats


@contextlib.contextmanager
def _pub_sub(name: str):
    """An inproc PUB and a SUB subscribed to everything on it."""
    import zmq
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        pub.bind(f"inproc://{name}")
        sub.connect(f"inproc://{name}")
        yield pub, sub
    finally:
        pub.close(0)
        sub.close(0)
        ctx.term()


def test_a_newer_answer_replaces_the_unsent_older_one_of_its_fragment_and_is_counted() -> None:
    box = Outbox()
    try:
        assert not select.select([box.fd], [], [], 0)[0]
        box.put(_answer(0, 1))
        assert select.select([box.fd], [], [], 0)[0]          # the network thread would wake now
        box.drain_wakeups()
        assert not select.select([box.fd], [], [], 0)[0]
        box.put(_answer(1, 1))
        box.put(_answer(0, 2))                                 # replaces round 1 of fragment 0
        box.put(Fetch((3,)))
        assert box.replaced == 1 and box.qsize() == 3
        got = [box.get_nowait() for _ in range(3)]
        assert isinstance(got[0], Fetch)                       # requests go first
        assert [(a.fragment, a.round) for a in got[1:]] == [(1, 1), (0, 2)]
        with pytest.raises(queue.Empty):
            box.get_nowait()
    finally:
        box.close()
    box.put(_answer(0, 3))                                     # after close: kept, no write to a stale fd
    assert box.qsize() == 1


def test_a_forked_process_gets_a_pipe_of_its_own() -> None:
    box = Outbox()
    try:
        box._pid = -1                                          # as seen from a fork of the creator
        box.own_pipe()
        assert box._pid == os.getpid() and box.fd >= 0
        box.put(_answer(0, 1))
        assert select.select([box.fd], [], [], 0)[0]
    finally:
        box.close()


@pytest.mark.parametrize("codec", ["int4", "fp32"])
def test_the_network_thread_sends_deltas_and_counts_a_non_finite_one_without_sending_it(codec) -> None:
    """δ = snapshot − base is computed in a buffer reused from answer to answer; a NaN/inf δ is
    refused by the codec, counted, and never published."""
    from common import wire
    net, box, stats = _network(codec, [8, 8])
    with _pub_sub("answers") as (pub, sub), contextlib.closing(box):
        base = torch.arange(8, dtype=torch.float32)
        bad = base.clone()
        bad[3] = float("nan")
        for fragment, snapshot in ((0, base + 1.0), (1, bad)):
            box.put(Answer(fragment=fragment, epoch=1, round=0, attempt=0, base=0, base_values=base,
                           snapshot=snapshot, steps=2, tokens=8))
        pending: set = set()
        while not sub.poll(0):             # the first publish may precede the subscription: resend
            box.put(Answer(fragment=0, epoch=1, round=0, attempt=0, base=0, base_values=base,
                           snapshot=base + 1.0, steps=2, tokens=8))
            net.send(pub, None, pending)
        msg = wire.decode(sub.recv_multipart())
        assert msg.fragment == 0 and torch.allclose(msg.values(), torch.ones(8), atol=0.2)
        assert stats.nonfinite_answers >= 1
        sent = []
        while sub.poll(50):
            sent.append(wire.decode(sub.recv_multipart()).fragment)
        assert 1 not in sent


def test_the_network_thread_sends_a_staged_snapshot_only_once_its_copy_is_done() -> None:
    """A CUDA learner's answer carries the event of its device-to-host copy (learner/staging.py):
    the network thread queries it, keeps the answer while the copy runs (without blocking: it goes
    on receiving), and computes δ only once the copy is done, never from a half-copied snapshot."""
    from common import wire
    base = torch.arange(8, dtype=torch.float32)

    class Copy:        # stands in for a CUDA event: the copy lands at the second query
        def __init__(self, target: torch.Tensor) -> None:
            self.target, self.queries = target, 0

        def query(self) -> bool:
            self.queries += 1
            if self.queries == 2:
                self.target.copy_(base + 2.0)
            return self.queries >= 2

    net, box, _ = _network("fp32", [8])
    with _pub_sub("staged") as (pub, sub), contextlib.closing(box):
        while not sub.poll(0):             # the first publish may precede the subscription: resend
            box.put(Answer(fragment=1, epoch=1, round=0, attempt=0, base=0, base_values=base,
                           snapshot=base, steps=2, tokens=8))
            net.send(pub, None, set())
        while sub.poll(20):
            sub.recv_multipart()
        copy = Copy(snapshot := torch.zeros(8))     # not copied yet
        box.put(Answer(fragment=0, epoch=1, round=0, attempt=0, base=0, base_values=base,
                       snapshot=snapshot, steps=2, tokens=8, ready=copy))
        net.send(pub, None, set())
        assert copy.queries == 1 and not sub.poll(50)      # kept, not sent, not waited on
        net.send(pub, None, set())
        msg = wire.decode(sub.recv_multipart())
        assert msg.fragment == 0 and torch.equal(msg.values(), torch.full((8,), 2.0))
