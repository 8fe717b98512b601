"""Built-in language-model tasks: a byte-level GPT on text (``gpt``, ``text``, ``gpt-moe``).

- ``gpt``: the Python standard library's own ``.py`` sources (``sysconfig.get_paths()["stdlib"]``),
  real text available offline on every machine that runs Python, read in sorted relative-path
  order until ``corpus_max_bytes``.
- ``text``: the same model on the user's files: ``--task text --task-arg path=DIR_OR_FILE``
  (every regular file under DIR, sorted, read as bytes).
- ``gpt-moe``: ``gpt`` with a mixture-of-experts MLP (top-k routing) in every block.

Files are split into train and held-out sets by a seeded hash of their relative path, so the
split is identical on every process of a run and no byte of a held-out file is ever trained
on; a single file is split by position instead (its last ``heldout_fraction`` is held out).
Nothing is cached on disk; loading is memoised per process. The bytes loaded are hashed once
(``Task.data_digest``): a learner whose interpreter ships another standard library, or whose
files differ, is refused by the run instead of silently training on other data.

The model is nanoGPT-shaped (pre-LayerNorm blocks, causal self-attention, GELU MLP, tied head)
with *separate* q/k/v/proj projections: many similar-sized tensors for balanced fragments.
"""
from __future__ import annotations

import functools
import math
import os
import platform
import sysconfig
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.task import Task, TaskError, hash_data, indexed_batches
from ddloco.data.inputs import split_score

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
    """A corpus split by file: byte arrays with a separator byte between files."""

    root: str
    train: np.ndarray
    heldout: np.ndarray
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    digest: str = ""
    """``hash_data(train, heldout)``: the task's ``data_digest`` (computed once, at load)."""

    def describe(self, what: str) -> str:
        """Where the bytes came from: the task's ``data_source``."""
        n = len(set(self.train_files) | set(self.heldout_files))
        return f"{what} {self.root} ({n} file(s), {len(self.train) + len(self.heldout):,} bytes with separators)"


def stdlib_root() -> str:
    """Directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def list_source_files(root: str, *, suffix: str = ".py", skipped: frozenset[str] = SKIPPED_DIRS) -> list[str]:
    """Relative POSIX paths of the files under ``root`` ending in ``suffix`` ("" = every file),
    sorted, skipping directories named in ``skipped`` and hidden ones."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skipped and not d.startswith(".")]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(suffix) and not name.startswith("."):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                found.append(rel.replace(os.sep, "/"))
    found.sort()
    return found


def is_heldout(rel_path: str, *, seed: int, heldout_fraction: float) -> bool:
    """Seeded, platform-independent decision whether a file belongs to the held-out split."""
    return split_score(rel_path, seed) < heldout_fraction


def _join(chunks: list[np.ndarray]) -> np.ndarray:
    """Concatenate files, each followed by SEPARATOR_BYTE."""
    sep = np.array([SEPARATOR_BYTE], dtype=np.uint8)
    parts: list[np.ndarray] = []
    for chunk in chunks:
        parts.extend((chunk, sep))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


@functools.lru_cache(maxsize=4)
def _load_corpus(root: str, suffix: str, seed: int, heldout_fraction: float, max_bytes: int) -> Corpus:
    if os.path.isfile(root):  # one file: its last heldout_fraction is held out
        with open(root, "rb") as fh:
            data = np.frombuffer(fh.read(max_bytes), dtype=np.uint8)
        cut = int(len(data) * (1.0 - heldout_fraction))
        name = os.path.basename(root)
        return Corpus(root=root, train=data[:cut], heldout=data[cut:], train_files=(name,), heldout_files=(name,),
                      digest=hash_data(data[:cut], data[cut:]))
    train: list[np.ndarray] = []
    heldout: list[np.ndarray] = []
    train_files: list[str] = []
    heldout_files: list[str] = []
    total = 0
    skipped = SKIPPED_DIRS if suffix == ".py" else frozenset({"__pycache__"})
    files = list_source_files(root, suffix=suffix, skipped=skipped)
    # a few files may all hash into one split: then the file with the lowest score is held out
    forced = (min(files, key=lambda f: split_score(f, seed)) if len(files) >= 2 and not any(
        is_heldout(f, seed=seed, heldout_fraction=heldout_fraction) for f in files) else None)
    for rel in files:
        try:
            with open(os.path.join(root, rel), "rb") as fh:
                data = fh.read()
        except OSError:
            continue  # unreadable file: skipped identically on every process of this machine
        if total + len(data) > max_bytes:
            break
        total += len(data)
        arr = np.frombuffer(data, dtype=np.uint8)
        if rel == forced or is_heldout(rel, seed=seed, heldout_fraction=heldout_fraction):
            heldout.append(arr)
            heldout_files.append(rel)
        else:
            train.append(arr)
            train_files.append(rel)
    train_bytes, heldout_bytes = _join(train), _join(heldout)
    return Corpus(root=root, train=train_bytes, heldout=heldout_bytes, train_files=tuple(train_files),
                  heldout_files=tuple(heldout_files), digest=hash_data(train_bytes, heldout_bytes))


