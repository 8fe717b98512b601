"""A shard's answer intake (ALGORITHM §4-5): learners' updates decoded, checked and bounded
(claims, base, epoch, finite values) into their fragment's open round; problems counted and dropped.

Ownership: runs on the shard's loop thread only; the rounds, the counters and the per-learner
records it writes (``FragmentState.answered_unix``, ``_first_seen``, ``_finished``) are the loop's.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from common import wire
from common.robust import STEP_TIME_FLOOR_OF_MEDIAN, STEP_TIME_UNKNOWN_S, bound_claims, claims_reference, \
    max_steps_claim, steps_in_time
from syncer.state import Answer, FragmentState


class Intake:
    """The answer intake of ``Shard`` (a mixin: the loop thread's state is the shard's)."""

    def _on_update(self, frames: list[Any]) -> None:
        """One message from the SUB socket: an answer to an open round, or a recovery copy."""
        try:
            msg = wire.decode(frames, expect_run=self.endpoints.run_id)
        except wire.WrongRunError:
            self.stats.wrong_run += 1
            return
        except wire.WireError as e:
            self._count_malformed(e)
            return
        self.stats.bytes_in += msg.payload_nbytes
        if msg.kind == wire.HAVE:
            self._on_have(msg)
            return
        f = self.frags.get(msg.fragment)
        if msg.kind != wire.UPDATE or f is None or msg.numel != f.spec.numel or msg.steps < 1:
            self._count_malformed(ValueError(f"unexpected {msg.kind} for fragment {msg.fragment} "
                                             f"(numel {msg.numel}, steps {msg.steps})"))
            return
        rnd = f.round
        if rnd is None or msg.round != rnd.round_id:
            self.stats.late_answers += 1
            return
        if msg.epoch != self.epoch or msg.base not in f.history:
            self.stats.stale_base += 1
            self.log.info("syncer.stale_base", fragment=f.spec.index, learner=msg.sender, base=msg.base,
                          oldest=min(f.history), epoch=msg.epoch, our_epoch=self.epoch)
            return
        try:
            delta = msg.values_for_merge()   # finite: the decoder checks the payload (fp32/bf16 values, int scales)
        except wire.NonFinitePayload:   # e.g. an int4 scale that decodes to inf: this answer only
            self._reject("nonfinite_delta", msg.sender, f.spec.index)
            return
        except wire.WireError as e:
            self._count_malformed(e)
            return
        self._accept_answer(f, msg, delta)

    def _accept_answer(self, f: FragmentState, msg: wire.Message, delta: Any) -> None:
        """A valid answer into its open round, its claims bounded (common.robust); its quorum time noted."""
        rnd = f.round
        H, step_s = self.run.algo.sync_every_steps, self._claim_step_s(msg.sender)
        elapsed_s, first = self._time_since_answered(f, msg.sender, msg.round)
        max_steps = max_steps_claim(versions_since_base=f.version - msg.base, sync_every_steps=H, step_s=step_s,
                                    factor=self.options.max_steps_factor, elapsed_s=elapsed_s)
        steps, tokens, cut = bound_claims(steps=msg.steps, tokens=msg.tokens, max_steps=max_steps,
                                          tokens_per_step_bound=self.tokens_per_step_bound)
        for reason in cut:
            if reason == "claims_clamped":       # within the tolerance of an honest member's timing
                self.stats.claims_clamped += 1
                self.log.info("syncer.claims_clamped", learner=msg.sender[:64], fragment=f.spec.index,
                              steps=msg.steps, tokens=msg.tokens, max_steps=max_steps, round=msg.round,
                              base=msg.base, version=f.version, elapsed_s=round(elapsed_s, 3), step_s=round(step_s, 5),
                              first=first)
                continue
            self._reject(reason, msg.sender, f.spec.index, steps=msg.steps, tokens=msg.tokens, max_steps=max_steps,
                         base=msg.base, version=f.version, elapsed_s=round(elapsed_s, 3), step_s=round(step_s, 5))
        now = self.clock()
        clip_steps = min(steps, steps_in_time(elapsed_s=elapsed_s, step_s=step_s, sync_every_steps=H))
        rnd.answers[msg.sender] = Answer(sender=msg.sender, base=msg.base, steps=steps, tokens=tokens,
                                         delta=delta, received_at=now, clip_steps=clip_steps)
        if msg.final:             # past its last step: rounds open without spacing while it is live
            if len(self._finished) < 100_000:
                self._finished.add(msg.sender)
        else:
            self._finished.discard(msg.sender)
        self.stats.answers += 1
        if rnd.quorum_at is None and len(rnd.answers) >= self.policy.quorum:
            rnd.quorum_at = now
            if rnd.timed:
                self.xi_quorum.update(now - rnd.opened_at)

    def _time_since_answered(self, f: FragmentState, learner: str, round_id: int) -> tuple[float, bool]:
        """(seconds since ``learner`` last answered an earlier round of fragment ``f`` (its steps
        since then are what it claims now), and this answer recorded. A learner never seen
        answering: since it joined, as this shard saw it (learners live when this shard started:
        since the last checkpoint, or this process's start; one not yet seen live: since the last
        read of the live learners), whether it is its first answer to ``f``)."""
        now = time.time()
        seen = f.answered_unix.get(learner)
        joined = self._first_seen.setdefault(learner, self._live_read_unix) if seen is None else now
        reference, f.answered_unix[learner] = claims_reference(seen, round_id, now, joined)
        if len(f.answered_unix) > 100_000:       # bounded whatever joins
            f.answered_unix.clear()
        return now - reference, seen is None

    def _claim_step_s(self, learner: str) -> float:
        """The step time a learner's claims are checked against: its own step-time EMA (the last
        one seen: Redis may have restarted), never below a share of the median of the learners'.
        Not known yet (its first heartbeats, the first second of a run): the fastest one known, and
        before any is, STEP_TIME_UNKNOWN_S."""
        known = [t for lid, t in self._step_s_seen.items() if lid in self.live] or list(self._step_s_seen.values())
        own = self._step_s_seen.get(learner, min(known) if known else STEP_TIME_UNKNOWN_S)
        median = statistics.median(known) if known else own
        return max(own, STEP_TIME_FLOOR_OF_MEDIAN * median)

    def _reject(self, reason: str, sender: str, fragment: int, **detail: Any) -> None:
        """Count an answer refused, or its claims or outer gradient cut, by the robust-merge rules."""
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        n = self.stats.rejected[reason]
        if n <= 10 or n % 100 == 0:   # bounded logging whatever a sender does
            self.log.warning("syncer.answer_rejected", reason=reason, learner=sender[:64], fragment=fragment,
                             count=n, **detail)

    def _count_malformed(self, err: Exception) -> None:
        self.stats.malformed += 1
        if self.stats.malformed <= 10 or self.stats.malformed % 100 == 0:
            self.log.warning("syncer.malformed_dropped", error=str(err), total=self.stats.malformed)

