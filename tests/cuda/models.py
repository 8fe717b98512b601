"""A small model with buffers (BatchNorm running statistics) and a learner prepared on a device,
for the CUDA tests."""
from __future__ import annotations

from typing import Any, Iterator

import torch

from common.config import AlgoConfig, RunConfig
from common.options import Endpoints, LearnerOptions
from common.task import Task
from ddloco.tasks.gpt import Batch
from tests.conftest import tiny_batches, tiny_loss


class NormNet(torch.nn.Module):
    """Linear, BatchNorm (float and integer buffers), Linear: 8 -> 4, like ``TinyNet``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def norm_task() -> Task:
    def batches(stream: int, seed: int, start: int) -> Iterator[Batch]:
        it = tiny_batches(stream)
        for _ in range(start):
            next(it)
        return it
    return Task(name="norm", model=NormNet, batches=batches, loss=tiny_loss)


RUN = RunConfig(algo=AlgoConfig(fragments=4, sync_every_steps=4, quorum=1, inner_warmup_steps=1))


def prepared_learner(device: str, task: Task | None = None, **options: Any) -> Any:
    """A ``Learner`` prepared (task bound, model built on ``device``, plan, staging) the way a
    joining learner prepares before it touches Redis."""
    from learner.core import Learner
    learner = Learner(endpoints=Endpoints(run_id="cuda"), task=task or norm_task(), run=RUN,
                      options=LearnerOptions(learner_id="dev", data_shard=0, device=device, **options))
    learner._prepare(RUN)
    return learner
