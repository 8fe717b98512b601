"""A shard's checkpoints and its journal keep every fragment within what a restart can take back:
a shard that crashed, and whose Redis lost the run's record, adopts a copy one learner alone
holds only up to its journal's version + ``JOURNAL_SLACK`` (its checkpoint's version +
``checkpoint_every_merges`` where there is no journal; ``syncer.checkpoints.lone_limit``)."""
from __future__ import annotations

import threading

import pytest
import torch

from common import control
from common.config import AlgoConfig, RunConfig
from common.keys import Keys
from tests.conftest import wait_until

ASYNC = RunConfig(algo=AlgoConfig(fragments=4, sync_every_steps=4, quorum=1, inner_warmup_steps=1))


def _versions(state: dict) -> dict[int, int]:
    return {int(p): int(fs["version"]) for p, fs in state["fragments"].items()}


def _crash_at_a_merge(shard, crash_after) -> threading.Event:
    """From the first merge ``crash_after(fragment)`` is true for (asked on the loop, after that
    merge is applied and broadcast), the shard applies no merge and writes no checkpoint, as if it
    died there; ``cluster.stop_shard`` then ends it. Returns the event set at that merge."""
    crashed = threading.Event()
    apply = shard._apply_merge

    def apply_until_the_crash(job) -> None:
        if crashed.is_set():
            return                                  # lost with the process: nothing applied nor broadcast
        apply(job)
        if crash_after(job.fragment):
            crashed.set()
    shard._apply_merge = apply_until_the_crash
    shard._drain_merges = lambda: None
    real_checkpoint = shard.checkpoint
    shard.checkpoint = lambda **kw: None if crashed.is_set() else real_checkpoint(**kw)
    return crashed


def _only_the_first_write_lands(monkeypatch) -> tuple[list, list[dict[int, int]], list[dict], threading.Event]:
    """Patches ``Shard._write_checkpoint``: the shard put in ``victim`` writes its first checkpoint
    (its versions in ``on_disk``); every later one is held (in ``held``) until ``release``, as if
    the process died while writing it. Returns (victim, on_disk, held, release)."""
    from syncer.shard import Shard
    write = Shard._write_checkpoint
    victim: list = []
    on_disk: list[dict[int, int]] = []
    held: list[dict] = []
    release = threading.Event()

    def only_the_first_lands(self, state) -> None:   # the writer thread
        if not victim or self is not victim[0]:
            return write(self, state)
        if not on_disk:
            write(self, state)
            on_disk.append(_versions(state))
            return
        held.append(state)
        release.wait(60)                            # the process died meanwhile: nothing written
    monkeypatch.setattr(Shard, "_write_checkpoint", only_the_first_lands)
    return victim, on_disk, held, release


def _stop_at_the_crash(cluster, shard, learner, crashed, release) -> dict[int, int]:
    """Once ``crashed`` is set and the learner holds the last merged versions, the shard stops (its
    held writes released as it ends); returns the versions at the crash."""
    try:
        wait_until(crashed.is_set, 90, what="the crash")
        crashed_at = {p: f.version for p, f in shard.frags.items()}
        wait_until(lambda: all(int(learner.base_version[p]) == v for p, v in crashed_at.items()), 20,
                   what="the learner holding the last merged versions")
        cluster.stop_shard(0)
        wait_until(lambda: shard._ctx is None, 10, what="the shard gone")
    finally:
        release.set()
    return crashed_at


def _restart_after_redis_lost(cluster, redis_server, learner, crashed_at: dict[int, int], every: int) -> None:
    """Redis restarts empty, the shard starts again: once its recovery is done, no fragment is
    below its version at the crash and the learner was never moved back."""
    redis_server.restart_empty()
    r = control.connect(redis_server.url)
    wait_until(lambda: r.exists(Keys(cluster.endpoints.run_id).heartbeat("l0")), 20,
               what="the learner's heartbeat rebuilt")
    restarted = cluster.start_shard(0, 1, checkpoint_every_merges=every, recovery_timeout_s=30.0)
    wait_until(lambda: all(f.recovery is None for f in restarted.frags.values()), 40, what="recovery done")
    assert all(restarted.frags[p].version >= v for p, v in crashed_at.items()), \
        ({p: f.version for p, f in restarted.frags.items()}, crashed_at)
    assert learner.stats.versions_regressed == 0


