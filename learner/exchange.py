"""Receipt (ALGORITHM §6) and answers (§4) on the training thread: what learner/receipt.py
decides, applied to the model's tensors and handed to the network thread.

``Exchange`` is a part of ``Learner`` (learner/core.py); it runs at the step boundary (and while
joining or flushing), on the training thread, which owns the ``Receipt`` and the tensors.
"""
from __future__ import annotations

import queue
import time
from typing import Any

import torch

from common.fragments import Fragment, gather, scatter
from common.merge import carry_local_steps_
from learner.messages import (Answer, Fetch, FragmentArrived, Have, PeerStateArrived, PeerStateWanted, RoundOpened,
                              StateRequested)
from learner.receipt import Carry
from learner.stats import mark_boot


class Exchange:
    """See the module docstring."""

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: Any) -> None:
        rc = self.receipt
        if isinstance(item, PeerStateWanted):
            self._outbox.put(self._peer_snapshot(item))
        elif isinstance(item, PeerStateArrived):
            return  # a late reply: this learner already got its state elsewhere
        elif isinstance(item, StateRequested):
            p = item.fragment
            if rc.known(p):   # our base: the merged value at base_version
                self._outbox.put(Have(p, int(rc.base_epoch[p]), int(rc.base_version[p]), rc.base_values[p]))
        elif isinstance(item, FragmentArrived):
            if self._deferring:       # rank 0 of a sharded group: applied at the step boundary
                self._deferred.append(item)
            else:
                self._apply(item)
        elif isinstance(item, RoundOpened):
            rc.on_open(item, time.monotonic())
            self._send_fetches()


    def _send_fetches(self) -> None:
        for p in self.receipt.take_fetches():
            self._outbox.put(Fetch((p,)))

    def _apply(self, item: FragmentArrived, *, joining: bool = False) -> None:
        """Apply the merged Θ_p (§6, learner/receipt.py decides the value) and the updates that
        were waiting for it, in order."""
        rc = self.receipt
        while item is not None:
            p = item.fragment
            value = rc.receive(item, now=time.monotonic(), local=self._local_values, joining=joining,
                               to_device=self._staging.to_device if self._staging is not None else None,
                               carry_in_place=self._carries_in_place(p))
            self._send_fetches()
            if value is None:
                return
            if isinstance(value, Carry):      # θ_p ← Θ_new + (θ_p − reference), on the tensors themselves
                carry_into(self.tensors, self.plan[p], value)
            elif self._gathered is not None:  # a sharded group: the value reaches the shards after this
                self._gathered[p] = value
            else:
                scatter(self.tensors, self.plan[p], value)
            if self.group is not None:
                self._changed[p] = value
            item, joining = rc.replay(p), False

    def _carries_in_place(self, p: int) -> bool:
        """A carry of fragment p is made on the tensors themselves (``carry_into``): a learner of one
        process on the host whose tensors of p are float32 and contiguous. Elsewhere it is computed
        on a gathered copy and written back (``scatter``)."""
        return (self._staging is None and self.group is None and self._gathered is None
                and all(_takes_carry(self.tensors[q.name]) for q in self.plan[p].pieces))

    def _local_values(self, p: int) -> torch.Tensor:
        """This learner's current value of fragment p (flat float32, never written in place
        afterwards): gathered from its tensors (on the CPU; on the GPU with host staging), or in a
        sharded group the value gathered or applied at this boundary (an fp32 value as applied,
        before any cast to a buffer's dtype)."""
        if self._gathered is not None:
            return self._gathered[p]
        if self._deferring:
            raise RuntimeError(f"fragment {p} read outside a step boundary of a sharded group")
        if self._staging is not None:
            return gather(self.tensors, self.plan[p], device=self.device)
        return gather(self.tensors, self.plan[p])

    def _answer_open_rounds(self, min_steps: int) -> None:
        if self._deferring and self._gathered is None:
            return    # a sharded group answers at its step boundary (``_apply_deferred``)
        rc, s = self.receipt, self._stats
        for o in rc.rounds_to_answer(min_steps, self._gathered):
            p = o.fragment
            snapshot = self._local_values(p)  # a copy; delta and quantization off-thread
            c = rc.contribute(o, snapshot)
            sent, ready = snapshot, None
            if self._staging is not None:     # to pinned host memory on a side stream: no wait here
                sent, ready = self._staging.to_host(snapshot)
            self._outbox.put(Answer(fragment=p, epoch=o.epoch, round=o.round, attempt=o.attempt,
                                    base=int(rc.base_version[p]), base_values=rc.base_values[p], snapshot=sent,
                                    steps=c.steps, tokens=c.tokens, ready=ready, final=self.status == "flushing"))
            s.answers += 1
            if s.answers == 1:
                mark_boot(s.boot_phases, "first_answer", self._process_started_at)
                s.first_answer = f"{p}:{o.round}:{time.time():.3f}"   # fragment:round:when
            s.last_contrib_fragment = p
            s.last_contrib_at = time.time()
        rc.forget_answered()


def _takes_carry(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def carry_into(tensors: dict[str, torch.Tensor], fragment: Fragment, carry: Carry) -> None:
    """θ ← Θ_new + (θ − reference) on each piece of ``fragment`` in ``tensors``, in place (float32
    contiguous host tensors): what ``scatter(tensors, fragment, carry_local_steps(carry.merged,
    gather(tensors, fragment), carry.reference))`` writes, in one pass and no copy of the fragment."""
    for piece, (start, stop, _) in zip(fragment.pieces, fragment.spans):
        target = tensors[piece.name].detach().view(-1)[piece.start:piece.stop]
        carry_local_steps_(target, carry.merged[start:stop], carry.reference[start:stop])
