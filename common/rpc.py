"""The fragment request path: DEALER sockets asking the owning shard's ROUTER for fragment p.

Used by a joining learner, by a learner that detected a version gap, and by the `ddloco up`
monitor that evaluates the global model. Replies are ordinary FRAG messages (``common.wire``);
a fragment larger than the shard's ``reply_chunk_values`` comes as several chunks, each with its
own checksum, which ``FragmentClient.receive`` assembles: a chunk lost to a full queue or a
corrupt one costs a re-ask that completes the value already partly here (chunks of the same
epoch and version are kept), not a new transfer from zero, and a chunk of a newer version
replaces an unfinished older one.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import zmq

from common import control, hostmem, wire
from common import entries
from common.fragments import owner
from common.keys import Keys
from common.links import keep_alive
from common.security import SecurityError, owner_name, sent_by_owner


class _Assembly:
    """One fragment's value arriving in chunks: (epoch, version), the buffer, offsets received."""

    def __init__(self, msg: wire.Message) -> None:
        self.key = (msg.epoch, msg.version)
        self.first = msg
        self.values = hostmem.empty(msg.of)
        self.parts: dict[int, int] = {}
        """offset -> element count of each chunk here."""
        self.filled = 0

    def add(self, msg: wire.Message, values: torch.Tensor) -> bool:
        """Put one chunk in place; True when every value is here."""
        if msg.offset not in self.parts:
            self.values[msg.offset:msg.offset + msg.numel] = values
            self.parts[msg.offset] = msg.numel
            self.filled += msg.numel
        return self.filled >= self.values.numel()

    def tiled(self) -> bool:
        """The chunks cover the value exactly once (no overlap, no hole left uninitialised)."""
        end = 0
        for offset in sorted(self.parts):
            if offset != end:
                return False
            end += self.parts[offset]
        return end == self.values.numel()

    def message(self) -> wire.Message:
        """The whole value as one exact (fp32) FRAG message; its ``values()`` is the assembled
        tensor itself (every chunk was decoded and checked on arrival: not decoded twice)."""
        from dataclasses import replace
        return replace(self.first, codec="fp32", numel=self.values.numel(), offset=0, of=self.values.numel(),
                       payload=(memoryview(self.values.numpy()).cast("B"),), decoded=self.values)


