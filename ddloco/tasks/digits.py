"""Built-in vision task ``digits``: a small CNN with BatchNorm on scikit-learn's 8x8 digits.

The data is scikit-learn's bundled copy of the UCI handwritten digits (1797 grey 8x8 images,
pixel values 0..16, ten classes): it ships inside the wheel, so nothing is downloaded. The
images are split into train and held-out sets by a permutation seeded with ``split_seed``
(a task arg, independent of the run seed), so the split is identical on every process of a
run and no held-out image is ever trained on. Pixels are scaled to [0, 1].

Training batch k of data stream ``stream`` under run seed ``seed`` is ``batch_size`` train
images drawn with ``np.random.default_rng([seed, stream, k])``: it depends on those three
values only, so a restarted learner resumes exactly. The held-out set is the whole held-out
split in fixed batches. scikit-learn is imported on first use (loading is memoised per process).
The split tensors are hashed once (``Task.data_digest``): a learner whose scikit-learn ships other
data, or whose NumPy permutes differently, is refused by the run.

The model, ``DigitsCNN``, is conv-BN-ReLU, conv-BN-ReLU, 2x2 max-pool, linear: its BatchNorm
running statistics are buffers, the case a task with only LayerNorm (``gpt``) never exercises.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.task import Task, TaskError, hash_data, indexed_batches

N_CLASSES = 10
"""Digits 0..9."""
IMAGE_SIZE = 8
"""Images are IMAGE_SIZE x IMAGE_SIZE, one channel."""
PIXEL_MAX = 16.0
"""Largest pixel value in the raw data (pixels are divided by it)."""


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DigitsSplit:
    """The digits data split into train and held-out sets: images (N, 1, 8, 8) float32 in
    [0, 1], labels (N,) int64."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    heldout_images: torch.Tensor
    heldout_labels: torch.Tensor
    digest: str = ""
    """``hash_data`` of the four tensors (the task's ``data_digest``: covers the data and the split)."""
    source: str = ""
    """Where the images came from (the task's ``data_source``)."""


@functools.lru_cache(maxsize=4)
def load_split(eval_fraction: float = 0.2, split_seed: int = 0) -> DigitsSplit:
    """scikit-learn's digits (read once per process), split by a permutation seeded with
    ``split_seed``: the first ``round(N * eval_fraction)`` permuted images are held out."""
    if not 0.0 < eval_fraction < 1.0:
        raise TaskError(f"task arg eval_fraction must be in (0, 1), got {eval_fraction!r}")
    try:
        import sklearn
        from sklearn.datasets import load_digits
    except ImportError:
        raise TaskError("task digits needs scikit-learn (pip install scikit-learn)") from None
    data = load_digits()
    images = torch.from_numpy(np.asarray(data.images, dtype=np.float32) / PIXEL_MAX)  # (N, 8, 8)
    images = images.unsqueeze(1).contiguous()  # (N, 1, 8, 8)
    labels = torch.from_numpy(np.asarray(data.target, dtype=np.int64))  # (N,)
    n = len(labels)
    n_heldout = int(round(n * eval_fraction))
    if not 0 < n_heldout < n:
        raise TaskError(f"task arg eval_fraction={eval_fraction} leaves an empty split of {n} images")
    order = torch.from_numpy(np.random.default_rng(split_seed).permutation(n))
    held, train = order[:n_heldout], order[n_heldout:]
    parts = dict(train_images=images[train], train_labels=labels[train], heldout_images=images[held],
                 heldout_labels=labels[held])
    return DigitsSplit(**parts, digest=hash_data(*parts.values()),
                       source=f"scikit-learn {sklearn.__version__}'s bundled digits ({n} images)")


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

class DigitsCNN(nn.Module):
    """Conv(1->w)-BN-ReLU, Conv(w->2w)-BN-ReLU, 2x2 max-pool, Linear(2w*4*4 -> 10)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.head = nn.Linear(2 * width * (IMAGE_SIZE // 2) ** 2, N_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (B, 10) for images (B, 1, 8, 8)."""
        x = F.relu(self.bn1(self.conv1(images)))  # (B, w, 8, 8)
        x = F.relu(self.bn2(self.conv2(x)))  # (B, 2w, 8, 8)
        x = F.max_pool2d(x, 2)  # (B, 2w, 4, 4)
        return self.head(x.flatten(1))  # (B, 10)


# --------------------------------------------------------------------------------------------
# Task
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Batch:
    """One batch of images and their labels; ``tokens`` is the number of images."""

    images: torch.Tensor
    labels: torch.Tensor
    tokens: int


def classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of the model's logits against the labels."""
    return F.cross_entropy(model(batch.images), batch.labels)


def _check_positive(**values: int) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TaskError(f"task arg {k} must be an int >= 1, got {v!r}")


def digits(*, batch_size: int = 32, width: int = 16, eval_fraction: float = 0.2, split_seed: int = 0,
           eval_batch_size: int = 512) -> Task:
    """Built-in ``digits``: ``DigitsCNN`` (``width`` channels) on scikit-learn's 8x8 digits."""
    _check_positive(batch_size=batch_size, width=width, eval_batch_size=eval_batch_size)
    if isinstance(split_seed, bool) or not isinstance(split_seed, int) or split_seed < 0:
        raise TaskError(f"task arg split_seed must be an int >= 0, got {split_seed!r}")
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)):
        raise TaskError(f"task arg eval_fraction must be a number in (0, 1), got {eval_fraction!r}")
    split = load_split(float(eval_fraction), split_seed)
    n_train, n_heldout = len(split.train_labels), len(split.heldout_labels)
    eval_set = [Batch(images=split.heldout_images[i:i + eval_batch_size],
                      labels=split.heldout_labels[i:i + eval_batch_size],
                      tokens=len(split.heldout_labels[i:i + eval_batch_size]))
                for i in range(0, n_heldout, eval_batch_size)]

    def model() -> DigitsCNN:
        return DigitsCNN(width)  # torch's default init, from the global RNG the run has seeded

    def draw(rng: np.random.Generator) -> Batch:
        idx = torch.from_numpy(rng.choice(n_train, size=batch_size, replace=batch_size > n_train))
        return Batch(images=split.train_images[idx], labels=split.train_labels[idx], tokens=batch_size)

    batches = indexed_batches(draw)   # batch k depends on (seed, stream, k) only: resuming is exact

    config = dict(batch_size=batch_size, width=width, eval_fraction=float(eval_fraction), split_seed=split_seed,
                  eval_batch_size=eval_batch_size, images=[n_train, n_heldout])
    return Task(name="digits", model=model, batches=batches, loss=classification_loss,
                eval_batches=lambda: iter(eval_set), config=config, data_digest=split.digest,
                data_source=split.source)


def heldout_accuracy(model: nn.Module, *, eval_fraction: float = 0.2, split_seed: int = 0) -> float:
    """Fraction of the held-out digits (the split of ``digits(eval_fraction=..., split_seed=...)``)
    that ``model`` classifies correctly, in ``eval()`` mode without gradients (mode restored)."""
    split = load_split(float(eval_fraction), split_seed)
    device = next(iter(model.parameters()), torch.empty(0)).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(split.heldout_images.to(device))  # (N, 10)
    finally:
        model.train(was_training)
    return float((logits.argmax(dim=1).cpu() == split.heldout_labels).float().mean())
