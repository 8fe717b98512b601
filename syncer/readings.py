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

from common import counters, entries, metrics
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
    return [
        *counters.readings(snap.stats),
        metrics.counter("shard_bad_entries_total", "Redis entries ignored as malformed, by kind.reason "
                        "(common/entries.py).", entries.BAD_ENTRIES.snapshot(), "reason"),
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
