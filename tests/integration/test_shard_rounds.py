"""A real shard (real redis-server, broker and learner in threads): a stuck round says why, once;
a fragment's clipper is with its merge worker while the merge runs, and back with the fragment after."""
from __future__ import annotations

import logging

import pytest
import structlog
from structlog.testing import capture_logs

from common.config import AlgoConfig, RunConfig
from tests.conftest import hold_merge, wait_until

pytestmark = pytest.mark.timeout(90)

ASYNC = RunConfig(algo=AlgoConfig(fragments=4, sync_every_steps=4, quorum=1, inner_warmup_steps=1))


@pytest.fixture
def info_logs():
    """Info lines reach ``capture_logs`` whatever level an earlier test configured (structlog's
    filtering wrapper drops them before any processor)."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    yield
    structlog.configure(**saved)


def test_a_round_stuck_below_its_quorum_logs_why_once(make_cluster, info_logs):
    """K = 2 with one learner: every round waits for a second answer forever. The shard says so
    in one ``syncer.round_state`` line per round and reason, however often it re-sends the open."""
    run = RunConfig(algo=AlgoConfig(fragments=4, sync_every_steps=4, quorum=2, inner_warmup_steps=1))
    with capture_logs() as logs:
        cluster = make_cluster(run)
        shard = cluster.start_shard(0, 1, reopen_after_steps=1.0)
        cluster.start_learner(cluster.learner("l0", 0, step_time_floor_ms=5))
        stuck = "waiting for quorum: 1/2 answers, "   # then "1 live" (the live count may lag under load)

        def stuck_lines() -> list[dict]:
            return [e for e in list(logs) if e["event"] == "syncer.round_state" and e["reason"].startswith(stuck)]
        wait_until(lambda: stuck_lines(), 30, what=f"a syncer.round_state line '{stuck}'")
        reopens = shard.stats.reopens
        wait_until(lambda: shard.stats.reopens >= reopens + 3, 30, what="the stuck rounds' opens sent 3 more times")
        lines = stuck_lines()
    assert all(shard.frags[p].version == 0 for p in shard.frags), "no round can merge below its quorum"
    per_round = [(e["fragment"], e["round"], e["reason"]) for e in lines]
    assert len(per_round) == len(set(per_round)), f"logged again without a change: {per_round}"
    assert {e["decision"] for e in lines} == {"wait_quorum"}
    assert not cluster.errors, cluster.errors


def test_a_fragments_clipper_travels_with_its_merge_and_comes_back(make_cluster, monkeypatch):
    """While fragment 0's merge is held on its worker, the fragment holds no clipper (the worker
    owns it); applied, the clipper is back with the norms that merge recorded."""
    held = hold_merge(monkeypatch, 0)
    cluster = make_cluster(ASYNC)
    shard = cluster.start_shard(0, 1)
    cluster.start_learner(cluster.learner("l0", 0, step_time_floor_ms=5))
    wait_until(held.entered.is_set, 30, what="fragment 0's merge on the worker")
    held_version = shard.frags[0].version
    assert shard.frags[0].merging is not None and shard.frags[0].clipper is None, "the worker owns the clipper"
    held.release.set()
    wait_until(lambda: shard.frags[0].version > held_version, 10, what="the held merge applied")
    wait_until(lambda: shard.frags[0].clipper is not None, 10, what="the clipper back with its fragment")
    assert held.clipper.norms, "the merge recorded its answers' norms in the clipper it owned"
    assert not cluster.errors, cluster.errors
