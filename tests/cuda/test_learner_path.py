"""The learner's CUDA path end to end (issue 33): one learner on ``device`` (on a GPU: host
staging of answers and merges on side streams) trained through a real Redis, broker and shard;
after 200 steps and dozens of merges its merged copies, and in overwrite mode its model, are
bit-identical to the shard's global model."""
from __future__ import annotations

import pytest

from tests.cuda.cluster_runs import STEPS, assert_bit_identical_to_the_shard, recorded_run, train_to_the_end
from tests.cuda.devices import DEVICES

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]


@pytest.mark.parametrize("carry", [False, True], ids=["overwrite", "carry"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_learner_on_its_device_stays_bit_identical_to_the_shard_after_many_merges(make_cluster, device, carry):
    from learner.staging import HostStaging
    cluster = make_cluster(recorded_run(carry=carry))
    cluster.start_shard(0, 1)
    learner = cluster.learner("dev", 0, max_steps=STEPS, step_time_floor_ms=5, device=device)
    train_to_the_end(cluster, learner)

    s = learner.stats
    assert s.steps == STEPS and s.answers >= 30 and s.merges_applied >= 30, s
    assert s.unflushed == 0 and s.flushed >= 1, s        # every step it took reached the global model
    assert learner.device.type == device
    assert all(t.device.type == device for t in learner.tensors.values())
    assert isinstance(learner._staging, HostStaging) if device == "cuda" else learner._staging is None
    assert learner.algo.carry_local_steps is carry
    assert_bit_identical_to_the_shard(cluster, learner, model_too=not carry)
