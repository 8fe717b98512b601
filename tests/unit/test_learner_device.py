"""Learner device placement helpers (the GPU path itself is exercised on a GPU machine)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.config import ConfigError
from ddloco.tasks.gpt import Batch
from learner.core import resolve_device
from common.task import batch_to


def test_batch_to_moves_every_tensor_field_and_keeps_the_rest():
    b = Batch(inputs=torch.zeros(2, 3, dtype=torch.long), targets=torch.ones(2, 3, dtype=torch.long), tokens=6)
    moved = batch_to(b, torch.device("meta"))
    assert moved.inputs.device.type == "meta" and moved.targets.device.type == "meta" and moved.tokens == 6
    assert batch_to(b, torch.device("cpu")) is b
    t = batch_to((torch.zeros(1), {"y": torch.ones(1)}), torch.device("meta"))
    assert t[0].device.type == "meta" and t[1]["y"].device.type == "meta"


def test_resolve_device_auto_and_errors():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


def test_host_staging_only_for_a_cuda_learner_outside_a_group():
    from learner.staging import HostStaging, staging_for
    assert staging_for(torch.device("cpu"), grouped=False) is None
    assert staging_for(torch.device("cuda", 0), grouped=True) is None    # a torchrun group: plain path
    with pytest.raises(ValueError, match="CUDA"):
        HostStaging(torch.device("cpu"))


def test_gather_builds_the_fragment_on_the_device_asked():
    from common.fragments import gather, model_plan, state_tensors
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    tensors = state_tensors(model)
    frag = model_plan(model, (), 2)[0]
    assert gather(tensors, frag, device="meta").device.type == "meta"
    assert torch.equal(gather(tensors, frag, device="cpu"), gather(tensors, frag))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_staging_round_trip_on_cuda():
    from learner.staging import HostStaging
    dev = torch.device("cuda", 0)
    staging = HostStaging(dev)
    value = torch.randn(1 << 20, device=dev)
    host, done = staging.to_host(value)
    done.synchronize()
    assert host.is_pinned() and torch.equal(host, value.cpu())
    back = staging.to_device(host * 2)
    assert torch.equal(back.cpu(), host * 2)      # the current stream waited for the copy


def test_build_model_creates_the_models_tensors_on_the_device_asked():
    """A CUDA learner builds its model on the GPU (no host copy). (A model whose init draws from a
    CPU generator, as the built-in GPT's, fails there: learner/join.py ``_build_model`` then builds
    it on the host; seen on an H200, where tests/cuda covers it.)"""
    from common.task import build_model
    from ddloco.bench.synthetic import task as synthetic
    linear = dataclasses.replace(synthetic(params=70_000), model=lambda: torch.nn.Linear(4, 3))
    m = build_model(linear, 0, device="meta")
    assert all(p.device.type == "meta" for p in m.parameters())
    cpu = build_model(synthetic(params=70_000), 0)
    assert all(p.device.type == "cpu" for p in cpu.parameters())


def test_the_synthetic_model_is_built_on_the_device_asked_and_strays_are_named():
    """``skip_init`` ignores a ``torch.device`` context: the synthetic model's layers stayed on the
    CPU inside ``torch.device("cuda")`` and the 1 B learner's first step failed on an H200 (mat1
    on cuda:0, the weights on the CPU). Now the layers go to the default device, and the learner
    moves whatever a user's model still makes elsewhere (``stray_tensors``)."""
    from common.task import build_model, stray_tensors
    from ddloco.bench.synthetic import task as synthetic
    m = build_model(synthetic(params=70_000), 0, device="meta")
    assert stray_tensors(m, "meta") == [] and all(p.device.type == "meta" for p in m.parameters())
    skipping = dataclasses.replace(synthetic(params=70_000),
                                   model=lambda: torch.nn.utils.skip_init(torch.nn.Linear, 4, 3))
    assert stray_tensors(build_model(skipping, 0, device="meta"), "meta") == ["weight", "bias"]
    assert stray_tensors(torch.nn.Linear(2, 2), torch.device("cpu")) == []
