"""``ddloco data prepare``: input files tokenized into the shards of a corpus directory.

    summary = prepare(PrepareOptions(inputs=("texts/",), out="data/tokens", train_tokenizer=8000))

Steps: find and check the inputs, choose the held-out files, resolve the tokenizer (load it, or
train a byte-level BPE), refuse an OUT made with other options, encode each unfinished input into
its part (``ddloco.data.parts``; in ``workers`` processes), then copy the parts into shards and
write the index last. The progress record is ``OUT/.prepare.json`` (what was asked, written once
at the start) and the parts themselves: each is renamed into ``OUT/.parts/`` (atomically) when its
input is finished, so re-running the same command after an interruption (Ctrl-C, a kill, a crash)
encodes only the inputs without a part, and the result is byte-identical to an uninterrupted run.
(One small record per input, not one growing file rewritten per input: that cost O(inputs²).)
Runs on the caller's thread; worker processes only encode parts.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
import time

import numpy as np
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from common.files import write_atomic
from common.task_args import TaskError
from ddloco.data import index as layout
from ddloco.data.inputs import Input, check_fields, find_files, plan_inputs, text_batches
from ddloco.data.parts import PartDone, PartJob, encode_part, part_path, read_split
from ddloco.data.shards import ShardWriter, copy_range
from ddloco.data.tokenizer import MIN_VOCAB, CorpusTokenizer, resolve_tokenizer, train_tokenizer

RECORD_NAME = layout.RECORD_NAME


@dataclass(frozen=True)
class PrepareOptions:
    """What ``ddloco data prepare`` makes (its flags; one of tokenizer / train_tokenizer)."""
    inputs: tuple[str, ...]
    """input files, folders (read recursively) or globs"""
    out: str
    """the corpus directory (created)"""
    tokenizer: str | None = None
    """an HF tokenizer directory or a name in the local cache"""
    train_tokenizer: int | None = None
    """train a byte-level BPE of this vocabulary size on the train inputs instead"""
    text_field: str = "text"
    """the field of json/jsonl/parquet records that holds the text"""
    workers: int = 1
    """processes encoding input files in parallel"""
    heldout_fraction: float = 0.01
    """of the files (of a single file's documents) held out"""
    seed: int = 0
    """seeds the held-out choice"""
    shard_tokens: int = 1 << 28
    """at most this many tokens per shard file"""
    quiet: bool = False
    """no progress bar"""

    def __post_init__(self) -> None:
        if (self.tokenizer is None) == (self.train_tokenizer is None):
            raise TaskError("give one of --tokenizer NAME_OR_DIR and --train-tokenizer VOCAB")
        if self.train_tokenizer is not None and self.train_tokenizer < MIN_VOCAB:
            raise TaskError(f"--train-tokenizer wants a vocabulary of at least {MIN_VOCAB} (256 bytes + eos), "
                            f"got {self.train_tokenizer}")
        if self.workers < 1:
            raise TaskError(f"--workers must be >= 1, got {self.workers}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise TaskError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.shard_tokens < 1:
            raise TaskError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")
        if not self.inputs:
            raise TaskError("--input: give at least one file, folder or glob")


# ---------------------------------------------------------------------------- the progress bar
class ProgressBar:
    """``files 3/10  tokens 1.2M  4.5 MB/s`` redrawn on one stderr line at most 5 times a second;
    silent when ``enabled`` is false (not a terminal, or --quiet)."""

    def __init__(self, stream: TextIO, files: int, enabled: bool):
        self.stream, self.files, self.enabled = stream, files, enabled
        self.done = self.chars = self.tokens = 0
        self._start = self._drawn = time.monotonic()

    def add(self, chars: int = 0, tokens: int = 0, files: int = 0) -> None:
        self.chars, self.tokens, self.done = self.chars + chars, self.tokens + tokens, self.done + files
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= 0.2 or files):
            self._drawn = now
            rate = self.chars / max(now - self._start, 1e-9) / 1e6
            self.stream.write(f"\rprepare  files {self.done}/{self.files}  tokens {self.tokens / 1e6:,.2f}M  "
                              f"{rate:,.1f} MB/s ")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------- steps
def _identity(opts: PrepareOptions, plan: list[Input], tok_hash: str | None) -> dict[str, Any]:
    """What makes OUT what it is: a re-run with another identity is refused."""
    return {"inputs": [[i.path, i.bytes] for i in plan], "text_field": opts.text_field,
            "heldout_fraction": opts.heldout_fraction, "seed": opts.seed, "shard_tokens": opts.shard_tokens,
            "tokenizer": tok_hash if opts.tokenizer is not None else f"trained BPE vocab {opts.train_tokenizer}"}


def _input_differences(old: list, new: list) -> str:
    gone = [p for p, _ in old if p not in {q for q, _ in new}]
    added = [p for p, _ in new if p not in {q for q, _ in old}]
    resized = [p for p, b in new if p in dict(old) and dict(old)[p] != b]
    parts = [f"{what} {len(paths)} (first {paths[0]})" for what, paths in
             (("left out", gone), ("new", added), ("changed size", resized)) if paths]
    return "inputs differ: " + ", ".join(parts)


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    out = []
    for k in new:
        if old.get(k) != new[k]:
            out.append(_input_differences(old.get(k) or [], new[k]) if k == "inputs"
                       else f"{k} was {old.get(k)!r}, now {new[k]!r}")
    return "; ".join(out)


def _load_record(out: str, identity: dict[str, Any]) -> dict[str, Any]:
    """OUT's progress record (a fresh one for a new OUT); TaskError when OUT was made otherwise."""
    path = os.path.join(out, RECORD_NAME)
    if not os.path.exists(path):
        if os.path.isdir(out) and os.listdir(out):
            raise TaskError(f"--out {out} exists and is not a corpus made by `ddloco data prepare`: "
                            "give a new or empty directory")
        return {"identity": identity}
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise TaskError(f"--out {out}: unreadable progress record {RECORD_NAME} ({e}): delete {out}") from None
    if record.get("identity") != identity:
        raise TaskError(f"--out {out} was prepared with other inputs or options ("
                        f"{_differences(record.get('identity', {}), identity)}): use another --out or delete it")
    return record


def _save_record(out: str, record: dict[str, Any]) -> None:
    kept = {k: v for k, v in record.items() if k != "done"}   # the parts say which inputs are done
    write_atomic(os.path.join(out, RECORD_NAME), json.dumps(kept, indent=1, sort_keys=True))


def _finished_parts(out: str, plan: list[Input], dtype: str, split: bool) -> dict[str, dict[str, Any]]:
    """The inputs whose part is in OUT/.parts (finished by an earlier run): number -> tokens, and
    where its held-out tail starts when ``split`` (a single input with a held-out fraction)."""
    done = {}
    for n in range(len(plan)):
        part = part_path(out, n)
        if os.path.isfile(part):
            cut = read_split(part) if split else None
            done[str(n)] = {"tokens": os.path.getsize(part) // np.dtype(dtype).itemsize, "split_at": cut}
    return done


def _train_texts(plan: list[Input], text_field: str):
    for inp in plan:
        if not inp.heldout:
            for texts, _ in text_batches(inp, text_field):
                yield from texts


def _tokenizer_dir(opts: PrepareOptions, plan: list[Input], tok: CorpusTokenizer | None) -> CorpusTokenizer:
    """OUT/tokenizer: a copy of the one given, or the one trained (kept from an interrupted run)."""
    where = os.path.join(opts.out, layout.TOKENIZER_DIR)
    if os.path.isfile(os.path.join(where, "tokenizer.json")):
        return resolve_tokenizer(where) if tok is None else tok
    if tok is None:
        tok = train_tokenizer(_train_texts(plan, opts.text_field), opts.train_tokenizer)
    tmp = f"{where}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save(tmp)
    os.replace(tmp, where)
    return tok


def _jobs(opts: PrepareOptions, plan: list[Input], record: dict[str, Any], tok: CorpusTokenizer, dtype: str) -> list[PartJob]:
    single = opts.heldout_fraction if len(plan) == 1 else 0.0
    tok_file = os.path.join(opts.out, layout.TOKENIZER_DIR, "tokenizer.json")
    return [PartJob(number=n, input=inp, part_path=part_path(opts.out, n),
                    tokenizer_file=tok_file, eos_id=tok.eos_id, dtype=dtype, text_field=opts.text_field,
                    heldout_fraction=single)
            for n, inp in enumerate(plan) if str(n) not in record["done"]]


def _ignore_sigint() -> None:
    """A worker leaves Ctrl-C to the command's process, which stops the pool (no traceback per worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_all(jobs: list[PartJob], workers: int, bar: ProgressBar, finished: Callable[[PartDone], None]) -> None:
    """Encode every job's part, calling ``finished`` (on this thread) as each one is done."""
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            done = encode_part(job, on_batch=lambda c, t: bar.add(chars=c, tokens=t))
            bar.add(files=1)
            finished(done)
        return
    with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs)), initializer=_ignore_sigint) as pool:
        for done in pool.imap_unordered(encode_part, jobs):
            job = next(j for j in jobs if j.number == done.number)
            bar.add(chars=job.input.bytes, tokens=done.tokens, files=1)
            finished(done)


