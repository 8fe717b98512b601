"""The learner's network thread: it owns every ZeroMQ socket of a learner (ALGORITHM §4, §6).

It subscribes to the run's ``open`` and ``frag`` topics through the broker, publishes answers
(delta against the base, finite check, quantisation: all off the training thread), and asks
the owning shards for full fragments (join, version gaps). Everything it exchanges with the
training thread is one of the typed messages below, through two queues:

    inbox  (network -> training):  FragmentArrived, RoundOpened, StateRequested,
                                   PeerStateWanted, PeerStateArrived
    outbox (training -> network):  Answer, Fetch, Have, PeerState, AskPeer

Peer bootstrap (ALGORITHM §8) runs on a ROUTER socket of its own (``peer_bind``): a joining
learner's DEALER asks ``state?``; the training thread snapshots at its next step boundary
(``PeerState``) and this thread serialises it and sends it in chunks of ``CHUNK_BYTES``.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack
import torch
import zmq

from common import quant, wire
from common.config import Endpoints
from common.links import keep_alive
from common.rpc import FragmentClient
from common.security import Security, SecurityError, sent_by_owner

CHUNK_BYTES = 1 << 20
"""Peer state travels in chunks of this size (the I/O thread interleaves other traffic)."""
MAX_STATE_BYTES = 1 << 40
PEER_SERVE_INTERVAL_S = 1.0
"""A learner serves its state to joining peers at most this often (others get "busy" and load
from the shards)."""
"""A peer announcing more than this is refused (a garbled header must not allocate it)."""
PEER_SNDHWM = 16
"""Messages (chunks of CHUNK_BYTES) queued for one joining peer: a state is sent as the peer reads
it, so a peer that does not read costs at most this many chunks plus the one snapshot in flight."""
PEER_STALL_S = 30.0
"""A state whose reader took nothing for this long is abandoned (``peer_serves_abandoned``)."""
PEER_MAX_FRAME_BYTES = 64 << 20
"""ZMQ_MAXMSGSIZE of a joiner's socket: a chunk, or the state's skeleton (msgpack, ~100 bytes a tensor)."""


@dataclass(frozen=True)
class FragmentArrived:
    """Network -> training: a merged fragment (broadcast, or the reply to a Fetch). ``values`` is
    the full value when ``update_base`` is -1, else the update to add to version ``update_base``."""

    fragment: int
    epoch: int
    version: int
    values: torch.Tensor
    requested: bool
    update_base: int = -1


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
    ready: Any = None   # a CUDA learner's snapshot is complete once this event is (learner/staging.py)
    final: bool = False
    """Sent after the learner's last step (its flush): the shards open rounds without spacing meanwhile."""


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


@dataclass(frozen=True)
class PeerStateWanted:
    """Network -> training: a joining learner asks for our state (answer at a step boundary)."""

    identity: bytes
    requester: str


@dataclass(frozen=True)
class PeerState:
    """Training -> network: our state snapshot for ``identity`` (None: not ready to serve)."""

    identity: bytes
    requester: str
    state: dict[str, Any] | None
    snapshot_s: float = 0.0


@dataclass(frozen=True)
class AskPeer:
    """Training -> network: ask the learner at ``endpoint`` for its state."""

    peer: str
    endpoint: str


@dataclass(frozen=True)
class PeerStateArrived:
    """Network -> training: the state a peer sent (None: it could not serve)."""

    peer: str
    state: dict[str, Any] | None
    nbytes: int
    error: str = ""


