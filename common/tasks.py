"""Built-in training tasks: a byte-level GPT on the Python standard library's own sources.

The corpus is real text available offline on every machine that runs Python: the ``.py`` files
of the standard library (``sysconfig.get_paths()["stdlib"]``), read in sorted relative-path
order until ``cfg.corpus_max_bytes``. Files are split into train and held-out sets by a seeded
hash of their relative path, so the split is identical on every process of a run and no byte of
a held-out file is ever trained on. Nothing is cached on disk; loading takes well under a second
(read bytes, ``np.frombuffer``, concatenate with a separator byte) and is memoised per process.

The model is nanoGPT-shaped (pre-LayerNorm blocks, causal self-attention, GELU MLP, tied head)
with *separate* q/k/v/proj projections so that its parameter list is many similar-sized
tensors: balanced tensor fragmentation (ALGORITHM.md §2) then splits it into P = 24 fragments
with a peak/mean ratio of about 1.24 at the default config.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # config imports the codec registry; keep this module light to import
    from common.config import TaskConfig

VOCAB_SIZE = 256
"""Byte-level vocabulary."""
SEPARATOR_BYTE = 0
"""Byte placed between two files of the corpus (never occurs in Python sources)."""
INIT_STD = 0.02
"""Standard deviation of the normal initialisation of linear and embedding weights."""
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                          "__pycache__", "encodings", "pydoc_data"})
"""Directories of the standard library left out: third-party code, tests, codec tables, docs."""


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """The stdlib corpus split by file: byte arrays with a separator byte between files."""

    root: str
    train: np.ndarray
    heldout: np.ndarray
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]


def stdlib_root() -> str:
    """Directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def list_source_files(root: str) -> list[str]:
    """Relative POSIX paths of the ``.py`` files under ``root``, sorted, skipping SKIPPED_DIRS."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                found.append(rel.replace(os.sep, "/"))
    found.sort()
    return found


def is_heldout(rel_path: str, *, seed: int, heldout_fraction: float) -> bool:
    """Seeded, platform-independent decision whether a file belongs to the held-out split."""
    digest = hashlib.blake2b(f"{seed}:{rel_path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < heldout_fraction


def _join(chunks: list[np.ndarray]) -> np.ndarray:
    """Concatenate files, each followed by SEPARATOR_BYTE."""
    sep = np.array([SEPARATOR_BYTE], dtype=np.uint8)
    parts: list[np.ndarray] = []
    for chunk in chunks:
        parts.extend((chunk, sep))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


@functools.lru_cache(maxsize=4)
def _load_corpus(root: str, seed: int, heldout_fraction: float, max_bytes: int) -> Corpus:
    train: list[np.ndarray] = []
    heldout: list[np.ndarray] = []
    train_files: list[str] = []
    heldout_files: list[str] = []
    total = 0
    for rel in list_source_files(root):
        try:
            with open(os.path.join(root, rel), "rb") as fh:
                data = fh.read()
        except OSError:
            continue  # unreadable file: skipped identically on every process of this machine
        if total + len(data) > max_bytes:
            break
        total += len(data)
        arr = np.frombuffer(data, dtype=np.uint8)
        if is_heldout(rel, seed=seed, heldout_fraction=heldout_fraction):
            heldout.append(arr)
            heldout_files.append(rel)
        else:
            train.append(arr)
            train_files.append(rel)
    return Corpus(root=root, train=_join(train), heldout=_join(heldout),
                  train_files=tuple(train_files), heldout_files=tuple(heldout_files))


def load_corpus(cfg: TaskConfig, root: str | None = None) -> Corpus:
    """Read (once per process) the stdlib corpus for ``cfg``; ``root`` overrides the stdlib dir.

    Raises ValueError when either split is too small to cut a single training window.
    """
    corpus = _load_corpus(root or stdlib_root(), cfg.seed, cfg.heldout_fraction,
                          cfg.corpus_max_bytes)
    need = cfg.seq_len + 2
    if len(corpus.train) < need or len(corpus.heldout) < need:
        raise ValueError(
            f"corpus under {corpus.root} too small for seq_len={cfg.seq_len}: "
            f"{len(corpus.train)} train / {len(corpus.heldout)} held-out bytes "
            f"(raise task.corpus_max_bytes, now {cfg.corpus_max_bytes})")
    return corpus


def corpus_summary(cfg: TaskConfig) -> dict[str, Any]:
    """Sizes of the corpus splits, for logs and reports."""
    corpus = load_corpus(cfg)
    return {
        "root": corpus.root,
        "files_train": len(corpus.train_files),
        "files_heldout": len(corpus.heldout_files),
        "bytes_train": int(len(corpus.train)),
        "bytes_heldout": int(len(corpus.heldout)),
    }


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v and output projections."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q = nn.Linear(n_embd, n_embd, bias=False)
        self.k = nn.Linear(n_embd, n_embd, bias=False)
        self.v = nn.Linear(n_embd, n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # batch, time, channels
        hs = c // self.n_head
        q = self.q(x).view(b, t, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(b, t, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v(x).view(b, t, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, GELU."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT; the output head is tied to the token embedding (no separate parameter)."""

    def __init__(self, *, seq_len: int, n_layer: int, n_head: int, n_embd: int,
                 vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for byte ids ``idx`` (B, T)."""
        _, t = idx.shape
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds the context of {self.seq_len}")
        pos = torch.arange(t, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)  # (B, T, C)
        return F.linear(x, self.wte.weight)  # (B, T, vocab): tied head

    def initialise(self, generator: torch.Generator) -> None:
        """normal(0, INIT_STD) weights, zero biases, unit LayerNorm gains, drawn from ``generator``."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.normal_(0.0, INIT_STD, generator=generator)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
                elif isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Batch:
    """One batch: ``tokens`` is the number of target tokens (what the merge weights count)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    tokens: int


class Task:
    """What a learner trains: a model factory, a loss, a training stream and an evaluation."""

    name: str = ""

    def build_model(self) -> nn.Module:
        """A freshly initialised model, bit-identical on every process for the same config."""
        raise NotImplementedError

    def embedding_names(self, model: nn.Module) -> set[str]:
        """Names (as in ``named_parameters``) of the embedding tensors, merged by averaging."""
        return {f"{mod_name}.{p_name}" if mod_name else p_name
                for mod_name, module in model.named_modules()
                if isinstance(module, nn.Embedding)
                for p_name, _ in module.named_parameters(recurse=False)}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean loss of ``model`` on ``batch`` (differentiable)."""
        raise NotImplementedError

    def train_batches(self, *, stream: int, seed: int, start_step: int = 0) -> Iterator[Batch]:
        """Infinite, deterministic sequence of training batches for (``stream``, ``seed``),
        starting at batch ``start_step`` (a restarted learner resumes its data position)."""
        raise NotImplementedError

    def eval_loss(self, model: nn.Module) -> float:
        """Mean loss over a fixed held-out set (same batches on every call)."""
        raise NotImplementedError


def _windows(data: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int) -> Batch:
    """``batch_size`` random windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""
    starts = rng.integers(0, len(data) - seq_len, size=batch_size)  # (B,)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (B, T+1)
    window = torch.from_numpy(data[idx].astype(np.int64))  # (B, T+1)
    return Batch(inputs=window[:, :-1], targets=window[:, 1:], tokens=batch_size * seq_len)


_EVAL_STREAM = 2**31 - 1
"""Seed-sequence entry that keeps the held-out batches apart from every training stream."""


class GPTTask(Task):
    """Byte-level language modelling of the Python standard library's sources."""

    name = "gpt"

    def __init__(self, cfg: TaskConfig, *, corpus_root: str | None = None) -> None:
        self.cfg = cfg
        self.corpus = load_corpus(cfg, corpus_root)
        rng = np.random.default_rng([cfg.seed, _EVAL_STREAM])
        self._eval_set = [_windows(self.corpus.heldout, rng, cfg.batch_size, cfg.seq_len)
                          for _ in range(cfg.eval_batches)]

    def build_model(self) -> nn.Module:
        cfg = self.cfg
        # The modules' default initialisation draws from the global RNG: put its state back so
        # building a model never shifts anyone else's random stream. (A "meta" device build
        # would avoid the draws but costs ~1 s on first use.)
        global_rng = torch.get_rng_state()
        try:
            model = GPT(seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                        n_embd=cfg.n_embd)
        finally:
            torch.set_rng_state(global_rng)
        model.initialise(torch.Generator().manual_seed(cfg.seed))
        return model

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch.inputs)  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)),  # (B*T, vocab)
                               batch.targets.reshape(-1))  # (B*T,)

    def train_batches(self, *, stream: int, seed: int, start_step: int = 0) -> Iterator[Batch]:
        if stream < 0 or stream >= _EVAL_STREAM:
            raise ValueError(f"stream must be in [0, {_EVAL_STREAM}), got {stream}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        step = start_step
        while True:  # batch k depends on (seed, stream, k) only: resuming at any k is exact
            rng = np.random.default_rng([seed, stream, step])
            yield _windows(self.corpus.train, rng, self.cfg.batch_size, self.cfg.seq_len)
            step += 1

    def eval_loss(self, model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        try:
            device = next(model.parameters()).device   # held-out batches live on the CPU
            with torch.no_grad():
                total = sum(float(self.loss(model, b if device.type == "cpu" else Batch(
                    inputs=b.inputs.to(device), targets=b.targets.to(device), tokens=b.tokens)))
                    for b in self._eval_set)
        finally:
            model.train(was_training)
        return total / len(self._eval_set)


def make_task(cfg: TaskConfig) -> Task:
    """The built-in task named by ``cfg.name``."""
    if cfg.name == "gpt":
        return GPTTask(cfg)
    raise ValueError(f"unknown task {cfg.name!r}; built-in tasks: gpt")


def initial_loss_estimate() -> float:
    """Loss of a uniform predictor over bytes, ln 256 (what an untrained model scores)."""
    return math.log(VOCAB_SIZE)