def _remove_leftovers(out: str) -> None:
    """Temporary files of an interrupted run (``.NAME.tmpPID``, ``tokenizer.tmpPID``)."""
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if name.startswith(".") and ".tmp" in name and os.path.isfile(path):
            os.remove(path)
        elif name.startswith(f"{layout.TOKENIZER_DIR}.tmp"):
            shutil.rmtree(path, ignore_errors=True)


def _assemble(opts: PrepareOptions, plan: list[Input], record: dict[str, Any], dtype: str) -> dict[str, list]:
    """The parts, in input order, into train and held-out shards: the index's shard lists."""
    writers = {s: ShardWriter(opts.out, s, opts.shard_tokens) for s in ("train", "heldout")}
    for n, inp in enumerate(plan):
        done = record["done"][str(n)]
        part = part_path(opts.out, n)
        cut = done["split_at"] if done["split_at"] is not None else (0 if inp.heldout else done["tokens"])
        copy_range(part, dtype, 0, cut, writers["train"])
        copy_range(part, dtype, cut, done["tokens"], writers["heldout"])
    return {s: w.close() for s, w in writers.items()}


def _index(opts: PrepareOptions, plan: list[Input], record: dict[str, Any], shards: dict[str, list],
           tok: CorpusTokenizer, dtype: str) -> dict[str, Any]:
    inputs = []
    for n, inp in enumerate(plan):
        done = record["done"][str(n)]
        inputs.append({"path": inp.rel, "bytes": inp.bytes, "tokens": done["tokens"],
                       "split": "heldout" if inp.heldout else "train"})
        if done["split_at"] is not None:  # a single input: its tail is held out
            inputs[-1]["heldout_tokens"] = done["tokens"] - done["split_at"]
    source = opts.tokenizer if opts.tokenizer is not None else f"trained byte-level BPE, vocab {opts.train_tokenizer}"
    return {"format": layout.FORMAT, "version": layout.VERSION, "dtype": dtype, "eos_id": tok.eos_id,
            "tokenizer": {"hash": tok.hash, "source": source, "vocab_size": tok.vocab_size},
            "train": shards["train"], "heldout": shards["heldout"], "inputs": inputs,
            "heldout_fraction": opts.heldout_fraction, "seed": opts.seed}


