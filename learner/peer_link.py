"""The network thread's side of peer bootstrap (ALGORITHM §8): serving our state to a joining
learner on a ROUTER socket, and asking a peer for its state on a DEALER (learner/bootstrap.py is
the training thread's side). The frame layout is common/wire.py's (``encode_peer_*``,
``decode_peer``, with its version); this module moves the bytes.

``PeerLink`` is a part of ``NetworkThread`` (learner/network.py): every attribute here is owned
by the network thread. Other threads read only ``peer_endpoint`` and ``peer_progress_at``,
values replaced whole (a str, a float), never changed in place.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
import zmq

from common import wire
from common.security import SecurityError, frame_user_id
from learner.messages import AskPeer, PeerState, PeerStateArrived, PeerStateWanted

CHUNK_BYTES = 1 << 20
"""Peer state travels in chunks of this size (the I/O thread interleaves other traffic)."""
MAX_STATE_BYTES = 1 << 40
"""A peer announcing more than this is refused (a garbled header must not allocate it)."""
PEER_SERVE_INTERVAL_S = 1.0
"""A learner serves its state to joining peers at most this often (others get "busy" and load
from the shards)."""
PEER_SNDHWM = 16
"""Messages (chunks of CHUNK_BYTES, each a copy: a queued chunk never holds the whole snapshot)
queued for one joining peer: a state is sent as the peer reads it, so a peer that does not read
costs at most this many chunks plus the one snapshot in flight, until the serve is abandoned."""
PEER_STALL_S = 30.0
"""A state whose reader took nothing for this long is abandoned (``peer_serves_abandoned``); a
member whose connection was still there (it stopped reading) is served no state again by this
process (logged ``learner.peer_stalled``; it loads from the shards, as any refused joiner does)."""
MAX_STALLED_MEMBERS = 10_000
"""Bound of that record (members are listed keys; without CURVE, the names joiners claim)."""
PEER_MAX_FRAME_BYTES = 64 << 20
"""ZMQ_MAXMSGSIZE of a joiner's socket: a chunk, or the state's skeleton (msgpack, ~100 bytes a tensor)."""


def optimizer_digest(opt_state: dict[str, Any]) -> str:
    """sha256 over an optimizer ``state_dict()``'s per-parameter state tensors, in order (the
    serving and the joining learner log it: equal digests, equal AdamW state)."""
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


class PeerLink:
    """Peer bootstrap on the network thread; a base of ``NetworkThread``, which sets ``id``,
    ``security``, ``inbox``, ``stats``, ``log``, ``malformed`` and, in ``run``, ``_ctx`` and
    ``_poller``."""

    def _init_peer_link(self) -> None:
        self.peer_endpoint = ""
        """Where joining learners reach our state (set once the socket is bound)."""
        self._asks: dict[zmq.Socket, dict[str, Any]] = {}
        self._serve_pending = False
        self._last_serve_at = -1e9
        self._serving: dict[str, Any] | None = None
        """The state being sent (identity, pieces left, last progress): one at a time, paced by the reader."""
        self.peer_serves_abandoned = 0
        self._stalled: set[str] = set()
        """Members that stopped reading a state we served them: refused from then on."""
        self._peer_gone = False
        """The last failed send's peer had disconnected (EHOSTUNREACH), rather than stopped reading."""
        self._serve_member = ""
        """The member the snapshot asked for (``PeerStateWanted``) goes to."""
        self.peer_requests_refused = 0
        """State requests answered "busy": one serve at a time, at most one per PEER_SERVE_INTERVAL_S
        (a member asking in a loop must not make us snapshot and queue states without end)."""
        self.peer_progress_at = 0.0
        """time.monotonic() of the last part of a peer's state that arrived (the joiner's timeout
        runs from it: a big state keeps coming, a frozen peer stops)."""

    # ------------------------------------------------------------------ serving a joiner
    def on_peer_request(self, peer: zmq.Socket) -> None:
        for _ in range(64):
            try:
                parts = peer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [p.bytes for p in parts]
            try:
                msg = wire.decode_peer(frames[1:])
                if msg.verb != wire.PEER_ASK:
                    raise wire.FrameError(f"a request cannot be {msg.verb!r}")
            except wire.WireError:   # another peer format version included
                self.malformed += 1
                continue
            requester = str(msg.head["from"])[:200]
            member = frame_user_id(parts[-1]) or f"unauthenticated:{requester}"
            now = time.monotonic()
            if (self._serve_pending or now - self._last_serve_at < PEER_SERVE_INTERVAL_S
                    or member in self._stalled):
                self._peer_send(peer, [frames[0], *wire.encode_peer_busy()])   # one state at a time
                self.peer_requests_refused += 1
                continue
            self._serve_pending = True
            self._last_serve_at = now
            self._serve_member = member
            self.inbox.put(PeerStateWanted(frames[0], requester))

    def serve_state(self, peer: zmq.Socket, item: PeerState) -> None:
        """Send the snapshot: a msgpack skeleton, then every tensor's bytes in frames of at most
        CHUNK_BYTES, each with its CRC32, copied as it is queued (a chunk waiting in a queue holds 1 MiB,
        not the snapshot it came from)."""
        if item.state is None:
            self._peer_send(peer, [item.identity, *wire.encode_peer_busy()])
            return
        t0 = time.perf_counter()
        tensors: list[torch.Tensor] = []
        skeleton = flatten_state(item.state, tensors)
        views = [memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"") for t in tensors]
        pieces = [(i, off, v[off:off + CHUNK_BYTES]) for i, v in enumerate(views)
                  for off in range(0, max(len(v), 1), CHUNK_BYTES)]
        nbytes = sum(len(v) for v in views)
        if not self._peer_send(peer, [item.identity, *wire.encode_peer_state(skeleton, [len(v) for v in views],
                                                                             len(pieces))]):
            self._stall(self._serve_member)   # its queue is already full: it is not reading
            return
        self._serving = {"identity": item.identity, "pieces": pieces, "next": 0, "progress_at": time.monotonic(),
                         "member": self._serve_member}
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
        except zmq.ZMQError as e:   # EAGAIN: PEER_SNDHWM chunks wait for it; EHOSTUNREACH: disconnected
            self._peer_gone = e.errno == zmq.EHOSTUNREACH
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
            if not self._peer_send(peer, [srv["identity"], *wire.encode_peer_chunk(i, off, piece)]):
                break
            srv["next"] += 1
            srv["progress_at"] = time.monotonic()
        done = srv["next"] >= len(pieces)
        if done or time.monotonic() - srv["progress_at"] > PEER_STALL_S:
            if not done:
                self.peer_serves_abandoned += 1
                self._stall(srv["member"])
            self._serving = None
            self._serve_pending = False

    def _stall(self, member: str) -> None:
        """After a failed send: a member still connected but not reading is served no state again
        (one that disconnected is not marked: a restarted joiner may ask again)."""
        if self._peer_gone or member in self._stalled or len(self._stalled) >= MAX_STALLED_MEMBERS:
            return
        self._stalled.add(member)
        if self.log is not None:
            self.log.warning("learner.peer_stalled", member=member,
                             detail="its connection took no more of what we sent: served no state again")

    # ------------------------------------------------------------------ asking a peer (joining)
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
        sock.send_multipart(wire.encode_peer_ask(self.id))
        self._asks[sock] = {"peer": item.peer, "header": None, "chunks": {}}
        self._poller.register(sock, zmq.POLLIN)

    def _end_ask(self, sock: zmq.Socket, arrived: PeerStateArrived) -> None:
        self._poller.unregister(sock)
        del self._asks[sock]
        sock.close(linger=0)
        self.inbox.put(arrived)

    def on_peer_reply(self, sock: zmq.Socket) -> None:
        ask = self._asks[sock]
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.peer_progress_at = time.monotonic()
            try:
                msg = wire.decode_peer(frames)
            except wire.PeerVersionError as e:   # a peer of another version: counted, asked no further
                self.malformed += 1
                return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, str(e)[:200]))
            except wire.PayloadError:
                return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, "damaged chunk"))
            except wire.WireError:
                self.malformed += 1
                continue
            error = self._take_reply(ask, msg)
            if error is not None:
                return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, error))
            head = ask["header"]
            if head is not None and ask["got"] == head["pieces"]:
                try:
                    state = unflatten_state(head["skeleton"], ask["buffers"])
                except Exception as e:  # a damaged or foreign payload: the joiner asks the shards
                    return self._end_ask(sock, PeerStateArrived(ask["peer"], None, 0, repr(e)[:200]))
                return self._end_ask(sock, PeerStateArrived(ask["peer"], state, sum(head["sizes"])))

    def _take_reply(self, ask: dict[str, Any], msg: wire.PeerMessage) -> str | None:
        """One reply of the asked peer into ``ask``; the reason the ask ends, or None to go on."""
        if msg.verb == wire.PEER_BUSY:
            return "the peer is not ready"
        try:
            if msg.verb == wire.PEER_STATE:
                sizes = [int(n) for n in msg.head["sizes"]]
                if sum(sizes) > MAX_STATE_BYTES:
                    return "state too large"
                ask["header"] = msg.head
                ask["buffers"] = [bytearray(n) for n in sizes]
                ask["got"] = 0
            elif msg.verb == wire.PEER_CHUNK and ask["header"] is not None:
                i, off, piece = int(msg.head["i"]), int(msg.head["off"]), msg.piece
                if off + len(piece) > len(ask["buffers"][i]):
                    return "damaged chunk"
                ask["buffers"][i][off:off + len(piece)] = piece
                ask["got"] += 1
                self.stats.bytes_down += len(piece)
            else:
                self.malformed += 1
        except (ValueError, TypeError, KeyError, IndexError) as e:
            return f"malformed: {e!r}"[:200]
        return None
