"""A learner's threads share no mutable state (learner/ownership.py): with the checks on, every
object a thread owns raises when another thread touches it. Real learners, shard, broker, Redis,
``/metrics`` scrapes and a peer bootstrap (both sides) run through it without one such error."""
from __future__ import annotations

import dataclasses
import urllib.request

import pytest

from common import control
from common.config import AlgoConfig, RunConfig
from common.keys import Keys
from learner import ownership
from learner.core import Learner
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

RUN = RunConfig(algo=AlgoConfig(fragments=4, sync_every_steps=4, quorum=1, inner_warmup_steps=1))


def test_learners_train_serve_a_peer_and_report_with_every_thread_on_its_own_state(make_cluster, monkeypatch):
    monkeypatch.setattr(ownership, "CHECKS", True)
    cluster = make_cluster(RUN)
    shard = cluster.start_shard(0, 1)
    first = cluster.learner("first", 0, step_time_floor_ms=5, metrics_port=0)
    assert isinstance(first._stats, ownership.Owned)
    cluster.start_learner(first)
    wait_until(lambda: min(f.version for f in shard.frags.values()) >= 3 or cluster.errors, 30,
               what="merges of the first learner")
    wait_until(lambda: first.metrics is not None or cluster.errors, 10, what="the first learner's /metrics")
    text = urllib.request.urlopen(first.metrics.url, timeout=5).read().decode()   # the scrape's thread
    assert "learner_steps_total" in text
    base = cluster.learner("late", 1, step_time_floor_ms=5, max_steps=30)
    # a loaded machine: the peer's heartbeat may be a second old, its state a while on the way
    r, keys = control.connect(cluster.endpoints.redis_url), Keys(cluster.endpoints.run_id)
    wait_until(lambda: control.live_learners(r, keys).get("first", {}).get("status") == "training", 30,
               what="the first learner a training member (the shards keep the membership set)")
    late = Learner(endpoints=base.endpoints, task=base.task, run=base._run_arg, stop=base.stop,
                   options=dataclasses.replace(base.options, heartbeat_interval_s=1.0, peer_timeout_s=30.0))
    t = cluster.start_learner(late)
    t.join(timeout=60)
    assert not t.is_alive() and not cluster.errors, cluster.errors
    assert late.stats.bootstrap == "peer first" and first.stats.bootstraps_served == 1, (late.stats, first.stats)
    assert late.stats.steps == 30 and late.stats.answers >= 1, late.stats
    assert first.stats.steps > 0 and first.status == "training"