def prepare(opts: PrepareOptions, *, stream: TextIO | None = None) -> dict[str, Any]:
    """Make (or finish, or find finished) the corpus ``opts.out``; its index. Progress goes to
    ``stream`` (default: sys.stderr at the time of the call)."""
    stream = stream if stream is not None else sys.stderr
    out = os.path.abspath(opts.out) + os.sep
    files = [f for f in find_files(list(opts.inputs)) if not f.startswith(out)]   # never OUT's own files
    if not files:
        raise TaskError(f"--input {' '.join(opts.inputs)}: no input file outside --out {opts.out}")
    plan = plan_inputs(files, seed=opts.seed, heldout_fraction=opts.heldout_fraction)
    check_fields(plan, opts.text_field)
    tok = resolve_tokenizer(opts.tokenizer) if opts.tokenizer is not None else None
    record = _load_record(opts.out, _identity(opts, plan, tok.hash if tok is not None else None))
    if record.get("finished") and layout.INDEX_NAME in os.listdir(opts.out):
        return layout.load_index(opts.out)[0]
    os.makedirs(os.path.join(opts.out, layout.PARTS_DIR), exist_ok=True)
    _save_record(opts.out, record)
    tok = _tokenizer_dir(opts, plan, tok)
    dtype = layout.dtype_for(tok.vocab_size)
    record["done"] = _finished_parts(opts.out, plan, dtype, split=len(plan) == 1 and opts.heldout_fraction > 0)
    jobs = _jobs(opts, plan, record, tok, dtype)
    if record["done"] and not opts.quiet:
        stream.write(f"ddloco data prepare: {len(record['done'])} of {len(plan)} input file(s) already done; "
                     "encoding the rest\n")
    bar = ProgressBar(stream, len(plan), enabled=not opts.quiet and stream.isatty())
    bar.add(files=len(plan) - len(jobs))

    def finished(done: PartDone) -> None:
        record["done"][str(done.number)] = {"tokens": done.tokens, "split_at": done.split_at}
    try:
        _encode_all(jobs, opts.workers, bar, finished)
    finally:
        bar.close()
    _remove_leftovers(opts.out)
    index = _index(opts, plan, record, _assemble(opts, plan, record, dtype), tok, dtype)
    write_atomic(os.path.join(opts.out, layout.INDEX_NAME), json.dumps(index, indent=1) + "\n", durable=True)
    record["finished"] = True
    _save_record(opts.out, record)
    shutil.rmtree(os.path.join(opts.out, layout.PARTS_DIR), ignore_errors=True)
    return index
