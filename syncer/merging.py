"""A shard's merges (ALGORITHM §5): close a round, compute the outer step on a worker thread,
apply and broadcast the result on the loop.

Ownership: ``Merging`` runs on the shard's loop thread and is the only code that changes a
fragment's value, momentum, version and history (when it applies a result). A worker thread runs
``compute_merge`` on a ``MergeInput`` (a message: tensors no one writes in place, the answers,
and the fragment's ``NormClipper``, which the worker owns until the loop takes it back from the
``MergeJob``) and returns a ``MergeResult``; it holds no reference to the shard or to a
``FragmentState``, so it cannot read the loop's state. A fragment merges once at a time (no round
opens while it merges), so its clipper is with one worker or with its fragment, never both.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import redis
import torch

from common import control, quant, wire
from common.merge import OuterAccumulator, outer_step, quantized_update
from common.robust import fair_weights, fold_round
from syncer.checkpoints import checkpoint_due
from syncer.state import BEHIND_FACTOR, Answer, FragmentState, MergeInput, MergeJob, MergeResult, OpenRound


def scratch_buffers(scratch: threading.local, numel: int, *, largest: int) -> tuple[torch.Tensor, ...]:
    """The merge accumulator's two buffers and one for an answer's outer gradient, ``numel``
    long: views of buffers this thread allocated once, as long as the shard's largest fragment
    (``largest``), and reuses for every merge it runs (fresh memory's page faults cost as much as
    the math). One set per merging thread, not per fragment: 3 × the largest fragment per thread,
    whatever the number of fragments the shard owns. A merge's result is copied out before the
    thread's next merge reuses them (``outer_step`` returns new tensors)."""
    bufs = getattr(scratch, "bufs", None)
    if bufs is None or bufs[0].numel() < numel:
        size = max(numel, largest)
        bufs = scratch.bufs = tuple(torch.empty(size, dtype=torch.float32) for _ in range(3))
    return tuple(b[:numel] for b in bufs)


def compute_merge(job: MergeInput) -> MergeResult:
    """ALGORITHM §5 on a worker thread: reads only ``job`` and updates its clipper; returns new
    tensors. Memory: O(|fragment|) whatever the number of answers (accumulated, not stacked)."""
    t0 = time.perf_counter()
    algo, spec = job.algo, job.spec
    master = job.theta if job.master is None else job.master      # the exact fp32 master
    scratch = scratch_buffers(job.scratch, spec.numel, largest=job.largest_numel)
    acc = OuterAccumulator(spec.numel, spec.spans, algo.merge_rule, scratch=scratch[:2], robust_buffers=True,
                           robust_radius=True)
    # float buffers (BatchNorm statistics) move by their own rule, not the norm bound; an answer
    # moving them by more than the warm-up ceiling × their norm is left out (a 1e30 variance)
    buffer_ceiling = job.clipper.ceiling_factor * max(acc.float_buffer_norm(job.theta), 1.0)
    # Δ_m = Θ_p − (Θ_p^{base_m} + δ_m) against the replica every learner holds (the learner's own
    # value is built on it); the step is taken from the master, so what quantization left out of
    # the replica (master − replica) is carried, never mistaken for a gradient. Robust: each Δ_m
    # is scaled down to the lower of a few times its learners' median norm and 1.5 × the round's
    # weighted median (or, before either exists, dropped when far larger than the fragment)
    scales = fold_round(acc, job.theta, [(a.sender, job.bases[a.base], a.delta, a.clip_steps) for a in job.answers],
                        job.weights.tolist(), job.clipper, buf=scratch[2], buffer_ceiling=buffer_ceiling)
    clipped = [a.sender for a, scale in zip(job.answers, scales) if scale != 1.0]
    if acc.count == 0:                                       # every answer dropped: no merge
        return MergeResult(None, None, None, [], clipped, time.perf_counter() - t0, every_answer_dropped=True)
    theta, momentum = outer_step(master, job.momentum, acc.result(), spec.spans, algo, merges_done=job.version)
    try:   # the broadcast's encoder checks Θ in the pass that encodes it (no pass of its own)
        replica, master, frames = broadcast_merged(job, theta)
    except quant.NonFiniteError:   # a diverged learner must not poison Θ
        return MergeResult(None, None, None, [], clipped, time.perf_counter() - t0)
    return MergeResult(replica, master, momentum, frames, clipped, time.perf_counter() - t0,
                       alignment=acc.alignment, norms=tuple(acc.answer_norms()))


