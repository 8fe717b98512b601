"""A (re)started shard's recovery: before a fragment's first round, ask the live learners for
their copies and take the freshest one the rules allow (versions never go back; ALGORITHM §8).

Ownership: runs on the shard's loop thread only; each ``FragmentState.recovery`` is the loop's.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from common import control, tokens as run_count, wire
from common.robust import choose_copy
from syncer.checkpoints import lone_limit
from syncer.state import HOLDING, RECOVERY_COPIES, RECOVERY_QUIET_S, FragmentState, Recovery


class Recovering:
    """The recovery steps of ``Shard`` (a mixin: the loop thread's state is the shard's)."""

    def _recorded_versions(self) -> dict[int, int]:
        """The newest version the run recorded for each owned fragment (0 when none)."""
        return {p: v or 0 for p, v in control.fragment_versions(self.redis, self.keys, self.frags).items()}

    def _start_recovery(self, recorded: dict[int, int], loaded: bool, journal: dict[int, int] | None = None) -> None:
        """Versions never go back. ``--fresh``: the initial model, above every recorded version.
        Otherwise each fragment asks the live learners for their copies before its first round
        when the run recorded a newer version than the checkpoint holds, learners are live (not
        only joining ones of a run that trained no token yet) or a checkpoint was loaded (Redis
        may have lost the record), and waits until every live learner
        holding copies answered (none live for ``RECOVERY_QUIET_S``: none to ask, unless behind),
        for ``recovery_timeout_s`` at most
        (a frozen learner leaves the live set when its heartbeat expires; a loaded machine may
        take seconds to answer, and ending early would move every learner back)."""
        now = self.clock()
        control.sync_members(self.redis, self.keys)
        live = control.live_learners(self.redis, self.keys)
        holding = any(h.get("status") in HOLDING for h in live.values())
        if live and not holding and not loaded and not run_count.read_total(self.redis, self.keys):
            live = {}   # a new run: its learners are joining (waiting for us) and none trained yet
        for p, f in self.frags.items():
            if self.options.fresh:
                f.version = recorded[p] + 1 if recorded[p] else 0
                f.history = {f.version: f.theta}
                continue
            behind = recorded[p] > f.version
            if behind or live or loaded:  # a checkpoint may be older than the copies learners hold
                lone = lone_limit(recorded=recorded[p], checkpoint=f.version, journal=(journal or {}).get(p),
                                  every_merges=self._ckpt_every) if loaded else \
                    (recorded[p] or math.inf)
                f.recovery = Recovery(recorded=recorded[p], deadline=now + self.options.recovery_timeout_s,
                                      quiet_until=0.0 if behind else now + RECOVERY_QUIET_S, lone_limit=lone)
        if self.options.fresh:
            self.log.warning("syncer.fresh_start", versions={p: f.version for p, f in self.frags.items()})
        self._momentum_source = "checkpoint" if loaded else "zero"

    def _advance_recovery(self, now: float) -> None:
        """Ask again for copies not yet in; end each fragment's recovery that is done."""
        for p, f in self.frags.items():
            rec = f.recovery
            if rec is None:
                continue
            # the learners that hold copies: a joining one has none yet (it waits for us)
            live = {lid for lid, h in self.live.items() if h.get("status") in HOLDING}
            done = (now >= rec.deadline or (bool(live) and live <= rec.answered)  # every live learner answered
                    or (not live and rec.quiet_until and now >= rec.quiet_until))  # none to ask
            if not done:
                if now - rec.asked_at >= 1.0:  # lost, or learners joining meanwhile: ask again
                    self._publish(wire.encode(kind=wire.NEED, run=self.endpoints.run_id, sender=self.id,
                                              fragment=p, epoch=self.epoch, version=f.version))
                    rec.asked_at = now
                continue
            f.recovery = None
            self._end_recovery(f, rec)

    def _end_recovery(self, f: FragmentState, rec: Recovery) -> None:
        """Take the copy ``choose_copy`` picks (if any), broadcast it, and report what was refused or missing."""
        p, old, own = f.spec.index, f.version, f.theta
        chosen = choose_copy(rec.copies, own_version=f.version, lone_limit=rec.lone_limit,
                             distance=lambda key: float(torch.linalg.vector_norm(rec.values[key] - own)))
        if chosen is not None:
            version = chosen[0]
            learners = sorted(lid for lid, c in rec.copies.items() if c == chosen)
            f.theta, f.master, f.reply = rec.values[chosen], None, None
            f.version = version
            f.history = {version: f.theta}
            self.log.info("syncer.recovered", fragment=p, from_version=old, version=version, learners=learners,
                          momentum=self._momentum_source)
            control.add_event(self.redis, self.keys, "recover", shard=self.options.shard, fragment=p,
                              from_version=old, version=version, learner=learners[0], agreeing=len(learners),
                              momentum=self._momentum_source)
            self._publish(self._frag_frames(f))
            self._journal_after_merge(p, version)
        refused = {lid: c for lid, c in rec.copies.items() if c[0] > f.version}
        if refused:
            self.log.warning("syncer.recovery_copies_refused", fragment=p, version=f.version,
                             copies={lid[:64]: v for lid, (v, _) in list(refused.items())[:10]})
        if f.version < rec.recorded:
            self.stats.versions_behind += 1
            self.log.warning("syncer.recovery_incomplete", fragment=p, version=f.version, recorded=rec.recorded,
                             answered=sorted(rec.answered))
            control.add_event(self.redis, self.keys, "recover_incomplete", shard=self.options.shard, fragment=p,
                              version=f.version, recorded=rec.recorded)

    def _on_have(self, msg: wire.Message) -> None:
        f = self.frags.get(msg.fragment)
        rec = None if f is None else f.recovery
        if rec is None or msg.numel != f.spec.numel:
            return  # not recovering (late reply): nothing to do
        try:
            value = msg.values()
        except wire.WireError as e:
            self._count_malformed(e)
            return
        if len(rec.answered) >= RECOVERY_COPIES and msg.sender not in rec.answered:
            return
        rec.answered.add(msg.sender)
        if not bool(torch.isfinite(value).all()):
            return
        key = (int(msg.version), zlib.crc32(value.contiguous().numpy().view(np.uint8)))
        if key not in rec.values and len(rec.values) >= RECOVERY_COPIES:
            return
        rec.values.setdefault(key, value)
        rec.copies[msg.sender] = key

