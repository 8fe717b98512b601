"""The input files of a corpus: which files a path, folder or glob names, which of them are held
out, and their text, read in batches.

A text file (any suffix but the ones below) is one document, read directly in batches of lines;
``.jsonl``/``.json``/``.parquet`` files are read through ``datasets`` streaming, one document per
record (its ``text_field``). The held-out split takes whole files, chosen by a seeded hash of their
path relative to the inputs' common folder (at least one file); a single input file instead holds
out its last ``heldout_fraction`` of documents (of lines, for a text file).
"""
from __future__ import annotations

import errno
import glob
import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Iterator

from common.task_args import TaskError
from ddloco.data.tokenizer import require

RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Suffixes read through ``datasets`` (the loader's name): a document per record."""
BATCH_CHARS = 1 << 20
BATCH_RECORDS = 1000


@dataclass(frozen=True)
class Input:
    """One input file: its absolute path, its path relative to the inputs' common folder (its
    name in the index and in the split's hash), its size, and whether it is held out whole."""
    path: str
    rel: str
    bytes: int
    heldout: bool

    @property
    def loader(self) -> str | None:
        """The ``datasets`` loader that reads it, None for a text file."""
        return RECORD_SUFFIXES.get(os.path.splitext(self.path)[1].lower())


def _expand(pattern: str) -> list[str]:
    if os.path.isdir(pattern):
        out = []
        for folder, dirs, files in os.walk(pattern):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            out += [os.path.join(folder, f) for f in files if not f.startswith(".")]
        return out
    if os.path.exists(pattern):
        return [pattern]
    return [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]


def find_files(patterns: list[str], label: str = "--input ") -> list[str]:
    """The absolute, sorted, distinct files that paths, folders (recursively, hidden ones left out)
    or globs name. TaskError (one line) when a pattern names nothing or a file cannot be read."""
    found: set[str] = set()
    for pattern in patterns:
        files = _expand(pattern)
        if not files:
            raise TaskError(f"{label}{pattern}: no such file, or no file matches")
        found.update(os.path.abspath(f) for f in files)
    for f in sorted(found):
        try:
            if stat.S_ISREG(os.stat(f).st_mode):
                os.close(os.open(f, os.O_RDONLY))
            elif not os.access(f, os.R_OK):  # a named pipe or device: opening it could wait or eat data
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        except OSError as e:
            raise TaskError(f"{label}{f}: cannot read: {e.strerror}") from None
    return sorted(found)


def split_score(rel: str, seed: int) -> float:
    """A seeded, platform-independent number in [0, 1) per relative path: the held-out split of
    ``ddloco data prepare``, of raw-file corpora and of the built-in ``gpt``/``text`` tasks."""
    digest = hashlib.blake2b(f"{seed}:{rel}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64


def plan_inputs(files: list[str], *, seed: int, heldout_fraction: float) -> list[Input]:
    """The inputs in order, each marked held out or not. With several files and a positive
    fraction, at least one (the lowest score) is held out; a single file is never held out whole."""
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    rels = [os.path.relpath(f, root) for f in files]
    held = [len(files) > 1 and split_score(r, seed) < heldout_fraction for r in rels]
    if len(files) > 1 and heldout_fraction > 0 and not any(held):
        held[min(range(len(rels)), key=lambda i: split_score(rels[i], seed))] = True
    return [Input(path=f, rel=r, bytes=os.path.getsize(f), heldout=h) for f, r, h in zip(files, rels, held)]


def check_fields(inputs: list[Input], text_field: str, label: str = "--input ") -> None:
    """TaskError (one line) when a json/parquet input's first record lacks ``text_field``."""
    for inp in inputs:
        if inp.loader is None:
            continue
        batch = next(iter(_records(inp, text_field, check=False)), None)
        if batch is None:
            continue
        if text_field not in batch:
            raise TaskError(f"{label}{inp.path}: its records have no field {text_field!r} "
                            f"(fields: {', '.join(sorted(batch)) or 'none'}; use --text-field)")


def _records(inp: Input, text_field: str, check: bool = True) -> Iterator[dict]:
    datasets = require("datasets")
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(inp.loader, data_files=inp.path, split="train", streaming=True)
        yield from ds.iter(batch_size=BATCH_RECORDS)
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TaskError(f"--input {inp.path}: cannot read it as {inp.loader}: {first[:200]}") from None


def text_batches(inp: Input, text_field: str) -> Iterator[tuple[list[str], bool]]:
    """(texts, each_is_a_document) batches: a text file's lines (one document, the whole file), or
    a json/parquet file's records (a document each; a null text is an empty document)."""
    if inp.loader is None:
        with open(inp.path, encoding="utf-8", errors="replace", newline="") as f:
            while lines := f.readlines(BATCH_CHARS):
                yield lines, False
        return
    for batch in _records(inp, text_field):
        if text_field not in batch:
            raise TaskError(f"--input {inp.path}: a record has no field {text_field!r}")
        yield [t if isinstance(t, str) else ("" if t is None else str(t)) for t in batch[text_field]], True
