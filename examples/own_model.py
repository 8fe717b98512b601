"""The README's "Bring your own model" snippet, whole: a model, data read from files, a task.

    ddloco up --task examples.own_model:task --learners 3 --syncers 2

Your data lives in files (here ``DATA_DIR``, by default ``runs/own-model-data``: 8x8 images
and labels as .npy arrays, written once from a fixed seed when missing, as your own export
step would). Every process of the run reads the same files; ``hash_data`` of what it read goes
into the run config, so a learner whose files differ is refused, naming ``data_source``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddloco import Task, hash_data

CLASSES = 10
data_dir = Path(os.environ.get("DATA_DIR", "runs/own-model-data"))


def _write_example_data(directory: Path, n: int = 4096) -> None:
    """Stand-in for your data export: 8x8 images of CLASSES noisy patterns (seeded)."""
    rng = np.random.default_rng(0)
    patterns = rng.random((CLASSES, 8, 8), dtype=np.float32)
    labels = rng.integers(0, CLASSES, size=n)
    images = patterns[labels] + 0.6 * rng.standard_normal((n, 8, 8), dtype=np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    for name, array in (("images", images[:, None].astype(np.float32)), ("labels", labels.astype(np.int64))):
        tmp = directory / f".{name}.{os.getpid()}.npy"
        np.save(tmp, array)
        tmp.replace(directory / f"{name}.npy")   # atomic: a concurrent reader sees all or nothing


if not (data_dir / "labels.npy").exists():
    _write_example_data(data_dir)
images = np.load(data_dir / "images.npy")   # (N, 1, 8, 8) float32
labels = np.load(data_dir / "labels.npy")   # (N,) int64
HELDOUT = 512                               # the last 512 examples: never trained on


class Batch(NamedTuple):
    x: torch.Tensor   # (B, 1, 8, 8)
    y: torch.Tensor   # (B,)


class Net(nn.Module):
    """Conv-BatchNorm features; the class scores are dot products with a class embedding (tied head)."""

    def __init__(self, width: int = 16, dim: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.Flatten(), nn.Linear(width * 64, dim))
        self.class_emb = nn.Embedding(CLASSES, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x) @ self.class_emb.weight.T   # (B, CLASSES)


def my_batches(stream: int, seed: int, start: int, batch_size: int) -> Iterator[Batch]:
    """Batch k of stream ``stream``: the same for the same (seed, stream, k), so a restarted learner resumes."""
    train = len(labels) - HELDOUT
    k = start
    while True:
        idx = np.random.default_rng([seed, stream, k]).integers(0, train, size=batch_size)
        yield Batch(torch.from_numpy(images[idx]), torch.from_numpy(labels[idx]))
        k += 1


def my_heldout_batches() -> Iterator[Batch]:
    yield Batch(torch.from_numpy(images[-HELDOUT:]), torch.from_numpy(labels[-HELDOUT:]))


# ---------------------------------------------------------------- the README's snippet, from here
def task(batch_size: int = 32) -> Task:            # called with the --task-arg values
    return Task(
        name="my-cnn",                             # the run refuses a process whose name or config differ
        model=Net,                                 # builds the nn.Module (torch's RNG is seeded by the run)
        batches=lambda stream, seed, start: my_batches(stream, seed, start, batch_size),
        loss=lambda model, batch: F.cross_entropy(model(batch.x), batch.y),
        eval_batches=my_heldout_batches,           # the global model's eval loss: their mean loss, eval() mode
        embedding_names=("class_emb.weight",),     # merged by weighted average instead of RDA
        config={"batch_size": batch_size},         # your settings: hashed into the run config
        data_digest=hash_data(images, labels),     # the data itself: a process with other data is refused
        data_source=f"{data_dir} (my dataset v3)",  # named in that refusal
    )