@pytest.mark.timeout(120)
def test_a_lone_learners_copy_a_full_bound_past_the_checkpoint_is_recovered_after_redis_lost_the_record(
        make_cluster, redis_server, monkeypatch):
    """The shard writes its first checkpoint, then dies while writing the next one (the write never
    lands) after the fragment that called for it merged once more: that fragment is then
    ``checkpoint_every_merges`` versions past the file on disk, the edge of the bound. Redis restarts
    empty (no recorded version): the restarted shard still takes the one learner's copy of every
    fragment, and nobody is moved back."""
    from ddloco.export import from_checkpoints
    every = 3
    victim, on_disk, held, release = _only_the_first_write_lands(monkeypatch)
    cluster = make_cluster(ASYNC)
    shard = cluster.start_shard(0, 1, checkpoint_every_merges=every)
    victim.append(shard)

    def furthest_ahead() -> tuple[int, int]:        # the fragment of the held snapshot furthest past the disk
        snap = _versions(held[0])
        q = max(snap, key=lambda p: snap[p] - on_disk[0][p])
        return q, snap[q]

    crashed = _crash_at_a_merge(shard, lambda f: bool(held) and (f.spec.index, f.version - 1) == furthest_ahead())
    learner = cluster.learner("l0", 0, step_time_floor_ms=5)
    cluster.start_learner(learner)
    crashed_at = _stop_at_the_crash(cluster, shard, learner, crashed, release)
    saved = on_disk[0]
    q, _ = furthest_ahead()
    assert _versions(torch.load(shard.checkpoint_path, weights_only=True)) == saved
    assert from_checkpoints(cluster.checkpoint_dir, cluster.endpoints.run_id, task=cluster.task)[1] == saved
    shard.journal_path.unlink()     # the checkpoint's own bound (a directory from before journals, or one lost)
    _restart_after_redis_lost(cluster, redis_server, learner, crashed_at, every)
    assert crashed_at[q] - saved[q] == every, (crashed_at, saved)      # it was at the bound's edge
    assert not cluster.errors, cluster.errors


@pytest.mark.timeout(120)
def test_a_failed_write_is_retried_at_the_next_merge_and_the_costs_reach_the_shards_hash(make_cluster, monkeypatch):
    """A write that fails (a full disk) leaves the older file; the fragments then count from that
    file again, so the next merge of the one that called for the write retries it at once, rather
    than ``checkpoint_every_merges`` versions later with the bound long passed. The writes' CPU,
    wall seconds and bytes reach the shard's Redis hash."""
    from syncer import checkpoints
    every = 5
    save = checkpoints.save_state
    writes: list[tuple[dict[int, int], bool]] = []

    def the_second_write_fails(state, path) -> None:   # the writer thread
        if len(writes) == 1:
            writes.append((_versions(state), False))
            raise OSError(28, "No space left on device (injected)")
        save(state, path)
        writes.append((_versions(state), True))
    monkeypatch.setattr(checkpoints, "save_state", the_second_write_fails)
    cluster = make_cluster(ASYNC)
    shard = cluster.start_shard(0, 1, checkpoint_every_merges=every)
    cluster.start_learner(cluster.learner("l0", 0, step_time_floor_ms=5))
    wait_until(lambda: len(writes) >= 3, 60, what="a write, a failed one, the next one")
    (saved, _), (failed, ok), (retried, _) = writes[:3]
    assert not ok
    q = max(failed, key=lambda p: failed[p] - saved[p])
    assert retried[q] <= failed[q] + 1, (saved, failed, retried)
    assert all(retried[p] - saved[p] <= every for p in saved), (saved, retried)
    keys = Keys(cluster.endpoints.run_id)
    r = control.connect(cluster.endpoints.redis_url)
    wait_until(lambda: int(r.hget(keys.shard(0), "checkpoints") or 0) >= 2, 20, what="the writes in the shard's hash")
    entry = r.hgetall(keys.shard(0))
    assert shard.stats.checkpoint_errors == 1
    assert int(entry["checkpoint_bytes"]) > 0 and float(entry["checkpoint_cpu_s"]) > 0, entry
    assert float(entry["checkpoint_write_s"]) > 0, entry
    assert not cluster.errors, cluster.errors


@pytest.mark.timeout(120)
def test_a_lone_learners_copy_far_past_the_checkpoint_is_recovered_by_the_journal(make_cluster, redis_server,
                                                                                 monkeypatch):
    """As above, but the shard dies long after its last checkpoint landed: its fragments are far
    more than ``checkpoint_every_merges`` versions past the file on disk (every later write held).
    The journal of their versions (written every ``JOURNAL_EVERY`` versions) bounds what one
    learner alone may give back: after Redis restarted empty, the restarted shard still takes the
    learner's copies, and nobody is moved back. (Bounded by the checkpoint alone, the copies were
    refused and every fragment went back to the file's versions.)"""
    from syncer import checkpoints
    every, beyond = 3, 3 * checkpoints.JOURNAL_EVERY
    victim, on_disk, _, release = _only_the_first_write_lands(monkeypatch)
    cluster = make_cluster(ASYNC)
    shard = cluster.start_shard(0, 1, checkpoint_every_merges=every)
    victim.append(shard)
    crashed = _crash_at_a_merge(shard, lambda f: bool(on_disk) and f.version - on_disk[0][f.spec.index] >= every + beyond)
    learner = cluster.learner("l0", 0, step_time_floor_ms=5)
    cluster.start_learner(learner)
    crashed_at = _stop_at_the_crash(cluster, shard, learner, crashed, release)
    saved = on_disk[0]
    assert _versions(torch.load(shard.checkpoint_path, weights_only=True)) == saved
    assert max(crashed_at[p] - saved[p] for p in saved) >= every + beyond          # far past the old bound
    _restart_after_redis_lost(cluster, redis_server, learner, crashed_at, every)
    assert not cluster.errors, cluster.errors
