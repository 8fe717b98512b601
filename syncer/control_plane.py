"""A shard's control plane (Redis): its lease, its entry and its fragments' records, the run's
config and counters put back after an empty restart, and the live learners read every
``CONTROL_REFRESH_S``.

Ownership: runs on the shard's loop thread only; what it reads (``live``, ``token_shares``,
``run_tokens``, the step times and first sightings of learners) is the loop's.
"""
from __future__ import annotations

import os
import time
from typing import Any

import redis

from common import control, counters, entries, positions, tokens as run_count
from common.fragments import plan_layout
from common.lifecycle import peak_rss_mb
from syncer import janitor
from syncer.state import CONTROL_REFRESH_S, finite_or_nan, step_time_of


class ControlPlane:
    """The Redis side of ``Shard`` (a mixin: the loop thread's state is the shard's)."""

    def _refresh_control(self, now: float | None = None, force: bool = False) -> None:
        """Every CONTROL_REFRESH_S (``force``: now): renew the lease, read the live learners, write back what Redis must hold."""
        now = self.clock() if now is None else now
        if not force and now - self._last_control < CONTROL_REFRESH_S:
            return
        self._last_control = now
        try:
            if not control.renew_lease(self.redis, self.keys.shard_lease(self.options.shard), self.lease_holder,
                                       ttl_s=self.options.lease_ttl_s):
                self._lease_lost = True  # another process owns these fragments now: write nothing
                raise control.LeaseHeld(f"lost the lease of shard {self.options.shard} to "
                                        f"{self.redis.get(self.keys.shard_lease(self.options.shard))!r}")
            control.sync_members(self.redis, self.keys)   # the membership set is ours to keep
            self.live = control.live_learners(self.redis, self.keys)
            if self.policy.all_live:   # done, not dead: left after its training ended (lock-step stops waiting)
                if self._known_learners is None:   # the run's learners before this shard (a restart)
                    self._known_learners = control.learner_ids(self.redis, self.keys)
                seen = (self._known_learners | self._first_seen.keys()) - self.live.keys()
                # kept across refreshes: an empty Redis restart loses the entries that said so (one
                # that is live again, a restart under the same id, is no longer finished)
                before = self._departed
                self._departed = ((self._departed - self.live.keys())
                                  | control.finished_learners(self.redis, self.keys, seen - self._departed))
                if self._departed - before and not any(f.recovery is not None for f in self.frags.values()):
                    self.checkpoint(reason="departed")   # kept now: a restart may find Redis empty too
            self._remember_step_times()
            self._accept_token_claims()
            self._live_read_unix = time.time()
            pipe = self.redis.pipeline(transaction=False)
            control.register_shard(pipe, self.keys, self.options.shard, self._shard_entry())
            for p, f in self.frags.items():
                if f.recovery is not None:
                    continue  # the recorded version stays until this fragment has caught up
                pipe.hset(self.keys.fragment(p), mapping={"version": f.version, "shard": self.options.shard,
                                                          "round": -1 if f.round is None else f.round.round_id})
            # the learners' data positions, put back before the run config: a learner that waits for
            # the config after an empty restart reads its position only once the config is back
            positions.record(pipe, self.keys, self.data_positions)
            control.publish_run_config(pipe, self.keys, self.run)  # rebuilds it after an empty restart
            pipe.hsetnx(self.keys.config, "shards", self.options.shards)
            control.raise_counter(pipe, self.keys.epochs, self.epoch)  # epochs never go back either
            # the run's token count (the learners' LR schedule): put back the shares Redis lost, read them
            run_count.record(pipe, self.keys, self.token_shares)
            pipe.hgetall(self.keys.token_shares)
            pipe.hget(self.keys.eval, "loss")       # `up`'s last evaluation of the global model, for /metrics
            res = pipe.execute()
            self.token_shares = run_count.merge_shares(self.token_shares, res[-2])
            self.run_tokens = max(self.run_tokens, int(res[-3]))
            self._eval_loss = finite_or_nan(res[-1])
            control.restore_run_config(self.redis, self.keys, self.run, plan_layout(self.plan))
            self._tidy_member_keys(now)
            if not self._redis_ok:
                self.log.info("syncer.redis_back")
            self._redis_ok = True
        except redis.RedisError as e:
            self._redis_lost(e)

    def _tidy_member_keys(self, now: float) -> None:
        """Shard 0, every ``janitor.TIDY_EVERY_S``: the next batch of the learners' own keys kept
        within bounds (``syncer.janitor``)."""
        if self._janitor is not None and now - self._last_tidy >= janitor.TIDY_EVERY_S:
            self._last_tidy = now
            try:
                self._janitor.tidy(self.redis)
            except redis.ResponseError as e:   # e.g. a Redis whose ACL refuses SCAN: not Redis lost
                self._janitor = None
                self.log.warning("syncer.member_keys_unchecked", error=str(e)[:200],
                                 detail="learners' own keys are not kept within bounds by this shard")

    def _shard_entry(self) -> dict[str, Any]:
        """This shard's hash in Redis (``ddloco status`` and ``up`` read it): endpoint, plan, counters."""
        return {
            "rpc": self.rpc_endpoint, "shards": self.options.shards, "pid": os.getpid(),
            "plan": self.plan_digest, "checkpoint": str(self.checkpoint_path or ""), "epoch": self.epoch,
            **counters.hash_fields(self.stats), "status": "running", "dropped": self.stats.dropped,
            "heartbeat_at": time.time(),
            "peak_rss_mb": peak_rss_mb(), "cpu_s": round(time.process_time(), 3),
            "bad_entries": entries.BAD_ENTRIES.total()}

    def _accept_token_claims(self) -> None:
        """Learner processes' own token counts taken into the run's shares, each learner id capped
        by ``run_count.accept_claims``: the live ones' (their hashes), and from the ``life`` hashes
        those of processes live at the previous read (their last count) and of processes never
        counted yet (a life shorter than one control refresh). A process that stays gone is not
        read again (until it is live again): a stopped attacker's claim does not grow with the others'."""
        paused = set(self.token_shares) - self._live_fields
        lives = control.life_fields(self.redis, self.keys, ("tokens", "data_position"), skip=paused)
        claims = run_count.claims_of_lives({life: tokens for life, (tokens, _) in lives.items()})
        # the same processes' data positions (a learner that just left: its final one)
        self.data_positions = positions.raised(self.data_positions, [
            *((lid, pos) for (lid, _), (_, pos) in lives.items()),
            *((lid, h.get(field)) for lid, h in self.live.items() for field in ("data_position", "position_ahead"))])
        live = run_count.claims_of(self.live)
        claims.update(live)
        self._live_fields = set(live)
        # no id above 2 x the median learner's count, nor, while the others are joining, above one
        # sync period's tokens at the claims' bound
        floor = int(self.tokens_per_step_bound * self.run.algo.sync_every_steps)
        self.token_shares = run_count.accept_claims(self.token_shares, claims, live=self.live, floor=floor)

    def _remember_step_times(self) -> None:
        """Each live learner's step-time EMA, kept when Redis forgets it (claims are checked against it)."""
        if len(self._step_s_seen) > 100_000:     # bounded whatever joins
            self._step_s_seen.clear()
        if len(self._first_seen) > 100_000:
            self._first_seen.clear()
        first = self._live_reads == 0   # learners live at this shard's very first read: since it started
        self._live_reads += 1
        for lid, h in self.live.items():
            # it was not live at the previous read: it joined after that, at the earliest
            self._first_seen.setdefault(lid, self._since_unknown_unix if first else self._live_read_unix)
            t = step_time_of(h)
            if t is not None:
                self._step_s_seen[lid] = t

    def _redis_lost(self, err: Exception) -> None:
        if self._redis_ok:
            self.log.warning("syncer.redis_unavailable", error=str(err))
        self._redis_ok = False
