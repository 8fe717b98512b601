"""A synthetic task of any size for ``ddloco bench sync``: ``--task ddloco.bench.synthetic:task
--task-arg params=N``.

The model is a stack of square ``Linear`` layers (realistic tensor shapes: width 256 below 5 M
parameters, 1,024 below 50 M, 2,048 above; as many layers as it takes to reach N), and one
batch is a single row through it, so a step costs little more than the backward pass's weight
gradients and the AdamW update: what the sync path must keep up with is the model's size, not
its arithmetic. Each batch claims ``tokens`` tokens (the merge weights count them)."""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from common.task import Task, indexed_batches


def _width(params: int) -> int:
    return 256 if params < 5_000_000 else 1024 if params < 50_000_000 else 2048


class SyntheticNet(nn.Module):
    def __init__(self, params: int) -> None:
        super().__init__()
        width = _width(params)
        layers = max(1, math.ceil(params / (width * width + width)))
        # near-orthogonal scale (activations neither vanish nor blow up): one Gaussian matrix drawn
        # from the seeded RNG, each layer a rotation of its columns. Every process of a run builds
        # this model (learners, shards, up); drawing a billion normals on one core took ~30 s,
        # this takes one draw of width² and a copy per layer.
        first = torch.randn(width, width) / math.sqrt(width)
        # skip_init puts a layer on the CPU unless told (it ignores a ``torch.device`` context): the
        # default device is where a CUDA learner builds its model (common.task.build_model)
        where = torch.get_default_device()
        self.layers = nn.ModuleList(torch.nn.utils.skip_init(nn.Linear, width, width, device=where)
                                    for _ in range(layers))
        with torch.no_grad():
            for k, layer in enumerate(self.layers):
                layer.weight.copy_(torch.roll(first, shifts=k, dims=1))
                layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def task(params: int = 1_000_000, tokens: int = 1024) -> Task:
    """``params``: parameters of the model (rounded up to whole layers); ``tokens``: tokens a batch claims."""
    if params < 1:
        raise ValueError(f"params must be >= 1, got {params}")
    width = _width(params)

    def draw(rng: np.random.Generator) -> dict:
        x = torch.from_numpy(rng.standard_normal((1, width), dtype=np.float32))
        return {"x": x, "y": torch.tanh(x.flip(1)), "tokens": tokens}

    batches = indexed_batches(draw)

    def loss(model: nn.Module, batch: dict) -> torch.Tensor:
        return (model(batch["x"]) - batch["y"]).pow(2).mean()

    def eval_batches() -> list[dict]:
        return [draw(np.random.default_rng([2**31 - 1, k])) for k in range(2)]

    return Task(name="synthetic", model=lambda: SyntheticNet(params), batches=batches, loss=loss,
                eval_batches=eval_batches, tokens=lambda b: int(b["tokens"]),
                config={"params": params, "tokens": tokens})
