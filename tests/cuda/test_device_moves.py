"""Device moves: batches to the learner's device (``batch_to``), a model's buffers in its
fragments (gathered on the device, scattered back exactly), a prepared learner's state on its
device."""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from common.fragments import gather, model_plan, scatter, state_tensors
from common.task import batch_to
from ddloco.tasks.gpt import Batch
from tests.cuda.devices import DEVICES
from tests.cuda.models import NormNet, prepared_learner

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(60)]

Pair = namedtuple("Pair", "left right")


@dataclass
class Nested:
    batch: Batch
    extra: dict
    seq: list
    pair: Pair
    note: str


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, k))


@pytest.mark.parametrize("device", DEVICES)
def test_batch_to_moves_every_tensor_of_a_nested_batch_and_back(device):
    dev = torch.device(device)
    g = torch.Generator().manual_seed(1)
    b = Nested(batch=Batch(inputs=torch.randint(0, 9, (2, 5), generator=g), targets=torch.randn(2, 5, generator=g),
                           tokens=10),
               extra={"mask": torch.ones(2, 5, dtype=torch.bool),
                      "ids": [torch.arange(3), (torch.randn(4, generator=g),)]},
               seq=[torch.randn(3, generator=g), 7], pair=Pair(torch.randn(2, generator=g), "x"), note="kept")
    moved = batch_to(b, dev)
    here, there = list(_tensors(b)), list(_tensors(moved))
    assert len(here) == len(there) == 7
    for a, t in zip(here, there):
        assert t.device.type == device and t.dtype == a.dtype and torch.equal(t.cpu(), a)
    assert moved.batch.tokens == 10 and moved.note == "kept" and moved.seq[1] == 7 and moved.pair.right == "x"
    assert isinstance(moved.pair, Pair) and isinstance(moved.extra["ids"][1], tuple)
    back = batch_to(moved, torch.device("cpu"))          # a batch on the GPU comes back too
    if device == "cuda":   # (non_blocking: a device-to-host copy lands in pinned memory, asynchronously)
        torch.cuda.synchronize()
    for a, t in zip(here, _tensors(back)):
        assert t.device.type == "cpu" and torch.equal(t, a)
    if device == "cpu":    # the CPU case is the identity: prove the structure walk on the meta device
        meta = batch_to(b, torch.device("meta"))
        assert [t.device.type for t in _tensors(meta)] == ["meta"] * 7
        assert [(t.dtype, t.shape) for t in _tensors(meta)] == [(t.dtype, t.shape) for t in here]
        assert meta.batch.tokens == 10 and meta.note == "kept" and meta.seq[1] == 7 and meta.pair.right == "x"
        assert isinstance(meta.pair, Pair) and isinstance(meta.extra["ids"][1], tuple)


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_are_in_the_fragments_gathered_on_the_device_and_scattered_back_exactly(device):
    dev = torch.device(device)
    torch.manual_seed(0)
    model = NormNet().to(dev).train()
    for _ in range(3):                       # running stats and num_batches_tracked move
        model(torch.randn(16, 8, device=dev))
    tensors = state_tensors(model)
    plan = model_plan(model, (), 3)
    kinds = {q.name: q.kind for f in plan for q in f.pieces}
    assert kinds["norm.running_mean"] == kinds["norm.running_var"] == "buffer"
    assert kinds["norm.num_batches_tracked"] == "int_buffer" and int(tensors["norm.num_batches_tracked"]) == 3
    flats = [gather(tensors, f, device=dev) for f in plan]
    assert all(v.device.type == device and v.dtype == torch.float32 for v in flats)

    host = NormNet()                          # another model on the CPU takes them exactly
    for f, v in zip(plan, flats):
        scatter(state_tensors(host), f, v)
    for name, t in state_tensors(host).items():
        assert torch.equal(t, tensors[name].cpu()) and t.dtype == tensors[name].dtype, name

    fresh = NormNet()                         # and the device model takes host values exactly
    for f in plan:
        scatter(tensors, f, gather(state_tensors(fresh), f))
    for name, t in state_tensors(fresh).items():
        assert tensors[name].device.type == device and torch.equal(tensors[name].cpu(), t), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_prepared_learner_holds_its_model_and_buffers_on_its_device(device):
    from learner.staging import HostStaging
    learner = prepared_learner(device)
    assert learner.device.type == device
    assert learner.tensors.keys() == {"fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "norm.running_mean",
                                      "norm.running_var", "norm.num_batches_tracked", "fc2.weight", "fc2.bias"}
    assert all(t.device.type == device for t in learner.tensors.values())
    assert all(t.device.type == device for t in learner.model.buffers())
    assert isinstance(learner._staging, HostStaging) if device == "cuda" else learner._staging is None
    # answers are snapshotted where the model is (on the GPU: gathered there, staged to the host)
    assert learner._local_values(0).device.type == device
