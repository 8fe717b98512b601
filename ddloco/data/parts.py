"""One input file tokenized into one part file (``OUT/.parts/NNNNN.bin``): the unit of work of
``ddloco data prepare``, run in the command's process or in a worker process.

The part holds the input's token ids (the shard dtype, documents followed by ``eos_id``) and is
written atomically: its appearance is the record that the input is finished, so an interrupted
run leaves whole parts or none (a single input's held-out cut, ``NNNNN.split``, is written before
its part). The assembly later copies the parts, in input order, into the shards. Each process loads the tokenizer once, from
``OUT/tokenizer/tokenizer.json`` with ``tokenizers`` alone, and encodes with its Rust
``encode_batch_fast`` (threads inside Rust). Mutable state: the per-process tokenizer cache
(``_TOKENIZERS``), owned by the process's main thread.
"""
from __future__ import annotations

import itertools
import os
from array import array
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from common.files import atomic_path, write_atomic
from common.task_args import TaskError
from ddloco.data.index import PARTS_DIR
from ddloco.data.inputs import Input, text_batches
from ddloco.data.tokenizer import require

_TOKENIZERS: dict[str, Any] = {}


def part_path(out: str, number: int) -> str:
    return os.path.join(out, PARTS_DIR, f"{number:05d}.bin")


def read_split(part: str) -> int:
    with open(part[:-len(".bin")] + ".split") as f:
        return int(f.read())


@dataclass(frozen=True)
class PartJob:
    """What one input's encoding needs; ``heldout_fraction`` > 0 only for a single input file
    (its last fraction of documents, or lines of a text file, is held out)."""
    number: int
    input: Input
    part_path: str
    tokenizer_file: str
    eos_id: int
    dtype: str
    text_field: str
    heldout_fraction: float = 0.0


@dataclass(frozen=True)
class PartDone:
    """A finished part: its token count and, for a single input, where its held-out tail starts."""
    number: int
    tokens: int
    split_at: int | None = None


def _tokenizer(path: str) -> Any:
    tok = _TOKENIZERS.get(path)
    if tok is None:
        tok = _TOKENIZERS[path] = require("tokenizers").Tokenizer.from_file(path)
    return tok


def encode_texts(tok: Any, texts: list[str], documents: bool, eos_id: int,
                 dtype: np.dtype) -> tuple[np.ndarray, list[int]]:
    """The ids of ``texts`` in one array (``eos_id`` after each text when they are documents), and
    each text's token count (its eos included)."""
    ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    if documents:
        eos = (eos_id,)
        ids = [x for pair in zip(ids, itertools.repeat(eos)) for x in pair]
        lengths = [len(a) + 1 for a in ids[::2]]
    else:
        lengths = [len(a) for a in ids]
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(lengths)), lengths


def _split_at(job: PartJob, unit_ends: array) -> int:
    units = len(unit_ends)
    if units < 2:
        raise TaskError(f"--input {job.input.path}: a single input file with {units} document(s)/line(s) cannot be "
                        "split into train and held-out: give more files or --heldout-fraction 0")
    held = min(units - 1, max(1, int(units * job.heldout_fraction)))
    return int(unit_ends[units - held - 1])


def encode_part(job: PartJob, on_batch: Callable[[int, int], None] | None = None) -> PartDone:
    """Tokenize ``job.input`` into ``job.part_path``; ``on_batch(chars, tokens)`` after each batch."""
    tok, dtype = _tokenizer(job.tokenizer_file), np.dtype(job.dtype)
    unit_ends = array("q") if job.heldout_fraction > 0 else None
    tokens = 0
    with atomic_path(job.part_path) as tmp, open(tmp, "wb") as f:
        for texts, documents in text_batches(job.input, job.text_field):
            ids, lengths = encode_texts(tok, texts, documents, job.eos_id, dtype)
            ids.tofile(f)
            if unit_ends is not None:
                unit_ends.extend(tokens + end for end in itertools.accumulate(lengths))
            tokens += len(ids)
            if on_batch is not None:
                on_batch(sum(map(len, texts)), len(ids))
        if job.input.loader is None:  # a text file is one document
            np.array([job.eos_id], dtype=dtype).tofile(f)
            tokens += 1
            if unit_ends is not None and unit_ends:
                unit_ends[-1] += 1
        split_at = _split_at(job, unit_ends) if unit_ends is not None else None
        if split_at is not None:  # before the part: a part never lacks its cut
            write_atomic(job.part_path[:-len(".bin")] + ".split", str(split_at))
    return PartDone(number=job.number, tokens=tokens, split_at=split_at)
