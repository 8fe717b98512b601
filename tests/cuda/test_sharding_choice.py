"""``--group-sharding auto`` (learner/group.py ``resolve_sharding``): FSDP only on a CUDA device
whose memory the training state (16 B per parameter) would fill past ``FSDP_AUTO_FRACTION``;
DDP on a CPU, whatever the size."""
from __future__ import annotations

import types

import pytest
import torch

from learner import group as group_module
from learner.group import FSDP_AUTO_FRACTION, fsdp_available, resolve_sharding
from tests.cuda.devices import needs_cuda

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(60)]


def _rule_cases(total: int) -> list[tuple[int, str]]:
    """(parameters, expected choice) around the threshold of a device of ``total`` bytes."""
    edge = int(FSDP_AUTO_FRACTION * total / 16)          # 16 * edge <= 0.7 * total: still replicated
    return [(1_000, "ddp"), (edge, "ddp"), (edge + 1, "fsdp"), (4 * edge, "fsdp")]


def test_a_cpu_learner_group_replicates_whatever_its_size():
    for n in (1, 10**9, 10**12):
        assert resolve_sharding("auto", torch.device("cpu"), n) == "ddp"
    assert resolve_sharding("fsdp", torch.device("cpu"), 1) == "fsdp"     # asked for: given
    assert resolve_sharding("ddp", torch.device("cuda", 0), 10**12) == "ddp"
    with pytest.raises(ValueError, match="group sharding must be one of"):
        resolve_sharding("zero3", torch.device("cpu"), 1)


def test_the_auto_rule_on_a_gpu_of_a_given_memory(monkeypatch):
    """The rule's arithmetic, with the device's memory given (runs without a GPU)."""
    if not fsdp_available():
        pytest.skip("this torch has no FSDP2")
    total = 80 * 2**30
    seen = []

    def props(device):
        seen.append(device)
        return types.SimpleNamespace(total_memory=total)
    monkeypatch.setattr(group_module.torch.cuda, "get_device_properties", props)
    for n, expected in _rule_cases(total):
        assert resolve_sharding("auto", torch.device("cuda", 0), n) == expected, n
    assert seen and all(d == torch.device("cuda", 0) for d in seen)


@needs_cuda
def test_the_auto_rule_on_this_gpu_and_the_choice_of_a_one_gpu_nccl_group():
    """On the real GPU: its memory sets the threshold; a 1-GPU group (rank 0 on cuda:0, as
    ``_resolve_device`` makes it) with the tiny test model, or a 1e9-parameter one on an
    H100/H200 (16 GB of training state), replicates; 10x the memory's worth shards."""
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(dev).total_memory
    for n, expected in _rule_cases(total):
        assert resolve_sharding("auto", dev, n) == expected, (n, total)
    tiny = sum(p.numel() for p in torch.nn.Linear(8, 16).parameters())
    assert resolve_sharding("auto", dev, tiny) == "ddp"
    if total > 40 * 2**30:
        assert resolve_sharding("auto", dev, 10**9) == "ddp"
    assert resolve_sharding("auto", torch.device("cuda"), 10 * total // 16) == "fsdp"   # no index: the current GPU
