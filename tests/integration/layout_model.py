"""A model whose fragments (P = 24) hold every layout a user's model can give: a tensor sliced over
several fragments, BatchNorm (running statistics and its integer ``num_batches_tracked``), an
integer buffer and a float buffer each large enough to fill fragments of their own (fragments of
buffers only), and tiny tensors (a bias, one scalar). ``--task tests.integration.layout_model:task``."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ddloco import Task

FEATURES, HIDDEN, CLASSES = 64, 256, 10


class LayoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, HIDDEN)        # 16,384 values: sliced over many fragments
        self.norm = nn.BatchNorm1d(HIDDEN)             # running stats + integer num_batches_tracked
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.temperature = nn.Parameter(torch.ones(()))   # one value
        # buffers larger than 1/P of the model: fragments of buffers only
        self.register_buffer("seen", torch.zeros(1024, dtype=torch.int64))   # examples seen, per hash slot
        self.register_buffer("input_mean", torch.zeros(1024))                # an EMA of the inputs, tiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen += x.shape[0]                 # grows by the batch size every step
                self.input_mean.mul_(0.9).add_(x.mean(0).repeat(1024 // FEATURES), alpha=0.1)
        return self.head(F.relu(self.norm(self.body(x)))) * self.temperature


def _batch(gen: torch.Generator, centers: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, CLASSES, (n,), generator=gen)
    return centers[y] + torch.randn(n, FEATURES, generator=gen), y


def task(batch_size: int = 32) -> Task:
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(7))
    heldout = [_batch(torch.Generator().manual_seed(2**31 - 1), centers, 256)]

    def batches(stream: int, seed: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        k = start
        while True:
            yield _batch(torch.Generator().manual_seed((seed * 1_000_003 + stream * 10_007 + k) % 2**62), centers, batch_size)
            k += 1

    return Task(name="layout-test", model=LayoutNet, batches=batches,
                loss=lambda model, b: F.cross_entropy(model(b[0]), b[1]),
                eval_batches=lambda: iter(heldout), config={"batch_size": batch_size})
