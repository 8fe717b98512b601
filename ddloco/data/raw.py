"""Raw files (text, json/jsonl, parquet: a path, folder or glob) as a corpus, tokenized on the fly:
the same methods as ``TokenCorpus``, no preparation step, and slower.

    corpus = open_corpus("texts/*.jsonl", tokenizer)     # -> RawCorpus
    x = corpus.train_batch(stream=r, seed=0, index=i, batch_size=8, seq_len=256)

The held-out split is ``ddloco data prepare``'s (``ddloco.data.inputs``: whole files by a seeded
hash of their path; a single file: its last documents). Epoch ``e`` reads the train files in the
order of ``Permutation(files, (seed, e))``, each tokenized as ``prepare`` would (documents followed
by eos; json/parquet through ``datasets`` streaming), the tokens cut into consecutive windows of
``seq_len + 1`` (a window may span documents and files; the epoch's last partial window is
dropped). Stream ``s`` of ``S`` reads windows ``q, q+S, ...`` (``q = s mod S``) of each epoch. So
every stream tokenizes the whole corpus and keeps one window in S; batch ``i`` is found by reading
on from the stream's cursor (sequential reads cost O(1) each; a jump back restarts the stream and
costs O(i)). Windows are not shuffled within a file. ``train_windows`` and the token counts need a
whole pass over the train files.

Threads: any thread may call; the stream cursors are guarded by ``_cursors_lock``.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np

from common.task_args import TaskError
from ddloco.data.index import dtype_for
from ddloco.data.inputs import Input, check_fields, find_files, plan_inputs, text_batches
from ddloco.data.parts import encode_texts
from ddloco.data.permutation import Permutation
from ddloco.data.tokenizer import eos_id as tokenizer_eos_id, load_tokenizer, tokenizer_hash


@dataclass
class _Cursor:
    """Where a stream's reading stands: ``reads`` windows of it are behind ``windows``."""
    reads: int
    windows: Iterator[np.ndarray]


def _split_single(inp: Input, text_field: str, heldout_fraction: float) -> int:
    """How many documents (lines of a text file) of a single input are train: the rest is held out."""
    units = sum(len(texts) for texts, _ in text_batches(inp, text_field))
    if units < 2 and heldout_fraction > 0:
        raise TaskError(f"data={inp.path}: a single file with {units} document(s)/line(s) cannot be split into "
                        "train and held-out")
    return units - (min(units - 1, max(1, int(units * heldout_fraction))) if heldout_fraction > 0 else 0)


