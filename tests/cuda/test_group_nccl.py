"""A learner that is a ``torch.distributed`` group (learner/group.py) on NCCL with the one GPU
there is: world size 1 (torchrun forms no group for one process, so the test gives the learner
its ``Group(0, 1, 0)`` itself, in the environment torchrun would set). On the CPU the same test
runs the group on gloo. The group trains through a real cluster; its merged copies, and its
model once every step is merged, are bit-identical to the shard's."""
from __future__ import annotations

import pytest
import torch

from common.redis_server import free_port
from tests.cuda.cluster_runs import STEPS, assert_bit_identical_to_the_shard, recorded_run, train_to_the_end
from tests.cuda.devices import DEVICES

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]


@pytest.fixture
def one_rank_env(monkeypatch):
    """The environment of rank 0 of a 1-process torchrun job; no process group left behind."""
    import torch.distributed as dist
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["ddp", "fsdp", "auto"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_one_rank_group_learner_trains_on_its_backend_and_stays_bit_identical(make_cluster, one_rank_env,
                                                                                device, sharding):
    from learner.core import Learner
    from learner.group import Group
    cluster = make_cluster(recorded_run(carry=False))
    cluster.start_shard(0, 1)
    base = cluster.learner("grp", 0, max_steps=STEPS, step_time_floor_ms=5, device=device, group_sharding=sharding)
    assert base.group is None                       # WORLD_SIZE=1: no group of its own

    class OneRankGroup(Learner):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.group = Group(0, 1, 0)
    learner = OneRankGroup(endpoints=base.endpoints, options=base.options, task=base.task, run=base._run_arg,
                           stop=base.stop)
    train_to_the_end(cluster, learner)

    g = learner.group
    assert g.backend == ("nccl" if device == "cuda" else "gloo")
    assert learner._sharding == ("ddp" if sharding == "auto" else sharding)   # auto: the tiny model fits
    assert g.sharded is (learner._sharding == "fsdp")
    assert learner.device.type == device and learner._staging is None        # a group keeps the plain path
    if device == "cuda":
        assert learner.device == torch.device("cuda", 0)                      # cuda:LOCAL_RANK
    s = learner.stats
    assert s.steps == STEPS and s.merges_applied >= 30 and s.unflushed == 0, s
    assert g.shared >= 4 + 10       # the join's fragments and merges while training crossed the group's collectives
    assert_bit_identical_to_the_shard(cluster, learner, model_too=True)
    if not g.sharded:                                # (a sharded group's tensors are gathered to the host)
        assert all(t.device.type == device for t in learner.tensors.values())