def optimizer_digest(opt_state: dict[str, Any]) -> str:
    """sha256 over an optimizer ``state_dict()``'s per-parameter state tensors, in order (the
    serving and the joining learner log it: equal digests, equal AdamW state)."""
    import hashlib
    h = hashlib.sha256()
    for idx in sorted(opt_state.get("state", {})):
        for key in sorted(opt_state["state"][idx]):
            v = opt_state["state"][idx][key]
            h.update(f"{idx}:{key}:".encode())
            if isinstance(v, torch.Tensor):
                t = v.detach().to("cpu").contiguous().view(-1)
                h.update(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
            else:
                h.update(repr(v).encode())
    return h.hexdigest()[:16]


def flatten_state(state: Any, tensors: list[torch.Tensor]) -> Any:
    """The state with every tensor replaced by ``{"__t": i}`` (its index in ``tensors``): the
    rest travels as msgpack, the tensors as raw frames (no pickling, no copy on the way out)."""
    if isinstance(state, torch.Tensor):
        t = state.detach().to("cpu").contiguous()
        tensors.append(t)
        return {"__t": len(tensors) - 1, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(state, dict):
        return {k: flatten_state(v, tensors) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [flatten_state(v, tensors) for v in state]
    return state


def unflatten_state(skeleton: Any, buffers: list[bytes]) -> Any:
    if isinstance(skeleton, dict) and "__t" in skeleton:
        dtype = getattr(torch, str(skeleton["dtype"]))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {skeleton['dtype']!r}")
        buf = buffers[int(skeleton["__t"])]
        shape = [int(x) for x in skeleton["shape"]]
        t = torch.frombuffer(bytearray(buf), dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)
        return t.reshape(shape)
    if isinstance(skeleton, dict):
        return {k: unflatten_state(v, buffers) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten_state(v, buffers) for v in skeleton]
    return skeleton


class Outbox:
    """Training (and control) thread -> network thread, thread-safe.

    Bounded where it matters: at most one unsent ``Answer`` per fragment. A newer answer for a
    fragment replaces an older one still waiting (its round would merge without it anyway, and the
    newer snapshot holds every step the older one did); ``replaced`` counts them. Every ``put``
    writes a byte to a pipe whose read end the network thread polls with its sockets, so it
    sleeps until there is something to send (no timed polling)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: dict[int, Answer] = {}
        self._lock = threading.Lock()
        self.replaced = 0
        self.fd, self._wfd = -1, -1
        self._pid = 0
        self.own_pipe()

    def own_pipe(self) -> None:
        """A pipe of this process: after a fork (the standby factory forks prepared learners) the
        inherited one is shared with the parent and its other forks; call before the network thread."""
        if self._pid == os.getpid():
            return
        with self._lock:
            for fd in (self.fd, self._wfd):
                if fd >= 0:
                    os.close(fd)
            self.fd, self._wfd = os.pipe()
            os.set_blocking(self.fd, False)
            os.set_blocking(self._wfd, False)
            self._pid = os.getpid()

    def put(self, item: Any) -> None:
        if isinstance(item, Answer):
            with self._lock:
                if self._answers.pop(item.fragment, None) is not None:
                    self.replaced += 1
                self._answers[item.fragment] = item
        else:
            self._q.put(item)
        with self._lock:
            if self._wfd < 0:
                return                       # closed: nobody reads any more (never write to a reused fd)
            try:
                os.write(self._wfd, b"\0")
            except (BlockingIOError, OSError):   # the pipe is full: a wake-up is pending anyway
                pass

    def get_nowait(self) -> Any:
        """Requests first, then the oldest waiting answer; ``queue.Empty`` when nothing waits."""
        try:
            return self._q.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if not self._answers:
                raise queue.Empty
            return self._answers.pop(next(iter(self._answers)))

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except OSError:   # BlockingIOError: drained
            pass

    def qsize(self) -> int:
        with self._lock:
            return self._q.qsize() + len(self._answers)

    def close(self) -> None:
        """After the network thread ended."""
        with self._lock:
            fds, self.fd, self._wfd = (self.fd, self._wfd), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


POLL_MS = 100
"""The network thread wakes at least this often (stop, shard endpoints); sockets and the outbox's
pipe wake it at once."""
STAGED_POLL_MS = 1
"""The poll while an answer's snapshot is still on its way to the host (a CUDA learner)."""


class NetworkThread:
    """``run()`` is the thread's body: until ``stop``, send what the outbox holds and turn what
    arrives into inbox messages. Counters go to ``stats`` (bytes_up, bytes_down, malformed,
    nonfinite_answers)."""

    def __init__(self, *, learner_id: str, endpoints: Endpoints, codec: str, numels: Sequence[int],
                 inbox: queue.SimpleQueue, outbox: Outbox, stats: Any,
                 shard_endpoints: Callable[[], tuple[int, dict[int, str]]], stop: threading.Event,
                 peer_bind: str = "tcp://127.0.0.1:0", advertise_host: str = "", log: Any = None) -> None:
        self.id = learner_id
        self.security = Security(endpoints.keys_dir, learner_id) if endpoints.keys_dir else None
        """CURVE: a client of the broker and the shards, the server of its peer endpoint."""
        self.peer_bind = peer_bind
        self.advertise_host = advertise_host
        self.peer_endpoint = ""
        """Where joining learners reach our state (set once the socket is bound)."""
        self.log = log
        self._asks: dict[zmq.Socket, dict[str, Any]] = {}
        self._serve_pending = False
        self._last_serve_at = -1e9
        self._serving: dict[str, Any] | None = None
        """The state being sent (identity, pieces left, last progress): one at a time, paced by the reader."""
        self.peer_serves_abandoned = 0
        self.not_owner = 0
        """Shards' messages (open, frag, need) whose sender does not own the fragment: dropped."""
        self.shards = 0
        """S as the network thread last read it (fragment p is owned by shard<p % S>)."""
        self.peer_requests_refused = 0
        """State requests answered "busy": one serve at a time, at most one per PEER_SERVE_INTERVAL_S
        (a member asking in a loop must not make us snapshot and queue states without end)."""
        self.peer_progress_at = 0.0
        """time.monotonic() of the last part of a peer's state that arrived (the joiner's timeout
        runs from it: a big state keeps coming, a frozen peer stops)."""
        self.endpoints = endpoints
        self.codec = codec
        self.numels = list(numels)
        """Flat length of each fragment: anything else is malformed."""
        self.inbox = inbox
        self.outbox = outbox
        self._wake: Outbox | None = outbox if isinstance(outbox, Outbox) else None
        self._wake_fd: int | None = None if self._wake is None else self._wake.fd
        self.stats = stats
        self.shard_endpoints = shard_endpoints
        self.stop = stop
        self.malformed = 0
        self._delta: torch.Tensor | None = None
        """The answers' δ buffer (the largest fragment answered so far)."""
        self._staged: list[Answer] = []
        """Answers taken from the outbox whose snapshot is still being copied to the host."""

    def run(self) -> None:
        ctx = zmq.Context()
        sec = self.security
        if sec is not None:
            sec.start_zap(ctx)
        run = self.endpoints.run_id
        sub = keep_alive(ctx.socket(zmq.SUB))
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 10_000)
        sub.setsockopt(zmq.MAXMSGSIZE, wire.max_frame_bytes(max(self.numels, default=0)))
        if sec is not None:
            sec.client(sub, "broker")
        sub.connect(self.endpoints.broker_sub)
        sub.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, wire.OPEN))
        sub.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, wire.FRAG))
        sub.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(run, wire.NEED))
        pub = keep_alive(ctx.socket(zmq.PUB))
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 1_000)
        pub.setsockopt(zmq.MAXMSGSIZE, wire.HEADER_SLACK_BYTES)   # it receives subscriptions only
        if sec is not None:
            sec.client(pub, "broker")
        pub.connect(self.endpoints.broker_pub)
        client = FragmentClient(ctx, run_id=run, sender=self.id, security=sec, numels=self.numels)
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
                shards, eps = self.shard_endpoints()
                self.shards = shards
                if client.differs(shards, eps):
                    bad = dict(client.bad_endpoints)
                    client.set_endpoints(shards, eps)
                    client.sync_poller(poller, registered)
                    if self.log is not None and client.bad_endpoints and client.bad_endpoints != bad:
                        self.log.warning("learner.bad_shard_endpoint", shards=client.bad_endpoints)
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
        finally:
            client.close()
            if sec is not None:
                sec.stop_zap(ctx)
            ctx.destroy(linger=0)

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
        # δ_m = θ_{m,p} − Θ_p^{base_m}, in a buffer kept for the next answer (a fresh one costs
        # its page faults); the codec's frames never alias it
        if self._delta is None or self._delta.numel() < a.snapshot.numel():
            self._delta = torch.empty(a.snapshot.numel(), dtype=torch.float32)
        delta = torch.sub(a.snapshot, a.base_values, out=self._delta[:a.snapshot.numel()])
        try:
            frames = wire.encode(kind=wire.UPDATE, run=self.endpoints.run_id, sender=self.id,
                                 fragment=a.fragment, values=delta, codec=self.codec, epoch=a.epoch,
                                 round=a.round, attempt=a.attempt, base=a.base, steps=a.steps, tokens=a.tokens,
                                 final=a.final)
        except quant.CodecError:                               # NaN/inf: every codec refuses them
            self.stats.nonfinite_answers += 1                  # diverged: never send NaN/inf
            return
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
        if requested:   # full values fetched (join, repairs): counted apart from the broadcasts
            self.stats.bytes_fetched += msg.payload_nbytes
        update_base = msg.base if msg.base >= 0 and not requested else -1
        self.inbox.put(FragmentArrived(msg.fragment, msg.epoch, msg.version, values, requested, update_base))

    # ------------------------------------------------------------------ peer bootstrap
    def on_peer_request(self, peer: zmq.Socket) -> None:
        for _ in range(64):
            try:
                frames = peer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"state?":
                self.malformed += 1
                continue
            now = time.monotonic()
            if self._serve_pending or now - self._last_serve_at < PEER_SERVE_INTERVAL_S:
                self._peer_send(peer, [frames[0], b"busy"])   # one state at a time: the joiner asks the shards
                self.peer_requests_refused += 1
                continue
            self._serve_pending = True
            self._last_serve_at = now
            self.inbox.put(PeerStateWanted(frames[0], frames[2][:200].decode(errors="replace")))

    def serve_state(self, peer: zmq.Socket, item: PeerState) -> None:
        """Send the snapshot: a msgpack skeleton, then every tensor's bytes in frames of at most
        CHUNK_BYTES handed to ZeroMQ without a copy (its I/O thread sends them, without the GIL),
        each with its CRC32."""
        if item.state is None:
            self._peer_send(peer, [item.identity, b"busy"])
            return
        import msgpack
        t0 = time.perf_counter()
        tensors: list[torch.Tensor] = []
        skeleton = flatten_state(item.state, tensors)
        views = [memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"") for t in tensors]
        pieces = [(i, off, v[off:off + CHUNK_BYTES]) for i, v in enumerate(views)
                  for off in range(0, max(len(v), 1), CHUNK_BYTES)]
        nbytes = sum(len(v) for v in views)
        if not self._peer_send(peer, [item.identity, b"state", msgpack.packb(
                {"skeleton": skeleton, "sizes": [len(v) for v in views], "pieces": len(pieces)})]):
            return
        self._serving = {"identity": item.identity, "pieces": pieces, "next": 0, "progress_at": time.monotonic()}
        self._continue_serve(peer)
        self.stats.bytes_up += nbytes
        if self.log is not None:
            self.log.info("learner.bootstrap_served", to=item.requester, bytes=nbytes, chunks=len(pieces),
                          optimizer_digest=optimizer_digest(item.state["optimizer"]),
                          snapshot_s=round(item.snapshot_s, 4),
                          send_s=round(time.perf_counter() - t0, 4),
                          versions_max=max(item.state["versions"]) if item.state["versions"] else -1)

    def _peer_send(self, peer: zmq.Socket, frames: list, copy: bool = True) -> bool:
        """Never blocks: False when the joiner's queue is full (it does not read) or it is gone."""
        try:
            peer.send_multipart(frames, zmq.NOBLOCK, copy=copy)
            return True
        except zmq.ZMQError:   # EAGAIN: PEER_SNDHWM chunks wait for it; EHOSTUNREACH: disconnected
            return False

    def _continue_serve(self, peer: zmq.Socket) -> None:
        """Send the state in flight as far as the joiner's queue takes it; abandon it (the snapshot
        freed) when the joiner has taken nothing for PEER_STALL_S."""
        srv = self._serving
        if srv is None:
            return
        pieces = srv["pieces"]
        while srv["next"] < len(pieces):
            i, off, piece = pieces[srv["next"]]
            if not self._peer_send(peer, [srv["identity"], b"chunk", msgpack.packb([i, off, zlib.crc32(piece)]),
                                          piece], copy=False):
                break
            srv["next"] += 1
            srv["progress_at"] = time.monotonic()
        done = srv["next"] >= len(pieces)
        if done or time.monotonic() - srv["progress_at"] > PEER_STALL_S:
            if not done:
                self.peer_serves_abandoned += 1
            self._serving = None
            self._serve_pending = False

    def ask_peer(self, item: AskPeer) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, PEER_MAX_FRAME_BYTES)
        if self.security is not None:
            try:
                self.security.client(sock, item.peer)
            except SecurityError as e:  # a peer without a listed key: ask the shards instead
                sock.close(linger=0)
                self.inbox.put(PeerStateArrived(item.peer, None, 0, str(e)[:200]))
                return
        sock.connect(item.endpoint)
        sock.send_multipart([b"state?", self.id.encode()])
        self._asks[sock] = {"peer": item.peer, "header": None, "chunks": {}}
        self._poller.register(sock, zmq.POLLIN)

    def _end_ask(self, sock: zmq.Socket, arrived: PeerStateArrived) -> None:
        self._poller.unregister(sock)
        del self._asks[sock]
        sock.close(linger=0)
        self.inbox.put(arrived)

    def on_peer_reply(self, sock: zmq.Socket) -> None:
        import msgpack
        ask = self._asks[sock]
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = frames[0]
            self.peer_progress_at = time.monotonic()
            if kind == b"busy":
                return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, "the peer is not ready"))
            try:
                if kind == b"state" and len(frames) == 2:
                    head = msgpack.unpackb(frames[1], strict_map_key=False)
                    sizes = [int(n) for n in head["sizes"]]
                    if sum(sizes) > MAX_STATE_BYTES:
                        return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, "state too large"))
                    ask["header"] = head
                    ask["buffers"] = [bytearray(n) for n in sizes]
                    ask["got"] = 0
                elif kind == b"chunk" and len(frames) == 3 and ask["header"] is not None:
                    i, off, crc = msgpack.unpackb(frames[1])
                    piece = frames[2]
                    if zlib.crc32(piece) != crc or off + len(piece) > len(ask["buffers"][i]):
                        return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, "damaged chunk"))
                    ask["buffers"][i][off:off + len(piece)] = piece
                    ask["got"] += 1
                    self.stats.bytes_down += len(piece)
                else:
                    self.malformed += 1
                    continue
            except (ValueError, TypeError, KeyError, IndexError) as e:
                return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, f"malformed: {e!r}"[:200]))
            head = ask["header"]
            if head is not None and ask["got"] == head["pieces"]:
                try:
                    state = unflatten_state(head["skeleton"], ask["buffers"])
                except Exception as e:  # a damaged or foreign payload: the joiner asks the shards
                    return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, repr(e)[:200]))
                return self._end_ask(sock, PeerStateArrived(ask["peer"], state, sum(head["sizes"])))
