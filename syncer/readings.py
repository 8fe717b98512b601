"""What a shard shows at ``/metrics``: an immutable snapshot the loop publishes, and the readings
made from it on the scrape's thread.

Ownership: the loop thread builds a ``ShardSnapshot`` (copies of its counters, never references
to them) and publishes it in a ``Published`` box; the metrics thread gets only that box
(``Shard.__enter__`` hands it ``lambda: readings_of(box.latest())``), so it cannot read the
shard's live state: by design, not by care. (``entries.BAD_ENTRIES`` is process-wide, with its
own lock: read at the scrape, as before.) A scrape shows the counters of the last snapshot, at
most ``SNAPSHOT_EVERY_S`` old.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from common import entries, metrics
from syncer.state import FragmentState, ShardStats

SNAPSHOT_EVERY_S = 0.05
"""The loop publishes a new snapshot at most this often (every poll would cost the loop for nothing)."""


@dataclass(frozen=True, kw_only=True)
class ShardSnapshot:
    """The shard's counters at one moment, owned by no one (nothing writes it after it is made)."""

    stats: ShardStats
    """A copy of the loop's counters (its dict and histograms copied too)."""
    grace_s: float
    rounds_open: int
    recovering: int
    versions: Mapping[str, int]
    live_learners: int
    eval_loss: float


def _frozen_histogram(h: metrics.Histogram) -> metrics.Histogram:
    c = copy.copy(h)
    c.counts = list(h.counts)
    return c


def snapshot_of(stats: ShardStats, frags: Mapping[int, FragmentState], *, grace_s: float, live_learners: int,
                eval_loss: float) -> ShardSnapshot:
    """On the loop thread: a snapshot of what ``/metrics`` shows."""
    st = dataclasses.replace(stats, rejected=dict(stats.rejected), round_s=_frozen_histogram(stats.round_s),
                             merge_s=_frozen_histogram(stats.merge_s))
    return ShardSnapshot(stats=st, grace_s=grace_s, rounds_open=sum(f.round is not None for f in frags.values()),
                         recovering=sum(f.recovery is not None for f in frags.values()),
                         versions=MappingProxyType({str(p): f.version for p, f in frags.items()}),
                         live_learners=live_learners, eval_loss=eval_loss)


class Published:
    """The latest snapshot: the loop replaces it (one reference assignment), any thread reads it."""

    def __init__(self, first: ShardSnapshot) -> None:
        self._latest = first

    def publish(self, snap: ShardSnapshot) -> None:
        self._latest = snap

    def latest(self) -> ShardSnapshot:
        return self._latest


def readings_of(snap: ShardSnapshot) -> list[metrics.Reading]:
    """What ``/metrics`` shows, from one snapshot (read on the scrape's thread)."""
    st = snap.stats
    return [
        metrics.counter("shard_merges_total", "Rounds merged into a new fragment version (restored from the "
                        "checkpoint at start).", st.merges),
        metrics.counter("shard_answers_total", "Learner answers by outcome: accepted (into its open round), "
                        "late (the round had merged), stale_base (its base version or shard life is gone), "
                        "wrong_run.", {"accepted": st.answers, "late": st.late_answers,
                                       "stale_base": st.stale_base, "wrong_run": st.wrong_run}, "outcome"),
        metrics.counter("shard_answers_rejected_total", "Answers refused (nonfinite_delta) or cut (claims, "
                        "clipped) by the robust merge, by reason.", dict(st.rejected), "reason"),
        metrics.counter("shard_bad_entries_total", "Redis entries ignored as malformed, by kind.reason "
                        "(common/entries.py).", entries.BAD_ENTRIES.snapshot(), "reason"),
        metrics.counter("shard_malformed_total", "Messages and requests that failed to decode or made no "
                        "sense (dropped).", st.malformed),
        metrics.counter("shard_rounds_dropped_total", "Rounds whose merge was not finite (dropped).",
                        st.nonfinite_rounds),
        metrics.counter("shard_reopens_total", "Round opens sent again (no quorum yet).", st.reopens),
        metrics.counter("shard_bytes_total", "Message bytes: in (answers, copies), out (opens, merged "
                        "fragments, replies).", {"in": st.bytes_in, "out": st.bytes_out}, "direction"),
        metrics.counter("shard_fragment_requests_total", "Full-fragment requests: served, deferred (the "
                        "fragment was recovering), deduped (sent to that requester moments ago).",
                        {"served": st.requests, "deferred": st.requests_deferred, "deduped": st.requests_deduped},
                        "outcome"),
        metrics.counter("shard_checkpoints_total", "Checkpoints: written, failed.",
                        {"written": st.checkpoints, "failed": st.checkpoint_errors}, "outcome"),
        metrics.counter("shard_versions_behind_total", "Fragments that restarted below the run's recorded "
                        "version (no live learner had it).", st.versions_behind),
        metrics.histogram("shard_round_seconds", "Seconds from a round's open to its merge.", st.round_s),
        metrics.histogram("shard_merge_seconds", "Seconds of merge computation per round (worker thread).",
                          st.merge_s),
        metrics.counter("shard_rounds_behind_total", "Merges later than the schedule: the fragment's "
                        "learner steps between merges (EMA) above 1.2 x H.", st.rounds_behind),
        metrics.gauge("shard_grace_window_seconds", "The adaptive grace window: how long a round waits "
                      "for more answers past its quorum.", snap.grace_s),
        metrics.gauge("shard_rounds_open", "Rounds in flight.", snap.rounds_open),
        metrics.gauge("shard_fragments_recovering", "Fragments still collecting live learners' copies.",
                      snap.recovering),
        metrics.gauge("shard_fragment_version", "Version of each owned fragment.",
                      dict(snap.versions), "fragment"),
        metrics.gauge("shard_live_learners", "Learners with a fresh heartbeat, as last read from Redis.",
                      snap.live_learners),
        metrics.gauge("run_global_eval_loss", "The global model's last eval loss, as `ddloco up` evaluated it "
                      "(read from Redis; NaN when nothing evaluates the run).", snap.eval_loss),
    ]
