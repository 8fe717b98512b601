"""One learner trained through a real cluster (Redis, broker, shard: tests/conftest.py
``make_cluster``), then its copies compared with the shard's global model."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from common.config import AlgoConfig, RunConfig
from common.fragments import gather
from tests.conftest import wait_until

STEPS = 200


def recorded_run(*, carry: bool) -> RunConfig:
    """P=4, H=4, one learner merges; the shard keeps its recent versions (the learner's copy may
    be a broadcast behind the shard's latest). ``carry=False``: a merged value overwrites the
    learner's (its model then equals the shard's value once every step is merged)."""
    algo = AlgoConfig(fragments=4, sync_every_steps=4, quorum=1, inner_warmup_steps=1, history_versions=64)
    return RunConfig(algo=dataclasses.replace(algo, carry_local_steps=carry))


def train_to_the_end(cluster: Any, learner: Any, timeout_s: float = 60.0) -> None:
    thread = cluster.start_learner(learner)
    wait_until(lambda: not thread.is_alive() or cluster.errors, timeout_s, what=f"{learner.id} to finish")
    assert not cluster.errors, cluster.errors
    assert not thread.is_alive()


def assert_bit_identical_to_the_shard(cluster: Any, learner: Any, *, model_too: bool) -> None:
    """Every fragment's merged value the learner holds is the shard's value of that version, bit
    for bit; ``model_too``: so is the learner's model (all its steps merged, overwrite mode)."""
    shard = cluster.shards[0]
    assert sorted(shard.frags) == list(range(len(learner.plan)))
    for p, f in shard.frags.items():
        v = int(learner.base_version[p])
        assert v >= 2 and v in f.history, (p, v, sorted(f.history))
        base = learner.base_values[p]
        assert base.device.type == "cpu" and torch.equal(base, f.history[v]), (p, v)
        if model_too:
            mine = gather(learner.tensors, learner.plan[p])       # from the device: synchronizes
            assert torch.equal(mine, f.history[v]), (p, v, float((mine - f.history[v]).abs().max()))