def load_corpus(root: str, *, seq_len: int, split_seed: int = 0, heldout_fraction: float = 0.1,
                max_bytes: int = 4_000_000, suffix: str = ".py") -> Corpus:
    """Read (once per process) the corpus under ``root`` (a directory or one file).

    Raises TaskError when the path is missing or a split is too small for one window.
    """
    if not os.path.exists(root):
        raise TaskError(f"text corpus path {root!r} does not exist")
    corpus = _load_corpus(os.path.abspath(root), suffix, split_seed, heldout_fraction, max_bytes)
    need = seq_len + 2
    if len(corpus.train) < need or len(corpus.heldout) < need:
        raise TaskError(
            f"corpus under {corpus.root} too small for seq_len={seq_len}: {len(corpus.train)} train / "
            f"{len(corpus.heldout)} held-out bytes in {len(corpus.train_files)} / {len(corpus.heldout_files)} "
            f"files (add files, lower heldout_fraction or raise corpus_max_bytes, now {max_bytes})")
    return corpus


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


class MoE(nn.Module):
    """Mixture-of-experts MLP: a linear router picks the top ``top_k`` of ``n_experts`` MLPs per
    token; their outputs are summed with the renormalised router probabilities."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise TaskError(f"gpt-moe: top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.top_k = top_k
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(n_embd) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        flat = x.reshape(-1, c)  # (N, C), N = B*T tokens
        probs = F.softmax(self.router(flat), dim=-1)  # (N, E)
        weight, chosen = probs.topk(self.top_k, dim=-1)  # (N, k), (N, k)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)  # (N, C)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)  # tokens routed to expert e
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weight[token, slot].unsqueeze(1))
        return out.view(b, t, c)


class Block(nn.Module):
    """Pre-LayerNorm transformer block (MLP, or a mixture of experts when ``n_experts`` > 0)."""

    def __init__(self, n_embd: int, n_head: int, n_experts: int = 0, top_k: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MoE(n_embd, n_experts, top_k) if n_experts else MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT; the output head is tied to the token embedding (no separate parameter)."""

    def __init__(self, *, seq_len: int, n_layer: int, n_head: int, n_embd: int,
                 vocab_size: int = VOCAB_SIZE, n_experts: int = 0, top_k: int = 2) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, n_experts, top_k) for _ in range(n_layer))
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

    def initialise(self, generator: torch.Generator | None = None) -> None:
        """normal(0, INIT_STD) weights, zero biases, unit LayerNorm gains, drawn from ``generator``
        (default: torch's global RNG, which the run seeds before building the model)."""
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


def _windows(data: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int) -> Batch:
    """``batch_size`` random windows of ``seq_len + 1`` bytes: inputs and next-byte targets."""
    starts = rng.integers(0, len(data) - seq_len, size=batch_size)  # (B,)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (B, T+1)
    window = torch.from_numpy(data[idx].astype(np.int64))  # (B, T+1)
    return Batch(inputs=window[:, :-1], targets=window[:, 1:], tokens=batch_size * seq_len)


