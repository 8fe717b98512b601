"""The learner's network thread: it owns every ZeroMQ socket of a learner (ALGORITHM §4, §6).

It subscribes to the run's ``open`` and ``frag`` topics through the broker, publishes answers
(delta against the base and its quantisation, one pass over the fragment for int8/int4; the
encoder refuses NaN/inf: all off the training thread), resolves a broadcast update on the
published base as it decodes it (one pass), and asks the owning shards for full fragments
(join, version gaps). Everything it exchanges with the training thread is one of the typed
messages of learner/messages.py, through two queues:

    inbox  (network -> training):  FragmentArrived, RoundOpened, StateRequested,
                                   PeerStateWanted, PeerStateArrived
    outbox (training -> network):  Answer, Fetch, Have, PeerState, AskPeer

Peer bootstrap (ALGORITHM §8) runs on a ROUTER socket of its own (``peer_bind``), in
learner/peer_link.py: a joining learner's DEALER asks for the state; the training thread
snapshots at its next step boundary (``PeerState``) and this thread sends it in chunks.

Ownership: every attribute of ``NetworkThread`` and its counters (``stats``) belong to the
network thread. Other threads read ``published`` (a frozen ``NetworkReadings``, replaced whole
once per loop), ``peer_endpoint`` and ``peer_progress_at`` (learner/peer_link.py).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch
import zmq

from common import quant, wire
from common.config import Endpoints
from common.links import keep_alive
from common.rpc import FragmentClient
from common.security import Security, sent_by_owner
from common.thread_cpu import ThreadCpu
from learner.messages import (Answer, AskPeer, Fetch, FragmentArrived, Have, PeerState,  # noqa: F401 (importable here)
                              PeerStateArrived, PeerStateWanted, RoundOpened, StateRequested)
from learner.outbox import Outbox
from learner.peer_link import (CHUNK_BYTES, MAX_STATE_BYTES, PEER_MAX_FRAME_BYTES,  # noqa: F401 (importable here)
                               PEER_SERVE_INTERVAL_S, PEER_SNDHWM, PEER_STALL_S, PeerLink, flatten_state,
                               optimizer_digest, unflatten_state)
from learner.stats import NetworkReadings

POLL_MS = 100
"""The network thread wakes at least this often (stop, shard endpoints); sockets and the outbox's
pipe wake it at once."""
STAGED_POLL_MS = 1
"""The poll while an answer's snapshot is still on its way to the host (a CUDA learner)."""
IO_CPU_EVERY_S = 1.0
"""How often the network thread reads libzmq's I/O threads' CPU (``io_cpu_s``) from /proc."""


