"""What a shard sends: round opens and merged fragments on the PUB socket, and full fragment
values to requesters on the ROUTER socket (joins, repairs; chunked when large, encoded once per
version).

Ownership: runs on the shard's loop thread only (the sockets, ``_served``, ``FragmentState.reply``),
except ``_wake``, which a merge worker calls: it writes one byte to the wake socket pair, nothing else.
"""
from __future__ import annotations

from typing import Any

import zmq

from common import wire
from syncer.state import REQUEST_DEDUPE_S, FragmentState


class Serving:
    """The sending side of ``Shard`` (a mixin: the loop thread's state is the shard's)."""

    def _wake(self, _future: Any = None) -> None:
        """From a merge worker: the loop has a result to apply (a byte on the wake pair; if its
        buffer is full a wake is pending anyway)."""
        try:
            self._wake_tx.send(b"!")
        except OSError:
            pass

    def _send_open(self, f: FragmentState, now: float) -> None:
        rnd = f.round
        frames = wire.encode(kind=wire.OPEN, run=self.endpoints.run_id, sender=self.id, fragment=f.spec.index,
                             epoch=self.epoch, round=rnd.round_id, attempt=rnd.attempt, version=f.version)
        self._publish(frames)
        rnd.last_sent_at = now

    def _publish(self, frames: list[Any]) -> None:
        try:
            self.pub.send_multipart(frames, zmq.NOBLOCK, copy=False)
            self.stats.bytes_out += wire.message_nbytes(frames)
        except zmq.Again:
            self.log.warning("syncer.publish_dropped")

    def _on_request(self, frames: list[Any]) -> None:
        ident, rest = frames[0], frames[1:]
        try:
            msg = wire.decode(rest, expect_run=self.endpoints.run_id)
        except wire.WireError as e:
            self._count_malformed(e)
            return
        f = self.frags.get(msg.fragment)
        if msg.kind != wire.GET or f is None:
            self._count_malformed(ValueError(f"request {msg.kind} for fragment {msg.fragment} not owned"))
            return
        if f.recovery is not None:
            # not the run's value yet (the initial model or an old checkpoint): the requester
            # asks again and gets the recovered value; never serve a value that would move it back
            self.stats.requests_deferred += 1
            return
        key = (ident.bytes, f.spec.index)
        now = self.clock()
        last = self._served.get(key)
        if last is not None and last[:2] == (self.epoch, f.version) and now - last[2] < REQUEST_DEDUPE_S:
            self.stats.requests_deduped += 1     # the same value is on its way to that requester
            return
        self.stats.requests += 1
        if f.reply is None or f.reply[:2] != (self.epoch, f.version):
            f.reply = (self.epoch, f.version, self._reply_messages(f))
        else:
            self.stats.replies_cached += 1
        for reply in f.reply[2]:
            try:
                self.router.send_multipart([ident, *reply], zmq.NOBLOCK, copy=False)
                self.stats.bytes_out += wire.message_nbytes(reply)
            except zmq.Again:
                return                            # not (all) sent: a retry is served, the chunks here are kept
        if len(self._served) > 100_000:          # bounded whatever requesters do
            self._served.clear()
        self._served[key] = (self.epoch, f.version, now)

    def _reply_messages(self, f: FragmentState) -> list[list[Any]]:
        """The reply to a request: the full value, in chunks of ``reply_chunk_values`` when it
        is larger (each its own message: the requester assembles them, common/rpc.py)."""
        if self._whole_reply(f):
            return [self._frag_frames(f)]
        n, chunk = f.theta.numel(), self.options.reply_chunk_values
        return [self._frag_frames(f, off, chunk) for off in range(0, n, chunk)]

    def _whole_reply(self, f: FragmentState) -> bool:
        chunk = self.options.reply_chunk_values
        return chunk <= 0 or f.theta.numel() <= chunk

    def _frag_frames(self, f: FragmentState, offset: int = 0, count: int | None = None) -> list[Any]:
        """The full value every replica holds, exact (fp32): a join, a repair, a recovery; or
        ``count`` values of it from ``offset``, a chunk of the reply (``of`` = the whole)."""
        whole = count is None
        values = f.theta if whole else f.theta[offset:offset + count]
        return wire.encode(kind=wire.FRAG, run=self.endpoints.run_id, sender=self.id, fragment=f.spec.index,
                           epoch=self.epoch, values=values, codec="fp32", version=f.version,
                           offset=offset, of=-1 if whole else f.theta.numel())