class RawCorpus:
    """Raw input files read and tokenized on the fly; see the module docstring."""

    def __init__(self, data: str, tok: Any, plan: list[Input], *, text_field: str, streams: int,
                 seed: int, heldout_fraction: float):
        self.data, self._tok, self.streams, self.text_field = data, tok, streams, text_field
        self.eos_id = tokenizer_eos_id(tok)
        self.vocab_size = len(tok)  # an HF fast tokenizer
        self.tokenizer_hash = tokenizer_hash(tok)
        self.dtype = dtype_for(self.vocab_size)
        self._train = [i for i in plan if not i.heldout]
        self._heldout = [i for i in plan if i.heldout]
        self._train_units: int | None = None   # a single file: its first documents train, the rest held out
        if len(plan) == 1 and heldout_fraction > 0:
            self._train_units = _split_single(plan[0], text_field, heldout_fraction)
            self._heldout = [plan[0]]
        identity = {"tokenizer": self.tokenizer_hash, "files": [[i.rel, i.bytes, i.heldout] for i in plan],
                    "text_field": text_field, "seed": seed, "heldout_fraction": heldout_fraction}
        self.digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        self.source = (f"raw files {data} ({len(self._train)} train + {len(self._heldout)} held-out file(s), "
                       f"tokenized on the fly)")
        self._counts: dict[int, tuple[int, int]] = {}
        self._cursors: dict[tuple[int, int, int], _Cursor] = {}
        self._cursors_lock = threading.Lock()   # guards _cursors

    @classmethod
    def open(cls, data: str, tokenizer: Any, *, text_field: str = "text", streams: int = 16, seed: int = 0,
             heldout_fraction: float = 0.01) -> "RawCorpus":
        """TaskError (one line) when no file matches, one cannot be read, or there is no tokenizer."""
        if tokenizer is None:
            raise TaskError(f"data={data} is raw files: they need a tokenizer (tokenizer=NAME_OR_DIR)")
        if streams < 1:
            raise TaskError(f"streams must be >= 1, got {streams}")
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        plan = plan_inputs(find_files([data], label="data="), seed=seed, heldout_fraction=heldout_fraction)
        check_fields(plan, text_field, label="data=")
        return cls(data, tok, plan, text_field=text_field, streams=streams, seed=seed,
                   heldout_fraction=heldout_fraction)

    # ------------------------------------------------------------------ tokens
    def _tokens(self, inp: Input, part: str) -> Iterator[np.ndarray]:
        """``inp``'s token ids batch by batch, as ``prepare`` makes them; of a single split file, its
        ``part`` ('train': its first ``_train_units`` documents or lines, 'heldout': the rest)."""
        first, last = 0, None
        if self._train_units is not None:
            first, last = (0, self._train_units) if part == "train" else (self._train_units, None)
        seen, backend, dtype = 0, self._tok.backend_tokenizer, np.dtype(self.dtype)
        for texts, documents in text_batches(inp, self.text_field):
            lo = max(first - seen, 0)
            hi = len(texts) if last is None else min(max(last - seen, 0), len(texts))
            seen += len(texts)
            if lo < hi:
                yield encode_texts(backend, texts[lo:hi], documents, self.eos_id, dtype)[0]
            if last is not None and seen >= last:
                break
        if inp.loader is None and last is None:  # a text file is one document
            yield np.array([self.eos_id], dtype=dtype)

    def _windows(self, files: list[tuple[Input, str]], seq_len: int) -> Iterator[np.ndarray]:
        """Consecutive windows of ``seq_len + 1`` tokens over ``files``' tokens (int64)."""
        width, pending, have = seq_len + 1, [], 0
        for inp, part in files:
            for ids in self._tokens(inp, part):
                pending.append(ids)
                have += len(ids)
                if have >= width:
                    buf = np.concatenate(pending).astype(np.int64)
                    cut = len(buf) - len(buf) % width
                    yield from buf[:cut].reshape(-1, width)
                    pending, have = [buf[cut:]], len(buf) - cut

    def _epoch_files(self, seed: int, epoch: int) -> list[tuple[Input, str]]:
        order = Permutation(len(self._train), (seed, epoch))(np.arange(len(self._train)))
        return [(self._train[int(k)], "train") for k in order]

    def _stream(self, stream: int, seed: int, seq_len: int) -> Iterator[np.ndarray]:
        q = stream % self.streams
        epoch = 0
        while True:
            seen = 0
            for k, window in enumerate(self._windows(self._epoch_files(seed, epoch), seq_len)):
                seen = k + 1
                if k % self.streams == q:
                    yield window
            if seen <= q:
                raise TaskError(f"data={self.data}: the train files make {seen} window(s) of seq_len+1={seq_len + 1}"
                                f" tokens, too few for stream {q} of {self.streams}")
            epoch += 1

    # ------------------------------------------------------------------ the TokenCorpus methods
    def _count(self, seq_len: int) -> tuple[int, int]:
        if seq_len not in self._counts:
            tokens = sum(len(ids) for inp, part in self._epoch_files(0, 0) for ids in self._tokens(inp, part))
            self._counts[seq_len] = (tokens, tokens // (seq_len + 1))
        return self._counts[seq_len]

    @property
    def train_tokens(self) -> int:
        """The train files' tokens: a whole pass over them (cached)."""
        return self._count(1)[0]

    @property
    def heldout_tokens(self) -> int:
        """The held-out split's tokens: a whole pass over it."""
        return sum(len(ids) for inp in self._heldout for ids in self._tokens(inp, "heldout"))

    def train_windows(self, seq_len: int) -> int:
        """Windows of ``seq_len + 1`` tokens per epoch: a whole pass over the train files (cached)."""
        return self._count(seq_len)[1]

    def check(self, batch_size: int, seq_len: int) -> None:
        """TaskError (one line) when the train files hold less than one batch (reads at most one batch)."""
        windows = self._windows(self._epoch_files(0, 0), seq_len)
        n = sum(1 for _, _ in zip(range(batch_size), windows))
        if n < batch_size:
            raise TaskError(f"data={self.data} is shorter than one batch: its train files make {n} window(s) of "
                            f"seq_len+1={seq_len + 1} tokens, batch_size is {batch_size}")

    def train_batch(self, stream: int, seed: int, index: int, batch_size: int, seq_len: int) -> np.ndarray:
        """Batch ``index`` of data stream ``stream``: int64 [batch_size, seq_len + 1], read on from the
        stream's cursor (O(1) for the next batch, O(index) after a jump back)."""
        if index < 0 or batch_size < 1 or seq_len < 1:
            raise TaskError(f"index >= 0, batch_size >= 1 and seq_len >= 1 wanted, got {index}, {batch_size}, {seq_len}")
        key, start = (stream % self.streams, seed, seq_len), index * batch_size
        with self._cursors_lock:
            cursor = self._cursors.get(key)
            if cursor is None or cursor.reads > start:
                cursor = _Cursor(0, self._stream(stream, seed, seq_len))
            for _ in range(start - cursor.reads):
                next(cursor.windows)
            rows = [next(cursor.windows) for _ in range(batch_size)]
            self._cursors[key] = replace(cursor, reads=start + batch_size)
        return np.stack(rows)

    def heldout_batches(self, batch_size: int, seq_len: int, max_batches: int) -> list[np.ndarray]:
        """The held-out files' first ``batch_size * max_batches`` windows in order (the last batch may be
        shorter): the same on every process."""
        rows: list[np.ndarray] = []
        for window in self._windows([(i, "heldout") for i in self._heldout], seq_len):
            if len(rows) == batch_size * max_batches:
                break
            rows.append(window)
        return [np.stack(rows[i:i + batch_size]) for i in range(0, len(rows), batch_size)]

    def __repr__(self) -> str:
        return f"RawCorpus({self.source})"
