"""Learner device placement helpers (the GPU path itself is exercised on a GPU machine)."""
from __future__ import annotations

import pytest
import torch

from common.config import ConfigError
from tasks.gpt import Batch
from learner.core import resolve_device
from tasks.contract import batch_to


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
