"""The learner's network thread: it owns every ZeroMQ socket of a learner (ALGORITHM §4, §6).

It subscribes to the run's ``open`` and ``frag`` topics through the broker, publishes answers
(delta against the base, finite check, quantisation: all off the training thread), and asks
the owning shards for full fragments (join, version gaps). Everything it exchanges with the
training thread is one of the typed messages below, through two queues:

    inbox  (network -> training):  FragmentArrived, RoundOpened, StateRequested
    outbox (training -> network):  Answer, Fetch, Have
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import zmq

from common import wire
from common.config import Endpoints
from common.rpc import FragmentClient


@dataclass(frozen=True)
class FragmentArrived:
    """Network -> training: a merged fragment (broadcast, or the reply to a Fetch)."""

    fragment: int
    epoch: int
    version: int
    values: torch.Tensor
    requested: bool


@dataclass(frozen=True)
class RoundOpened:
    """Network -> training: round ``round`` of ``fragment`` is open at ``version``."""

    fragment: int
    epoch: int
    round: int
    attempt: int
    version: int


@dataclass(frozen=True)
class Answer:
    """Training -> network: a snapshot to answer a round with (delta computed off-thread)."""

    fragment: int
    epoch: int
    round: int
    attempt: int
    base: int
    base_values: torch.Tensor
    snapshot: torch.Tensor
    steps: int
    tokens: int


@dataclass(frozen=True)
class StateRequested:
    """Network -> training: a (re)started shard asks for our copy of ``fragment``."""

    fragment: int


@dataclass(frozen=True)
class Have:
    """Training -> network: our base value of ``fragment`` (the merged value at ``version``)."""

    fragment: int
    epoch: int
    version: int
    values: torch.Tensor


@dataclass(frozen=True)
class Fetch:
    """Training -> network: ask the owning shards for the full current value of these fragments."""

    fragments: tuple[int, ...]


class NetworkThread:
    """``run()`` is the thread's body: until ``stop``, send what the outbox holds and turn what
    arrives into inbox messages. Counters go to ``stats`` (bytes_up, bytes_down, malformed,
    nonfinite_answers)."""

    def __init__(self, *, learner_id: str, endpoints: Endpoints, codec: str, numels: Sequence[int],
                 inbox: queue.SimpleQueue, outbox: queue.SimpleQueue, stats: Any,
                 shard_endpoints: Callable[[], tuple[int, dict[int, str]]], stop: threading.Event) -> None:
        self.id = learner_id
        self.endpoints = endpoints
        self.codec = codec
        self.numels = list(numels)
        """Flat length of each fragment: anything else is malformed."""
        self.inbox = inbox
        self.outbox = outbox
        self.stats = stats
        self.shard_endpoints = shard_endpoints
        self.stop = stop
        self.malformed = 0

    def run(self) -> None:
        ctx = zmq.Context()
        run = self.endpoints.run_id
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 10_000)
        sub.connect(self.endpoints.broker_sub)
        sub.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, wire.OPEN))
        sub.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, wire.FRAG))
        sub.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, wire.NEED))
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 1_000)
        pub.connect(self.endpoints.broker_pub)
        client = FragmentClient(ctx, run_id=run, sender=self.id)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        registered: dict[int, zmq.Socket] = {}
        unsent_fetch: set[int] = set()
        try:
            while not self.stop.is_set():
                shards, eps = self.shard_endpoints()
                if eps != client.endpoints or shards != client.shards:
                    client.set_endpoints(shards, eps)
                    client.sync_poller(poller, registered)
                self.send(pub, client, unsent_fetch)
                for sock, _ in poller.poll(5):
                    if sock is sub:
                        self.receive_broadcasts(sub)
                    else:
                        for msg in client.receive(sock):
                            self.on_fragment(msg, requested=True)
                self.stats.malformed = self.malformed + client.malformed
        finally:
            client.close()
            ctx.destroy(linger=0)

    def send(self, pub: zmq.Socket, client: FragmentClient, unsent_fetch: set[int]) -> None:
        """Requests that could not be sent yet (no endpoint), then everything in the outbox."""
        for p in list(unsent_fetch):
            if client.request(p):
                unsent_fetch.discard(p)
        while True:
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Fetch):
                for p in item.fragments:
                    if not client.request(p):
                        unsent_fetch.add(p)
                continue
            if isinstance(item, Have):  # exact (fp32): the shard continues from this value
                frames = wire.encode(kind=wire.HAVE, run=self.endpoints.run_id, sender=self.id,
                                     fragment=item.fragment, values=item.values, codec="fp32", epoch=item.epoch,
                                     version=item.version)
                try:
                    pub.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    self.stats.bytes_up += wire.message_nbytes(frames)
                except zmq.Again:
                    pass
                continue
            a: Answer = item
            delta = a.snapshot - a.base_values                    # δ_m = θ_{m,p} − Θ_p^{base_m}
            if not bool(torch.isfinite(delta).all()):
                self.stats.nonfinite_answers += 1                  # diverged: never send NaN/inf
                continue
            frames = wire.encode(kind=wire.UPDATE, run=self.endpoints.run_id, sender=self.id, fragment=a.fragment,
                                 values=delta, codec=self.codec, epoch=a.epoch, round=a.round, attempt=a.attempt,
                                 base=a.base, steps=a.steps, tokens=a.tokens)
            try:
                pub.send_multipart(frames, zmq.NOBLOCK, copy=False)
                self.stats.bytes_up += wire.message_nbytes(frames)
            except zmq.Again:
                pass

    def receive_broadcasts(self, sub: zmq.Socket) -> None:
        """Up to 256 waiting ``open`` and ``frag`` messages."""
        for _ in range(256):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = wire.decode(frames, expect_run=self.endpoints.run_id)
            except wire.WireError:
                self.malformed += 1
                continue
            if msg.fragment >= len(self.numels):
                self.malformed += 1
            elif msg.kind == wire.OPEN:
                self.inbox.put(RoundOpened(msg.fragment, msg.epoch, msg.round, msg.attempt, msg.version))
            elif msg.kind == wire.FRAG:
                self.on_fragment(msg, requested=False)
            elif msg.kind == wire.NEED:
                self.inbox.put(StateRequested(msg.fragment))

    def on_fragment(self, msg: wire.Message, *, requested: bool) -> None:
        """A merged fragment (broadcast or reply): decoded here, applied by the training thread."""
        if msg.fragment >= len(self.numels) or msg.numel != self.numels[msg.fragment]:
            self.malformed += 1
            return
        try:
            values = msg.values()
        except wire.WireError:
            self.malformed += 1
            return
        self.stats.bytes_down += msg.payload_nbytes
        self.inbox.put(FragmentArrived(msg.fragment, msg.epoch, msg.version, values, requested))