class NetworkThread(PeerLink):
    """``run()`` is the thread's body: until ``stop``, send what the outbox holds and turn what
    arrives into inbox messages. Counters go to ``stats`` (bytes_up, bytes_down, bytes_fetched,
    chunks_fetched, malformed, nonfinite_answers: this thread's own), published to the other
    threads as ``published`` once per loop."""

    def __init__(self, *, learner_id: str, endpoints: Endpoints, codec: str, numels: Sequence[int],
                 inbox: queue.SimpleQueue, outbox: Outbox, stats: Any,
                 shard_endpoints: Callable[[], tuple[int, dict[int, str]]], stop: threading.Event,
                 peer_bind: str = "tcp://127.0.0.1:0", advertise_host: str = "", log: Any = None) -> None:
        self.id = learner_id
        self.security = Security(endpoints.keys_dir, learner_id) if endpoints.keys_dir else None
        """CURVE: a client of the broker and the shards, the server of its peer endpoint."""
        self.peer_bind = peer_bind
        self.advertise_host = advertise_host
        self.log = log
        self._init_peer_link()
        self.not_owner = 0
        """Shards' messages (open, frag, need) whose sender does not own the fragment: dropped."""
        self.shards = 0
        """S as the network thread last read it (fragment p is owned by shard<p % S>)."""
        self.endpoints = endpoints
        self.codec = codec
        self.numels = list(numels)
        """Flat length of each fragment: anything else is malformed."""
        self._io_read_at = float("-inf")
        self._io_cpu = ThreadCpu()
        self.inbox = inbox
        self.outbox = outbox
        self._wake: Outbox | None = outbox if isinstance(outbox, Outbox) else None
        self._wake_fd: int | None = None if self._wake is None else self._wake.fd
        self.stats = stats
        self.bases: Callable[[], Any] | None = None
        """The training thread's bases as last published (``Learner._bases``): an update built on
        the published base is resolved to its full value here, off the training thread."""
        self.stage: Callable[[torch.Tensor], Any] | None = None
        """A CUDA learner's ``HostStaging.prefetch``: a merged value's copy to the device starts here."""
        self.published = NetworkReadings.of(stats)
        """What the other threads read of ``stats``: a frozen copy, replaced once per loop."""
        self.thread_ident: int | None = None
        """The thread running ``run`` (its CPU clock: ``time.pthread_getcpuclockid``), once it runs."""
        self.shard_endpoints = shard_endpoints
        self.stop = stop
        self.malformed = 0
        self._delta: torch.Tensor | None = None
        """The answers' δ buffer (the largest fragment answered so far), where they are not
        quantised as they are subtracted (``_encode_delta``)."""
        self._staged: list[Answer] = []
        """Answers taken from the outbox whose snapshot is still being copied to the host."""

    def _open_sockets(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
        """(SUB of the broadcasts, PUB of the answers, ROUTER of our peer endpoint), connected."""
        sec, run = self.security, self.endpoints.run_id
        sub = keep_alive(ctx.socket(zmq.SUB))
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 10_000)
        sub.setsockopt(zmq.MAXMSGSIZE, wire.max_frame_bytes(max(self.numels, default=0)))
        if sec is not None:
            sec.client(sub, "broker")
        sub.connect(self.endpoints.broker_sub)
        for kind in (wire.OPEN, wire.FRAG, wire.NEED):
            sub.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, kind))
        pub = keep_alive(ctx.socket(zmq.PUB))
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 1_000)
        pub.setsockopt(zmq.MAXMSGSIZE, wire.HEADER_SLACK_BYTES)   # it receives subscriptions only
        if sec is not None:
            sec.client(pub, "broker")
        pub.connect(self.endpoints.broker_pub)
        peer = keep_alive(ctx.socket(zmq.ROUTER))
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.SNDHWM, PEER_SNDHWM)    # sent as the joiner reads (``_continue_serve``)
        peer.setsockopt(zmq.ROUTER_MANDATORY, 1)    # a full queue says so (EAGAIN), never drops silently
        peer.setsockopt(zmq.MAXMSGSIZE, wire.HEADER_SLACK_BYTES)   # requests: a few bytes
        if sec is not None:
            sec.server(peer, "peer")
        peer.bind(self.peer_bind)
        bound = peer.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peer_endpoint = bound if not self.advertise_host else \
            f"tcp://{self.advertise_host}:{bound.rsplit(':', 1)[1]}"
        return sub, pub, peer

    def run(self) -> None:
        self.thread_ident = threading.get_ident()
        ctx = zmq.Context()
        sec = self.security
        if sec is not None:
            sec.start_zap(ctx)
        sub, pub, peer = self._open_sockets(ctx)
        client = FragmentClient(ctx, run_id=self.endpoints.run_id, sender=self.id, security=sec, numels=self.numels)
        self._ctx = ctx
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(peer, zmq.POLLIN)
        if self._wake_fd is not None:
            poller.register(self._wake_fd, zmq.POLLIN)
        self._poller = poller
        registered: dict[int, zmq.Socket] = {}
        unsent_fetch: set[int] = set()
        try:
            while not self.stop.is_set():
                self._follow_shards(client, registered)
                self.send(pub, client, unsent_fetch, peer)
                self._continue_serve(peer)
                # a state in flight is fed as the joiner's queue drains: poll briefly meanwhile
                wait_ms = STAGED_POLL_MS if self._staged or self._serving else POLL_MS if self._wake_fd is not None else 5
                for sock, _ in poller.poll(wait_ms):
                    if sock == self._wake_fd:
                        self._wake.drain_wakeups()   # what was put is sent at the top of the loop
                    elif sock is sub:
                        self.receive_broadcasts(sub)
                    elif sock is peer:
                        self.on_peer_request(peer)
                    elif sock in self._asks:
                        self.on_peer_reply(sock)
                    else:
                        for msg in client.receive(sock):
                            self.on_fragment(msg, requested=True)
                self.stats.malformed = self.malformed + client.malformed
                self.stats.chunks_fetched = client.chunks
                self.stats.net_cpu_s = time.thread_time()
                now = time.monotonic()
                if now >= self._io_read_at + IO_CPU_EVERY_S:   # /proc: ~0.1 ms, not every loop
                    self._io_read_at = now
                    self.stats.io_cpu_s = self._io_cpu.seconds() or 0.0
                self.published = NetworkReadings.of(self.stats)
        finally:
            self.stats.io_cpu_s = self._io_cpu.seconds() or self.stats.io_cpu_s   # the last second's too
            self.published = NetworkReadings.of(self.stats)
            client.close()
            if sec is not None:
                sec.stop_zap(ctx)
            ctx.destroy(linger=0)

    def _follow_shards(self, client: FragmentClient, registered: dict[int, zmq.Socket]) -> None:
        """The shards' endpoints as the control thread last published them."""
        shards, eps = self.shard_endpoints()
        self.shards = shards
        if client.differs(shards, eps):
            bad = dict(client.bad_endpoints)
            client.set_endpoints(shards, eps)
            client.sync_poller(self._poller, registered)
            if self.log is not None and client.bad_endpoints and client.bad_endpoints != bad:
                self.log.warning("learner.bad_shard_endpoint", shards=client.bad_endpoints)

    def send(self, pub: zmq.Socket, client: FragmentClient, unsent_fetch: set[int], peer: Any = None) -> None:
        """Requests that could not be sent yet (no endpoint), then everything in the outbox."""
        for p in list(unsent_fetch):
            if client.request(p):
                unsent_fetch.discard(p)
        self._send_staged(pub)
        while True:
            try:
                item = self.outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, PeerState):
                self.serve_state(peer, item)
                self._serve_pending = self._serving is not None
                continue
            if isinstance(item, AskPeer):
                self.ask_peer(item)
                continue
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
            self._staged.append(item)
            self._send_staged(pub)

    def _send_staged(self, pub: zmq.Socket) -> None:
        """Answers whose snapshot is on the host (a CUDA learner's copy to pinned memory done: its
        event is queried, never waited on, so this thread keeps receiving meanwhile), in order."""
        while self._staged and (self._staged[0].ready is None or self._staged[0].ready.query()):
            self._send_answer(pub, self._staged.pop(0))

    def _send_answer(self, pub: zmq.Socket, a: Answer) -> None:
        try:
            payload = self._encode_delta(a.snapshot, a.base_values)
        except quant.CodecError:                               # NaN/inf: every codec refuses them
            self.stats.nonfinite_answers += 1                  # diverged: never send NaN/inf
            return
        frames = wire.encode(kind=wire.UPDATE, run=self.endpoints.run_id, sender=self.id, fragment=a.fragment,
                             encoded=(payload, a.snapshot.numel()), codec=self.codec, epoch=a.epoch, round=a.round,
                             attempt=a.attempt, base=a.base, steps=a.steps, tokens=a.tokens, final=a.final)
        try:
            pub.send_multipart(frames, zmq.NOBLOCK, copy=False)
            self.stats.bytes_up += wire.message_nbytes(frames)
        except zmq.Again:
            pass

    def _encode_delta(self, snapshot: torch.Tensor, base: torch.Tensor) -> list[Any]:
        """The codec's frames of δ_m = θ_{m,p} − Θ_p^{base_m}: int8/int4 quantised as they are
        subtracted, in one pass (the C kernels); otherwise δ in a buffer kept for the next answer (a
        fresh one costs its page faults), then encoded (the frames never alias it)."""
        fused = quant.encode_diff(snapshot, base, self.codec)
        if fused is not None:
            return fused
        n = snapshot.numel()
        if self._delta is None or self._delta.numel() < n:
            self._delta = torch.empty(n, dtype=torch.float32)
        return quant.encode(torch.sub(snapshot, base, out=self._delta[:n]), self.codec)

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
            elif not sent_by_owner(msg.sender, msg.fragment, self.shards):   # every kind here is a shard's
                self.not_owner += 1
                self.malformed += 1
            elif msg.kind == wire.OPEN:
                self.inbox.put(RoundOpened(msg.fragment, msg.epoch, msg.round, msg.attempt, msg.version))
            elif msg.kind == wire.FRAG:
                self.on_fragment(msg, requested=False)
            elif msg.kind == wire.NEED:
                self.inbox.put(StateRequested(msg.fragment))

    def on_fragment(self, msg: wire.Message, *, requested: bool) -> None:
        """A merged fragment (broadcast or reply): decoded here (an update on the published base
        made the full value as it is decoded), applied by the training thread."""
        if msg.fragment >= len(self.numels) or msg.numel != self.numels[msg.fragment]:
            self.malformed += 1
            return
        update_base = msg.base if msg.base >= 0 and not requested else -1
        try:
            full = self._resolve(msg, update_base) if update_base >= 0 else None
            values = full if full is not None else msg.values()
        except wire.WireError:
            self.malformed += 1
            return
        if full is not None:
            update_base = -1
        self.stats.bytes_down += msg.payload_nbytes
        if requested:   # full values fetched (join, repairs): counted apart from the broadcasts
            self.stats.bytes_fetched += msg.payload_nbytes
        on_device = self.stage(values) if self.stage is not None and update_base < 0 and not requested else None
        self.inbox.put(FragmentArrived(msg.fragment, msg.epoch, msg.version, values, requested, update_base,
                                       on_device))

    def _resolve(self, msg: wire.Message, update_base: int) -> torch.Tensor | None:
        """Θ_v = Θ_base + deq(update) in fp32, as the shard computed it (bit-identical), when the
        published base of the update's fragment is ``update_base`` of its epoch; None otherwise (the
        training thread decides: learner/receipt.py ``_resolve_update``). Computed as the payload is
        decoded (one pass, ``Message.values_added_to``), into ordinary host memory: it becomes the
        learner's base of the fragment (a CUDA learner's copy to the device starts from a pinned
        copy of it, ``HostStaging.prefetch``; a base kept in pinned memory cost an H200 learner
        ~2 GB of host RSS at 1 B parameters: pinned blocks are sized in powers of two). Raises as
        ``values()``."""
        bases = self.bases() if self.bases is not None else None
        if bases is None:
            return None
        p = msg.fragment
        base = bases.values[p]
        if base is None or int(bases.epochs[p]) != msg.epoch or int(bases.versions[p]) != update_base:
            return None
        return msg.values_added_to(base)