class FragmentClient:
    """Owns one DEALER per shard endpoint; not thread-safe (use from one thread)."""

    def __init__(self, ctx: zmq.Context, *, run_id: str, sender: str, security: Any = None,
                 numels: Sequence[int] | None = None) -> None:
        """``numels``: each fragment's element count, when the caller knows the model (a chunk
        announcing another size is malformed, not a buffer to allocate)."""
        self.ctx = ctx
        self.numels = list(numels) if numels is not None else None
        self.security = security
        """``common.security.Security``: each DEALER is a CURVE client of shard k's key."""
        self.run_id = run_id
        self.sender = sender
        self.shards = 0
        self.endpoints: dict[int, str] = {}
        self.sockets: dict[int, zmq.Socket] = {}
        self.malformed = 0
        self.bad_endpoints: dict[int, tuple[str, str]] = {}
        """Shards whose advertised endpoint could not be connected to: (endpoint, why). Tried
        again when the shard advertises another one; the caller logs them."""
        self._partial: dict[int, _Assembly] = {}
        self.chunks = 0
        """Chunks received (replies of fragments larger than the shard's chunk size)."""
        self.asked: set[int] = set()
        """Fragments requested and not yet received whole: a reply for any other is dropped (``unasked``)."""
        self.unasked = 0
        self.not_owner = 0
        """Replies dropped: from a shard that does not own the fragment (each socket is a CURVE
        client of one shard's key, so a reply on it is that shard's)."""

    def set_endpoints(self, shards: int, endpoints: dict[int, str]) -> None:
        """(Re)connect to the shards' advertised endpoints; a moved shard gets a new socket."""
        self.shards = shards
        for k in [k for k in self.endpoints if k not in endpoints]:  # shard gone: forget it
            self.sockets.pop(k).close(linger=0)
            del self.endpoints[k]
        for k, ep in endpoints.items():
            if self.endpoints.get(k) == ep or self.bad_endpoints.get(k, ("",))[0] == ep:
                continue
            old = self.sockets.pop(k, None)
            if old is not None:
                old.close(linger=0)
            s = keep_alive(self.ctx.socket(zmq.DEALER))
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 10_000)
            if self.numels:   # a reply frame is at most a whole fragment at fp32
                s.setsockopt(zmq.MAXMSGSIZE, wire.max_frame_bytes(max(self.numels)))
            try:
                if self.security is not None:
                    self.security.client(s, f"shard{k}")
                s.connect(ep)
            except (zmq.ZMQError, SecurityError) as e:  # not an endpoint, or no listed key for that shard
                s.close(linger=0)
                self.bad_endpoints[k] = (ep, str(e))
                entries.BAD_ENTRIES.reject("shard", "unusable_endpoint", shard=k, rpc=ep, error=e)
                continue
            self.bad_endpoints.pop(k, None)
            self.sockets[k] = s
            self.endpoints[k] = ep

    def differs(self, shards: int, endpoints: dict[int, str]) -> bool:
        """True when ``set_endpoints(shards, endpoints)`` would change something."""
        known = {**{k: ep for k, (ep, _) in self.bad_endpoints.items()}, **self.endpoints}
        return shards != self.shards or endpoints != known

    def sync_poller(self, poller: zmq.Poller, registered: dict[int, zmq.Socket]) -> None:
        """Keep ``poller`` registered with exactly this client's current sockets: the closed socket
        of a shard that moved leaves it (polling a closed socket fails), the new one joins.
        ``registered`` is the caller's record of what it registered, by shard."""
        for k, sock in list(registered.items()):
            if self.sockets.get(k) is not sock:
                poller.unregister(sock)
                del registered[k]
        for k, sock in self.sockets.items():
            if k not in registered:
                poller.register(sock, zmq.POLLIN)
                registered[k] = sock

    def request(self, fragment: int) -> bool:
        """Ask the owner of ``fragment`` for its current value; False if the owner is unknown."""
        if self.shards <= 0:
            return False
        s = self.sockets.get(owner(fragment, self.shards))
        if s is None:
            return False
        frames = wire.encode(kind=wire.GET, run=self.run_id, sender=self.sender, fragment=fragment)
        try:
            s.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.asked.add(fragment)
        return True

    def receive(self, sock: zmq.Socket) -> list[wire.Message]:
        """Drain replies waiting on ``sock``; malformed ones are counted and dropped."""
        out = []
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            try:
                msg = wire.decode(frames, expect_run=self.run_id)
            except wire.WireError:
                self.malformed += 1
                continue
            if msg.kind != wire.FRAG:
                self.malformed += 1
            elif not self._from_owner(sock, msg):
                self.not_owner += 1
                self.malformed += 1
            elif msg.fragment not in self.asked:
                self.unasked += 1
                self.malformed += 1
            elif not msg.is_chunk:
                self.asked.discard(msg.fragment)
                out.append(msg)
            else:
                whole = self._assemble(msg)
                if whole is not None:
                    self.asked.discard(msg.fragment)
                    out.append(whole)

    def _from_owner(self, sock: zmq.Socket, msg: wire.Message) -> bool:
        """The reply came on the socket of the fragment's owner and names it as sender."""
        k = next((k for k, s in self.sockets.items() if s is sock), None)
        return k is not None and sent_by_owner(msg.sender, msg.fragment, self.shards) \
            and msg.sender == owner_name(k, self.shards)

    def _assemble(self, msg: wire.Message) -> wire.Message | None:
        """Add one chunk; the whole value once its last chunk is here."""
        if self.numels is not None and (msg.fragment >= len(self.numels) or msg.of != self.numels[msg.fragment]):
            self.malformed += 1
            return None
        try:
            values = msg.values()
        except wire.WireError:
            self.malformed += 1
            return None
        self.chunks += 1
        asm = self._partial.get(msg.fragment)
        if asm is not None and (msg.epoch, msg.version) < asm.key:
            return None                               # an older value's chunk: a newer one is arriving
        if asm is None or asm.key != (msg.epoch, msg.version) or asm.values.numel() != msg.of:
            try:
                asm = self._partial[msg.fragment] = _Assembly(msg)
            except (RuntimeError, ValueError, MemoryError):   # an absurd size announced
                self.malformed += 1
                return None
        if not asm.add(msg, values):
            return None
        del self._partial[msg.fragment]
        if not asm.tiled():                           # overlapping chunks: not one consistent value
            self.malformed += 1
            return None
        return asm.message()

    def close(self) -> None:
        for s in self.sockets.values():
            s.close(linger=0)
        self.sockets.clear()
        self.endpoints.clear()


def fetch_fragments(r: Any, keys: Keys, n_fragments: int, *, timeout_s: float = 10.0,
                    sender: str = "monitor", security: Any = None,
                    numels: Sequence[int] | None = None) -> dict[int, tuple[int, torch.Tensor]]:
    """Blocking: current (version, value) of every fragment, from the shards. Raises TimeoutError.
    ``security``: the caller's CURVE identity (``common.security.Security``) when the run has keys.
    ``numels``: each fragment's element count when known (see ``FragmentClient``)."""
    ctx = zmq.Context()
    client = FragmentClient(ctx, run_id=keys.run_id, sender=sender, security=security, numels=numels)
    got: dict[int, tuple[int, torch.Tensor]] = {}
    try:
        deadline = time.monotonic() + timeout_s
        asked_at = -1e9
        poller = zmq.Poller()
        registered: dict[int, zmq.Socket] = {}
        while len(got) < n_fragments:
            now = time.monotonic()
            if now >= deadline:
                bad = "; ".join(f"shard {k} advertises {ep!r}: {why}" for k, (ep, why) in client.bad_endpoints.items())
                raise TimeoutError(f"shards served {len(got)}/{n_fragments} fragments within {timeout_s}s"
                                   + (f" ({bad})" if bad else ""))
            if now - asked_at > 1.0:
                client.set_endpoints(*control.shard_endpoints(r, keys))
                client.sync_poller(poller, registered)
                for p in range(n_fragments):
                    if p not in got:
                        client.request(p)
                asked_at = now
            for sock, _ in poller.poll(100):
                for msg in client.receive(sock):
                    try:
                        got[msg.fragment] = (msg.version, msg.values())
                    except wire.WireError:
                        client.malformed += 1
        return got
    finally:
        client.close()
        ctx.destroy(linger=0)
