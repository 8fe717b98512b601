"""What a shard's /metrics thread reads (syncer/readings.py): a snapshot the loop published, never
the loop's live counters; and what a merge worker reads (syncer/merging.py): one message."""
from __future__ import annotations

import threading

import pytest
import torch

from common.config import AlgoConfig
from common.fragments import model_plan
from common.robust import NormClipper
from syncer.merging import compute_merge
from syncer.readings import Published, readings_of, snapshot_of
from syncer.state import Answer, FragmentState, MergeInput, OpenRound, ShardStats
from tests.conftest import TinyNet

pytestmark = pytest.mark.timeout(10)


def _values(readings) -> dict:
    return {r.name: r.value for r in readings}


def test_metrics_show_the_published_snapshot_while_the_loop_counts_on() -> None:
    stats = ShardStats(merges=2, answers=5)
    stats.round_s.observe(0.5)
    frags = {0: FragmentState(spec=None, theta=torch.zeros(1), momentum=torch.zeros(1), version=2),
             1: FragmentState(spec=None, theta=torch.zeros(1), momentum=torch.zeros(1), version=1,
                              round=OpenRound(round_id=1, opened_at=0.0))}
    box = Published(snapshot_of(stats, frags, grace_s=0.25, live_learners=3, eval_loss=1.5))
    # the loop goes on: counters, histograms, rejections, versions and rounds all change
    stats.merges += 1
    stats.answers += 4
    stats.rejected["clipped"] = 7
    stats.round_s.observe(0.1)
    frags[0].version, frags[1].round = 3, None
    got = _values(readings_of(box.latest()))
    assert got["shard_merges_total"] == 2
    assert got["shard_answers_total"]["accepted"] == 5
    assert dict(got["shard_answers_rejected_total"]) == {}
    assert got["shard_round_seconds"].count == 1 and got["shard_round_seconds"].sum_s == 0.5
    assert dict(got["shard_fragment_version"]) == {"0": 2, "1": 1}
    assert got["shard_rounds_open"] == 1 and got["shard_grace_window_seconds"] == 0.25
    assert got["shard_live_learners"] == 3 and got["run_global_eval_loss"] == 1.5
    box.publish(snapshot_of(stats, frags, grace_s=0.25, live_learners=3, eval_loss=1.5))   # the next publication
    got = _values(readings_of(box.latest()))
    assert got["shard_merges_total"] == 3 and dict(got["shard_answers_rejected_total"]) == {"clipped": 7}
    assert got["shard_round_seconds"].count == 2 and dict(got["shard_fragment_version"]) == {"0": 3, "1": 1}


def test_a_merge_worker_needs_only_its_message_and_updates_the_clipper_it_carries() -> None:
    """``compute_merge`` runs on a ``MergeInput`` alone (no shard, no FragmentState): one answer
    of outer gradient g at lr 1 and no momentum moves Θ by -g, into new tensors."""
    spec = model_plan(TinyNet(), (), 4)[0]
    theta = torch.linspace(-1, 1, spec.numel)
    delta = torch.full((spec.numel,), 0.01)       # the learner's value: Θ + δ (Δ = Θ - (Θ + δ) = -δ)
    clipper = NormClipper()
    algo = AlgoConfig(fragments=4, outer_lr=1.0, outer_momentum=0.0, outer_warmup_merges=0, merge_rule="mean")
    job = MergeInput(spec=spec, theta=theta, master=None, momentum=torch.zeros(1).expand(spec.numel), bases={0: theta},
                     answers=(Answer(sender="l0", base=0, steps=4, tokens=64, delta=delta, received_at=0.0),),
                     weights=torch.ones(1), clipper=clipper, algo=algo, version=0, epoch=1, run_id="t",
                     sender="shard0", scratch=threading.local(), largest_numel=spec.numel)
    res = compute_merge(job)
    assert res.replica is not None and res.replica is not theta and res.clipped == []
    first = spec.pieces[0].stop - spec.pieces[0].start          # fc1.weight: the fragment's first span
    torch.testing.assert_close(res.replica[:first], (theta + delta)[:first], atol=1e-4, rtol=0)
    assert theta.equal(torch.linspace(-1, 1, spec.numel)), "the worker wrote no input in place"
    assert clipper.norms, "the clipper it carried recorded the answer's norm"
