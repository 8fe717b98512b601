"""Receipt of merged fragments and the answers to open rounds (ALGORITHM §4, §6), as state and
decisions: no sockets, no Redis, no clock (``now`` is an argument), no model.

Per fragment p the learner holds ``base_values[p]`` (Θ_p at ``base_version[p]``, from the life
``base_epoch[p]`` of the owning shard), the counters ``c_steps[p]``/``c_tokens[p]`` since it last
received p, the round open for p (``pending_open``) and what it last answered (``contributed``).

``Receipt.receive`` takes one merged fragment and returns the value the learner's fragment takes
(or None: nothing to apply), or, when the learner asks for it, a ``Carry`` to apply to its tensors
in place; the learner installs it, then asks ``replay`` for an update that was waiting for that
value. Fragments to ask the shards for (a version gap, a restarted shard) are collected in
``fetches`` (``take_fetches``). ``rounds_to_answer`` and ``contribute`` decide the answers.

Ownership: a ``Receipt`` belongs to the learner's training thread; other threads see its bases
only through ``Bases`` (``published``), a frozen copy the training thread replaces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from common.merge import Contribution, carried, receive_merged
from learner.messages import FragmentArrived, RoundOpened

FETCH_RETRY_S = 1.0
"""A fetch of a fragment is repeated only after this long (lost request, shard moved)."""
FETCH_PENDING_S = 5.0
"""A missed update asks for the full value again only if no fetch of that fragment went out this
recently (the reply of a large fragment takes a while; updates meanwhile are kept and replayed)."""
AHEAD_UPDATES = 16
"""Updates kept per fragment while its full value is on its way."""
ANSWERED_KEPT = 100_000
"""Rounds remembered as answered (then forgotten at once: a round is never opened that long)."""


@dataclass(frozen=True)
class Bases:
    """The bases as the training thread last published them: read-only copies."""

    versions: np.ndarray
    epochs: np.ndarray
    values: tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class Carry:
    """The carry of ALGORITHM §6 for the learner to make on its own tensors, in place:
    θ_p ← merged + (θ_p − reference) (``common.merge.carry_local_steps_``), so θ_p is never read
    out as a vector nor the result written back from one."""

    merged: torch.Tensor
    reference: torch.Tensor


@dataclass
class ReceiptCounts:
    """What ``Receipt`` counts (the learner passes its ``LearnerStats``, which has these fields)."""

    merges_applied: int = 0
    version_gaps: int = 0
    versions_regressed: int = 0
    stale_opens: int = 0
    fetches: int = 0
    updates_replayed: int = 0


def _frozen(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


class Receipt:
    """The learner's state of every fragment and the rules of §6 over it."""

    def __init__(self, n: int, *, carry: bool, mix_alpha: float = 0.0, stats: Any = None, log: Any = None) -> None:
        self.carry = carry
        self.mix_alpha = mix_alpha
        self.stats = stats if stats is not None else ReceiptCounts()
        self.log = log
        self.base_version = np.full(n, -1, dtype=np.int64)
        self.base_epoch = np.full(n, -1, dtype=np.int64)    # life of the owning shard the base came from
        self.base_values: list[torch.Tensor | None] = [None] * n
        self.c_steps = np.zeros(n, dtype=np.int64)
        self.c_tokens = np.zeros(n, dtype=np.int64)
        self.pending_open: dict[int, RoundOpened] = {}
        self.contributed: dict[int, Contribution] = {}
        self.answered: set[tuple[int, int, int, int]] = set()
        self.fetch_asked: dict[int, tuple[int, int, float]] = {}
        self.ahead: dict[int, dict[tuple[int, int], FragmentArrived]] = {}
        """Per fragment: broadcast updates keyed by (epoch, base) that arrived before their base."""
        self.fetches: list[int] = []
        """Fragments to ask the owning shards for, in order (``take_fetches``)."""

    # ------------------------------------------------------------------ views
    def published(self) -> Bases:
        return Bases(_frozen(self.base_version), _frozen(self.base_epoch), tuple(self.base_values))

    def known(self, p: int) -> bool:
        return self.base_values[p] is not None

    def versions(self) -> dict[int, int]:
        return {p: int(v) for p, v in enumerate(self.base_version)}

    def unmerged(self) -> int:
        """Fragments with steps not merged yet."""
        return int((self.c_steps > 0).sum())

    def take_fetches(self) -> list[int]:
        out, self.fetches = self.fetches, []
        return out

    # ------------------------------------------------------------------ counting and fetching
    def count_step(self, tokens: int) -> None:
        """For every p: c_steps[p] += 1; c_tokens[p] += tokens (ALGORITHM §3)."""
        self.c_steps += 1
        self.c_tokens += tokens

    def want_fetch(self, p: int, epoch: int, version: int, now: float) -> None:
        """Ask the owning shard for fragment p; repeated only after FETCH_RETRY_S (lost request,
        shard moved to another endpoint)."""
        asked = self.fetch_asked.get(p)
        if asked is not None and asked[0] == epoch and asked[1] >= version and now - asked[2] < FETCH_RETRY_S:
            return
        self.fetch_asked[p] = (epoch, version, now)
        self.stats.fetches += 1
        self.fetches.append(p)

    def fetch_behind(self, recorded: dict[int, int | None], now: float) -> None:
        """Fragments the run has merged past our copy (``recorded``: the versions in Redis)."""
        for p, v in recorded.items():
            if v is not None and v > self.base_version[p]:
                self.want_fetch(p, int(self.base_epoch[p]), v, now)

    def keep_open(self, o: RoundOpened) -> None:
        """A round of o.fragment opened while joining: kept to answer once joined (no fetch: the
        join brings every fragment)."""
        self.pending_open[o.fragment] = o

    def on_open(self, o: RoundOpened, now: float) -> None:
        """A round of o.fragment opened: kept to answer; a shard of another life (restarted, maybe
        from an older checkpoint: adopt its state) or a version past ours (a missed broadcast)
        fetches the full value."""
        p = o.fragment
        self.pending_open[p] = o
        if o.epoch != self.base_epoch[p] or o.version > self.base_version[p]:
            self.want_fetch(p, o.epoch, o.version, now)

    def adopt(self, values: list[torch.Tensor], versions: list[int], epochs: list[int]) -> None:
        """Every base from a peer's state (peer bootstrap); the counters start at 0."""
        for p, v in enumerate(values):
            self.base_values[p] = v
            self.base_version[p] = int(versions[p])
            self.base_epoch[p] = int(epochs[p])
        self.c_steps[:] = 0
        self.c_tokens[:] = 0

    # ------------------------------------------------------------------ receiving a merged fragment (§6)
    def receive(self, item: FragmentArrived, *, now: float, local: Callable[[int], torch.Tensor],
                joining: bool = False, to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
                carry_in_place: bool = False) -> torch.Tensor | Carry | None:
        """Apply the merged Θ_p (§6): carry the unmerged steps, or overwrite / α-mix and reset the
        counters. Returns the fragment's new value (``local(p)``: the learner's current one, read
        only for carry and α-mix; ``to_device``: where the learner's value lives, None: here), or
        with ``carry_in_place`` (a host learner whose tensors take it) a carry as a ``Carry``.

        Epochs (lives of the owning shard) and versions only go up: a restarted shard continues
        from the freshest copy (ALGORITHM §8). A value from an older life is ignored; a new life
        at our version or above is a continuation (our unmerged steps are carried); one below our
        version moves us back: adopted so we stay in step with the shard, but counted and logged."""
        p = item.fragment
        if item.update_base >= 0:
            full = self._resolve_update(item, now)
            if full is None:
                return None
            item = full
        known = self.known(p)
        base_v = int(self.base_version[p])
        if known and item.epoch < self.base_epoch[p]:
            return None                               # a late message of a shard life that is gone
        same_epoch = item.epoch == self.base_epoch[p]
        if same_epoch and item.version <= base_v:
            return None
        if same_epoch and not joining and not item.requested and item.version > base_v + 1:
            self.stats.version_gaps += 1              # a lost broadcast, repaired by this full value
        continuing = same_epoch or item.version >= base_v
        if known and not same_epoch:
            self._new_life(p, item, continuing)
        contributed = self.contributed.pop(p, None)
        if joining or not known:                      # the first value: adopt it
            value, self.c_steps[p], self.c_tokens[p] = item.values, 0, 0
        else:  # carry the steps not merged yet (not across a move back), or overwrite / α-mix
            value = self._merged_value(p, item, contributed, continuing, local, to_device, carry_in_place)
        self.base_values[p] = item.values
        self.base_version[p] = item.version
        self.base_epoch[p] = item.epoch
        if not joining:
            self.stats.merges_applied += 1
        return value

    def _new_life(self, p: int, item: FragmentArrived, continuing: bool) -> None:
        if item.version == self.base_version[p]:    # the new life starts where we are: nothing of
            self.contributed.pop(p, None)             # what we answered since was merged
        if not continuing:
            self.stats.versions_regressed += 1
            if self.log is not None:
                self.log.warning("learner.version_regressed", fragment=p, version=item.version,
                                 ours=int(self.base_version[p]), epoch=item.epoch)

    def _merged_value(self, p: int, item: FragmentArrived, contributed: Contribution | None, continuing: bool,
                      local: Callable[[int], torch.Tensor], to_device: Callable[[torch.Tensor], torch.Tensor] | None,
                      carry_in_place: bool) -> torch.Tensor | Carry:
        carry = self.carry and continuing
        if carry and carry_in_place and to_device is None:
            ref, self.c_steps[p], self.c_tokens[p] = carried(self.base_values[p], contributed, int(self.c_steps[p]),
                                                             int(self.c_tokens[p]))
            return Carry(item.values, ref)
        mine = local(p) if carry or self.mix_alpha > 0 else None
        merged, base = item.values, self.base_values[p]
        if to_device is not None:    # on the GPU, where the local value and snapshot are
            merged = to_device(item.on_device if item.on_device is not None else merged)
            if carry and contributed is None:
                base = to_device(base)
        value, self.c_steps[p], self.c_tokens[p] = receive_merged(
            merged, mine, base, contributed, int(self.c_steps[p]), int(self.c_tokens[p]),
            carry=carry, mix_alpha=self.mix_alpha)
        return value

    def _resolve_update(self, item: FragmentArrived, now: float) -> FragmentArrived | None:
        """A broadcast update Θ_v − Θ_base (quantized downlink, ALGORITHM §7) → the full Θ_v, computed
        as the shard computed it (base + deq(update) in fp32: bit-identical). None when it does not
        apply now: old news; or an update ahead of our copy (we are joining, or missed one: a lost
        broadcast, a shard life whose full value we have not seen), kept to be replayed once the
        full value is here (broadcasts and fetch replies travel on different sockets, in no
        particular order), and the full value fetched unless a fetch is already on its way."""
        p = item.fragment
        known = self.known(p)
        epoch, version = int(self.base_epoch[p]), int(self.base_version[p])
        if known and item.epoch == epoch and item.update_base == version:
            return FragmentArrived(p, item.epoch, item.version, self.base_values[p] + item.values, item.requested)
        if known and (item.epoch < epoch or (item.epoch == epoch and item.version <= version)):
            return None
        ahead = self.ahead.setdefault(p, {})
        ahead[(item.epoch, item.update_base)] = item
        while len(ahead) > AHEAD_UPDATES:
            del ahead[min(ahead)]
        if known:
            self.stats.version_gaps += 1
            asked = self.fetch_asked.get(p)
            if asked is None or now - asked[2] >= FETCH_PENDING_S:
                self.want_fetch(p, item.epoch, item.version, now)
        return None

    def replay(self, p: int) -> FragmentArrived | None:
        """The kept update built on the value just applied to p, if any (to ``receive`` next: the
        chain is applied in order); older kept updates are dropped."""
        ahead = self.ahead.get(p)
        if not ahead:
            return None
        epoch, version = int(self.base_epoch[p]), int(self.base_version[p])
        for key in [k for k in ahead if k[0] < epoch or (k[0] == epoch and k[1] < version)]:
            del ahead[key]                                    # older than our copy: no use any more
        item = ahead.pop((epoch, version), None)
        if item is not None:
            self.stats.updates_replayed += 1
        return item

    # ------------------------------------------------------------------ answering open rounds (§4)
    def answerable(self, p: int, o: RoundOpened, min_steps: int) -> bool:
        """Open round ``o`` of fragment p can be answered now: steps enough, a base of the open's
        epoch and version (an older base fetches first, a newer one means the round merged), and
        not answered yet."""
        return (self.c_steps[p] >= min_steps and self.base_values[p] is not None
                and o.epoch == self.base_epoch[p] and o.version == self.base_version[p]
                and (o.epoch, o.fragment, o.round, o.attempt) not in self.answered)

    def rounds_to_answer(self, min_steps: int, available: Any = None) -> list[RoundOpened]:
        """The open rounds to answer now, in order (``available``: the fragments that can be read
        now, None: all). Rounds merged past already or answered already are forgotten."""
        out = []
        for p, o in list(self.pending_open.items()):
            if self.c_steps[p] < min_steps or self.base_values[p] is None or o.epoch != self.base_epoch[p]:
                continue
            if o.version < self.base_version[p]:
                del self.pending_open[p]
                self.stats.stale_opens += 1  # that round has merged already
                continue
            if (o.epoch, o.fragment, o.round, o.attempt) in self.answered:
                del self.pending_open[p]
                continue
            if not self.answerable(p, o, min_steps):
                continue  # our base is stale (a fetch is on its way): answering now would undo merges
            if available is not None and p not in available:
                continue  # a sharded group did not gather it at this boundary: answered at a later one
            out.append(o)
        return out

    def contribute(self, o: RoundOpened, snapshot: torch.Tensor) -> Contribution:
        """Round ``o`` answered with ``snapshot`` (the learner's value now, never written after)."""
        p = o.fragment
        del self.pending_open[p]
        self.answered.add((o.epoch, o.fragment, o.round, o.attempt))
        self.contributed[p] = Contribution(snapshot, int(self.c_steps[p]), int(self.c_tokens[p]))
        return self.contributed[p]

    def forget_answered(self) -> None:
        """Bound the memory of answered rounds (after a pass of answers)."""
        if len(self.answered) > ANSWERED_KEPT:
            self.answered.clear()
