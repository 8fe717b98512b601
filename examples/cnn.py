"""Bring your own model: a small CNN on synthetic images, as a ddloco task.

    ddloco up --task examples.cnn:task --task-arg noise=0.8   # noisier images: a harder problem

This file is all a user writes. Read it top to bottom: the data (made up here, so nothing is
downloaded), the model, then ``task()``, which wraps both in a ``ddloco.Task``. Every process
of a run imports this module and calls ``task(**task_args)``, so everything the function
builds must come out the same on every machine: we seed all randomness explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddloco import Task

CLASSES = 10
SIZE = 12  # images are SIZE x SIZE, one channel
BLOBS = 3  # bright spots per class pattern


# ---------------------------------------------------------------------------- 1. the data
# Each class is a fixed "glyph": a few bright blobs at random places, drawn once from
# ``data_seed``. An example of class c is glyph c moved by up to one pixel, with a random
# contrast and Gaussian pixel noise on top. The data is unlimited: a training batch is made
# on the fly from its own random generator.

def make_glyphs(data_seed: int) -> np.ndarray:
    """One (SIZE, SIZE) pattern per class, values in [0, 1]: (CLASSES, SIZE, SIZE)."""
    rng = np.random.default_rng(data_seed)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    glyphs = np.zeros((CLASSES, SIZE, SIZE), dtype=np.float32)
    for glyph in glyphs:
        for y, x in rng.uniform(2, SIZE - 2, size=(BLOBS, 2)):
            glyph += np.exp(-((yy - y) ** 2 + (xx - x) ** 2) / 3.0)
    return np.clip(glyphs, 0.0, 1.0)


@dataclass(frozen=True)
class Batch:
    """One batch (a dataclass, tuple or dict of tensors: ddloco moves its tensors to the device)."""

    images: torch.Tensor  # (B, 1, SIZE, SIZE) float32
    labels: torch.Tensor  # (B,) int64
    tokens: int  # what ddloco counts to weight learners' contributions: here, the images


def make_batch(glyphs: np.ndarray, rng: np.random.Generator, n: int, noise: float) -> Batch:
    """``n`` labelled examples drawn with ``rng``."""
    labels = rng.integers(0, CLASSES, size=n)
    images = np.empty((n, 1, SIZE, SIZE), dtype=np.float32)
    for i, label in enumerate(labels):
        dy, dx = rng.integers(-1, 2, size=2)  # shift by -1, 0 or +1 pixels
        contrast = rng.uniform(0.6, 1.4)
        images[i, 0] = contrast * np.roll(glyphs[label], (dy, dx), axis=(0, 1))
    images += noise * rng.standard_normal(images.shape, dtype=np.float32)
    return Batch(images=torch.from_numpy(images), labels=torch.from_numpy(labels), tokens=n)


# ---------------------------------------------------------------------------- 2. the model
# Two conv-BatchNorm-ReLU stages, then a linear map to a ``dim``-dimensional feature. The class
# scores are the dot products of that feature with a learned embedding of each class: the
# output head *is* ``class_emb.weight`` (tied, like a language model's head and its token
# embedding). BatchNorm's running mean and variance are buffers: ddloco syncs them too (a
# token-weighted average); ``Task(recalibrate_bn_batches=N)`` would re-estimate them for the final
# model instead (here the final loss moved by -0.036 to +0.012, better in 8 of 15 runs: README).

class Net(nn.Module):
    def __init__(self, width: int = 16, dim: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),  # 12x12 -> 6x6
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),  # 6x6 -> 3x3
            nn.Flatten(),
            nn.Linear(2 * width * (SIZE // 4) ** 2, dim),
        )
        self.class_emb = nn.Embedding(CLASSES, dim)
        nn.init.normal_(self.class_emb.weight, std=dim ** -0.5)
        self.class_bias = nn.Parameter(torch.zeros(CLASSES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores (B, CLASSES) for images (B, 1, SIZE, SIZE)."""
        return F.linear(self.features(images), self.class_emb.weight, self.class_bias)


def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The training objective, a scalar: mean cross-entropy."""
    return F.cross_entropy(model(batch.images), batch.labels)


# ---------------------------------------------------------------------------- 3. the task
# ``ddloco up --task examples.cnn:task --task-arg KEY=VALUE ...`` calls this function with the
# task args as keyword arguments. Keep every setting in ``config``: processes whose name or
# config differ are refused, so a learner started with other settings cannot join the run.

def task(*, batch_size: int = 32, noise: float = 0.5, width: int = 16, dim: int = 32, data_seed: int = 0,
         eval_examples: int = 512) -> Task:
    """The task: ``Net`` on glyph images; the task args are this function's keyword arguments."""
    if batch_size < 1 or eval_examples < 1 or noise < 0:
        raise ValueError("batch_size and eval_examples must be >= 1, noise >= 0")
    glyphs = make_glyphs(data_seed)
    # A fixed held-out set (one batch), made from its own generator: never a training batch.
    heldout = [make_batch(glyphs, np.random.default_rng([data_seed, 2**31 - 1]), eval_examples, noise)]

    def model() -> nn.Module:
        # ddloco seeds torch's global RNG with the run seed before calling this.
        return Net(width, dim)

    def batches(stream: int, seed: int, start: int) -> Iterator[Batch]:
        # Batch k of a stream depends only on (seed, stream, k): a learner restarted at
        # step k gets exactly the batches it would have seen, and streams differ.
        k = start
        while True:
            yield make_batch(glyphs, np.random.default_rng([seed, stream, k]), batch_size, noise)
            k += 1

    return Task(
        name="cnn-example",
        model=model,
        batches=batches,
        loss=loss,
        eval_batches=lambda: iter(heldout),
        embedding_names=("class_emb.weight",),  # tied head: merged by token-weighted average
        config=dict(batch_size=batch_size, noise=noise, width=width, dim=dim, data_seed=data_seed,
                    eval_examples=eval_examples),
    )