def broadcast_merged(job: MergeInput, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, list[Any]]:
    """(replica, master, broadcast frames) after an outer step whose result is ``new`` (ALGORITHM §7).

    fp32 downlink: the full value (replica = ``new``, no separate master). Otherwise the
    update q(new − Θ_old) in the run's downlink codec, from version ``job.version``; the
    shard and every learner holding Θ_old compute Θ_old + deq(q(update)) with the same fp32
    additions, so all replicas stay bit-identical, while ``new`` stays the fp32 master (the
    next update carries what this one dropped). Pure: runs on the merge worker."""
    codec, old_version = job.algo.downlink_codec, job.version
    if codec == "fp32":
        return new, None, wire.encode(kind=wire.FRAG, run=job.run_id, sender=job.sender, fragment=job.spec.index,
                                      epoch=job.epoch, values=new, codec="fp32", version=old_version + 1)
    replica, frames = quantized_update(job.theta, new, codec)
    return replica, new, wire.encode(kind=wire.FRAG, run=job.run_id, sender=job.sender, fragment=job.spec.index,
                                     epoch=job.epoch, codec=codec, encoded=(frames, new.numel()),
                                     version=old_version + 1, base=old_version)


class Merging:
    """The merge steps of ``Shard`` on its loop thread (a mixin: the loop's state is the shard's)."""

    def _merge(self, f: FragmentState, now: float, reason: str, grace: float) -> None:
        """Close the round and hand its merge to the worker thread; ``_finish_merges`` applies the
        result on this loop (which meanwhile goes on reading sockets and answering requests).
        The fragment opens no round until then."""
        rnd = f.round
        answers = list(rnd.answers.values())
        weights, capped = fair_weights([a.tokens for a in answers], [a.steps for a in answers])  # [M]
        self.stats.weights_capped += len(capped)
        f.round = None
        if float(weights.sum()) <= 0.0:
            self._record_failed_round(f, "every answer weighs 0 (no tokens claimed)")
            return
        clipper, f.clipper = f.clipper, None            # the worker's until the result is applied
        job = MergeJob(fragment=f, rnd=rnd, answers=answers, weights=weights, closed_at=now, reason=reason,
                       grace=grace, version=f.version, epoch=self.epoch, clipper=clipper)
        f.merging = job
        work = MergeInput(spec=f.spec, theta=f.theta, master=f.master, momentum=f.momentum,
                          bases={a.base: f.history[a.base] for a in answers}, answers=tuple(answers),
                          weights=weights, clipper=clipper, algo=self.run.algo, version=f.version, epoch=self.epoch,
                          run_id=self.endpoints.run_id, sender=self.id, scratch=self._scratch,
                          largest_numel=max(g.spec.numel for g in self.frags.values()))
        if self._merger is None:
            job.result = compute_merge(work)
            self._apply_merge(job)
        else:
            job.future = self._merger.submit(compute_merge, work)
            job.future.add_done_callback(self._wake)

    def _merge_scratch(self, numel: int) -> tuple[torch.Tensor, ...]:
        """This thread's merge buffers (``scratch_buffers``), sized to the shard's largest fragment."""
        return scratch_buffers(self._scratch, numel, largest=max(f.spec.numel for f in self.frags.values()))

    def _drain_merges(self) -> None:
        merger, self._merger = self._merger, None
        if merger is None:
            return
        merger.shutdown(wait=True)
        for f in self.frags.values():
            job = f.merging
            if job is not None and job.future is not None:
                try:
                    job.result = job.future.result()
                except Exception as e:   # logged; the checkpoint of what was merged still gets written
                    f.merging, f.clipper = None, job.clipper
                    self.log.error("syncer.merge_failed", fragment=f.spec.index, error=repr(e))
                    continue
                self._apply_merge(job)

    def _finish_merges(self) -> None:
        for f in self.frags.values():
            job = f.merging
            if job is not None and job.future is not None and job.future.done():
                job.result = job.future.result()            # an exception here is a bug: the daemon stops
                self._apply_merge(job)

    def _apply_merge(self, job: MergeJob) -> None:
        f, rnd, answers, res = job.fragment, job.rnd, job.answers, job.result
        f.merging, f.clipper = None, job.clipper          # the clipper is back with its fragment
        for sender in res.clipped:
            self._reject("clipped", sender, f.spec.index)
        if res.replica is None:
            self._merge_dropped(job)
            return
        if f.failed_rounds:
            self.log.info("syncer.fragment_merges_again", fragment=f.spec.index, failed_rounds=f.failed_rounds)
            f.failed_rounds = 0
        f.theta, f.master, f.momentum = res.replica, res.master, res.momentum
        f.version += 1
        if f.master is None and self._whole_reply(f):
            f.reply = (job.epoch, f.version, [res.frames])   # fp32 downlink: the broadcast is the reply
        else:
            f.reply = None          # an older version's reply serves no request now, and is as large as the fragment
        f.history[f.version] = f.theta             # never changed in place: a new tensor every merge
        for v in sorted(f.history)[:-self.run.algo.history_versions]:
            del f.history[v]
        self._publish(res.frames)
        now = self.clock()
        self.stats.merges += 1
        self.stats.round_s.observe(now - rnd.opened_at)
        self.stats.merge_s.observe(res.seconds)
        self._merges_since_ckpt += 1
        self.xi_sync.update(now - job.closed_at)    # round closed -> merged value out (compute included)
        contributors = [a.sender for a in answers]
        waited = 0.0 if rnd.quorum_at is None else job.closed_at - rnd.quorum_at
        self.log.info("syncer.merge", fragment=f.spec.index, version=f.version, round=rnd.round_id,
                      contributors=contributors, reason=job.reason, merge_s=round(res.seconds, 4))
        self._record_merge(f, rnd, answers, job.weights, waited, job.grace, job.reason, res)
        self._check_schedule(f, now)
        reason = checkpoint_due(advanced=f.version - self._ckpt_versions.get(f.spec.index, 0),
                                merges_since=self._merges_since_ckpt, since_last_s=now - self._ckpt_at,
                                every_merges=self.options.checkpoint_every_merges,
                                interval_s=self.options.checkpoint_interval_s)
        if reason:
            self.checkpoint(reason=reason)
        self._journal_after_merge(f.spec.index, f.version)

    def _merge_dropped(self, job: MergeJob) -> None:
        """A merge that produced nothing: every answer clipped away, or a value not finite."""
        f, rnd, answers, res = job.fragment, job.rnd, job.answers, job.result
        if res.every_answer_dropped:              # by the clipper: nothing to merge, Θ as it was
            self.log.warning("syncer.merge_dropped_every_answer_clipped", fragment=f.spec.index,
                             round=rnd.round_id, contributors=[a.sender for a in answers])
            self._record_failed_round(f, "every answer dropped by the norm bound (syncer.merge_dropped_every_answer_clipped)")
            return
        self.stats.nonfinite_rounds += 1
        self.log.warning("syncer.nonfinite_merge_dropped", fragment=f.spec.index, round=rnd.round_id,
                         contributors=[a.sender for a in answers])
        self._record_failed_round(f, "the merged value was not finite (syncer.nonfinite_merge_dropped)")

    def _record_failed_round(self, f: FragmentState, problem: str) -> None:
        """A round closed without a merge: counted per fragment, and its reason kept in the
        fragment's Redis entry (``ddloco status`` and ``up`` name it) until the next merge."""
        f.failed_rounds += 1
        try:
            self.redis.hset(self.keys.fragment(f.spec.index), mapping={"problem": problem,
                                                                       "failed_rounds": f.failed_rounds})
        except redis.RedisError as e:
            self._redis_lost(e)

    def _check_schedule(self, f: FragmentState, now: float) -> None:
        """Rounds must come every H learner steps: the steps between two merges of a fragment
        (time between them ÷ the median learner step time) are tracked as an EMA; above
        BEHIND_FACTOR × H the merge is counted as behind and logged (at most every 10 s)."""
        last, f.last_merged_at = f.last_merged_at, now
        if last is None or self.run.algo.lockstep or not self.live:
            return
        h = (now - last) / max(self._xi_step(slowest=False), 1e-6)
        f.effective_h = h if f.effective_h == 0.0 else 0.8 * f.effective_h + 0.2 * h
        H = self.run.algo.sync_every_steps
        if f.effective_h > BEHIND_FACTOR * H:
            self.stats.rounds_behind += 1
            if now - self._behind_logged_at >= 10.0:
                self._behind_logged_at = now
                self.log.warning("syncer.rounds_behind", fragment=f.spec.index, effective_h=round(f.effective_h, 1),
                                 configured_h=H, last_merge_s=round(self.stats.merge_s.last_s, 4),
                                 count=self.stats.rounds_behind)

    def _record_merge(self, f: FragmentState, rnd: OpenRound, answers: list[Answer], weights: torch.Tensor,
                      waited: float, grace: float, reason: str, res: MergeResult | None = None) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            t = time.time()
            pipe.hset(self.keys.fragment(f.spec.index), mapping={
                "version": f.version, "shard": self.options.shard, "merged_at": t,
                "contributors": ",".join(a.sender for a in answers)})
            pipe.hdel(self.keys.fragment(f.spec.index), "problem", "failed_rounds")
            for a in answers:
                pipe.hincrby(self.keys.learner(a.sender), "merged_contributions", 1)
                pipe.hset(self.keys.learner(a.sender), "last_merged_at", t)
            control.add_event(pipe, self.keys, "merge", fragment=f.spec.index, version=f.version,
                              shard=self.options.shard, round=rnd.round_id,
                              contributors=[a.sender for a in answers],
                              steps=[int(a.steps) for a in answers],
                              weights=[round(float(w), 4) for w in weights],
                              grace_waited_s=round(waited, 4), grace_s=round(grace, 4), reason=reason,
                              dropped=self.stats.dropped, late=self.stats.late_answers,
                              staleness=[f.version - 1 - a.base for a in answers],
                              clipped=list(res.clipped) if res is not None else [],
                              norms=[round(n, 6) for n in res.norms] if res is not None else [],
                              alignment="" if res is None or res.alignment is None else round(res.alignment, 4))
            pipe.execute()
            self._redis_ok = True
        except redis.RedisError as e:
            self._redis_lost(e)