_EVAL_STREAM = 2**31 - 1
"""Seed-sequence entry that keeps the held-out batches apart from every training stream."""


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats per byte)."""
    logits = model(batch.inputs)  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)),  # (B*T, vocab)
                           batch.targets.reshape(-1))  # (B*T,)


def _check_positive(**values: int) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TaskError(f"task arg {k} must be an int >= 1, got {v!r}")


def language_model_task(name: str, corpus: Corpus, *, seq_len: int, batch_size: int, n_layer: int, n_head: int,
                        n_embd: int, eval_batches: int, n_experts: int = 0, top_k: int = 2,
                        config: dict[str, Any], data_source: str) -> Task:
    """A byte-level GPT task on ``corpus``: batches are random windows of the train split; the
    held-out set is ``eval_batches`` fixed batches of the held-out split. Its data digest is the
    corpus's: a process that read other bytes (another Python's standard library, other files)
    is refused."""
    _check_positive(seq_len=seq_len, batch_size=batch_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    eval_batches=eval_batches)
    if n_embd % n_head:
        raise TaskError(f"task arg n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    rng = np.random.default_rng([0, _EVAL_STREAM])
    eval_set = [_windows(corpus.heldout, rng, batch_size, seq_len) for _ in range(eval_batches)]

    def model() -> GPT:
        gpt = GPT(seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_experts=n_experts,
                  top_k=top_k)
        # every weight redrawn from a generator seeded by the run seed (build_model seeded torch
        # with it): the same initial model as before the task contract, so published figures hold
        gpt.initialise(torch.Generator().manual_seed(torch.initial_seed()))
        return gpt

    batches = indexed_batches(lambda rng: _windows(corpus.train, rng, batch_size, seq_len),
                              max_stream=_EVAL_STREAM - 1)
    return Task(name=name, model=model, batches=batches, loss=lm_loss, eval_batches=lambda: iter(eval_set),
                embedding_names=("wte.weight", "wpe.weight"), config=config, data_digest=corpus.digest,
                data_source=data_source)


def gpt(*, seq_len: int = 64, batch_size: int = 16, n_layer: int = 6, n_head: int = 4, n_embd: int = 64,
        eval_batches: int = 8, heldout_fraction: float = 0.1, corpus_max_bytes: int = 4_000_000,
        split_seed: int = 0) -> Task:
    """Built-in ``gpt``: byte-level GPT on the Python standard library's sources."""
    corpus = load_corpus(stdlib_root(), seq_len=seq_len, split_seed=split_seed, heldout_fraction=heldout_fraction,
                         max_bytes=corpus_max_bytes)
    config = dict(seq_len=seq_len, batch_size=batch_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                  eval_batches=eval_batches, heldout_fraction=heldout_fraction, corpus_max_bytes=corpus_max_bytes,
                  split_seed=split_seed, corpus_bytes=[int(len(corpus.train)), int(len(corpus.heldout))])
    return language_model_task("gpt", corpus, seq_len=seq_len, batch_size=batch_size, n_layer=n_layer,
                               n_head=n_head, n_embd=n_embd, eval_batches=eval_batches, config=config,
                               data_source=_stdlib_source(corpus))


def gpt_moe(*, n_experts: int = 4, top_k: int = 2, seq_len: int = 64, batch_size: int = 16, n_layer: int = 4,
            n_head: int = 4, n_embd: int = 64, eval_batches: int = 8, heldout_fraction: float = 0.1,
            corpus_max_bytes: int = 4_000_000, split_seed: int = 0) -> Task:
    """Built-in ``gpt-moe``: ``gpt`` with a top-k mixture-of-experts MLP in every block."""
    _check_positive(n_experts=n_experts, top_k=top_k)
    if top_k > n_experts:
        raise TaskError(f"gpt-moe: top_k must be in [1, n_experts={n_experts}], got {top_k}")
    corpus = load_corpus(stdlib_root(), seq_len=seq_len, split_seed=split_seed, heldout_fraction=heldout_fraction,
                         max_bytes=corpus_max_bytes)
    config = dict(n_experts=n_experts, top_k=top_k, seq_len=seq_len, batch_size=batch_size, n_layer=n_layer,
                  n_head=n_head, n_embd=n_embd, eval_batches=eval_batches, heldout_fraction=heldout_fraction,
                  corpus_max_bytes=corpus_max_bytes, split_seed=split_seed,
                  corpus_bytes=[int(len(corpus.train)), int(len(corpus.heldout))])
    return language_model_task("gpt-moe", corpus, seq_len=seq_len, batch_size=batch_size, n_layer=n_layer,
                               n_head=n_head, n_embd=n_embd, eval_batches=eval_batches, n_experts=n_experts,
                               top_k=top_k, config=config, data_source=_stdlib_source(corpus))


def text(*, path: str = "", seq_len: int = 64, batch_size: int = 16, n_layer: int = 6, n_head: int = 4,
         n_embd: int = 64, eval_batches: int = 8, heldout_fraction: float = 0.1, corpus_max_bytes: int = 50_000_000,
         split_seed: int = 0) -> Task:
    """Built-in ``text``: byte-level GPT on the user's files (``path``: a directory or one file)."""
    if not path:
        raise TaskError("task text needs --task-arg path=DIR_OR_FILE (your text files)")
    corpus = load_corpus(path, seq_len=seq_len, split_seed=split_seed, heldout_fraction=heldout_fraction,
                         max_bytes=corpus_max_bytes, suffix="")
    config = dict(seq_len=seq_len, batch_size=batch_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                  eval_batches=eval_batches, heldout_fraction=heldout_fraction, corpus_max_bytes=corpus_max_bytes,
                  split_seed=split_seed, files=[len(corpus.train_files), len(corpus.heldout_files)])
    return language_model_task("text", corpus, seq_len=seq_len, batch_size=batch_size, n_layer=n_layer,
                               n_head=n_head, n_embd=n_embd, eval_batches=eval_batches, config=config,
                               data_source=corpus.describe("files under"))


def _stdlib_source(corpus: Corpus) -> str:
    return corpus.describe(f"Python {platform.python_version()}'s standard library sources under")


def initial_loss_estimate() -> float:
    """Loss of a uniform predictor over bytes, ln 256 (what an untrained model scores)."""
    return math.log(VOCAB_SIZE)
