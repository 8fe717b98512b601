"""The on-disk layout of a prepared corpus, written once here (``prepare`` writes it, ``TokenCorpus``
reads it).

    DIR/index.json            the index below, written last and atomically
    DIR/train-00000.bin ...   raw little-endian token ids (uint16 or uint32), documents separated by eos_id
    DIR/heldout-00000.bin ... the held-out split, same format
    DIR/tokenizer/            the HF tokenizer directory the shards were made with
    DIR/.prepare.json         prepare's record of what was asked; DIR/.parts/ its finished inputs

index.json::

    {"format": "ddloco-tokens", "version": 1, "dtype": "uint16"|"uint32", "eos_id": int,
     "tokenizer": {"hash": str, "source": str, "vocab_size": int},
     "train": [{"file": "train-00000.bin", "tokens": int}, ...],
     "heldout": [{"file": "heldout-00000.bin", "tokens": int}, ...],
     "inputs": [{"path": str, "bytes": int, "tokens": int, "split": "train"|"heldout"}, ...],
     "heldout_fraction": float, "seed": int}
"""
from __future__ import annotations

import json
import os
from typing import Any

from common.task_args import TaskError

FORMAT = "ddloco-tokens"
VERSION = 1
INDEX_NAME = "index.json"
TOKENIZER_DIR = "tokenizer"
RECORD_NAME = ".prepare.json"
"""While (and after) ``prepare`` works: what was asked (its progress is the parts in PARTS_DIR)."""
PARTS_DIR = ".parts"
DTYPES = ("uint16", "uint32")


def dtype_for(vocab_size: int) -> str:
    """The smallest shard dtype that holds every id of a vocabulary of ``vocab_size``."""
    return "uint16" if vocab_size <= 65535 else "uint32"


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.bin"


def _fail(path: str, problem: str) -> TaskError:
    return TaskError(f"{path}: {problem} (remake it with `ddloco data prepare`)")


def _check_shards(path: str, index: dict[str, Any], split: str) -> None:
    shards = index.get(split)
    if not isinstance(shards, list):
        raise _fail(path, f"index.json has no {split!r} list")
    for shard in shards:
        if (not isinstance(shard, dict) or not isinstance(shard.get("file"), str)
                or not isinstance(shard.get("tokens"), int) or shard["tokens"] < 0
                or os.path.basename(shard["file"]) != shard["file"]):
            raise _fail(path, f"index.json has a malformed {split} shard entry {shard!r}")


def load_index(path: str) -> tuple[dict[str, Any], bytes]:
    """Read and check ``path/index.json``: (the index, its bytes). TaskError (one line) when it is
    missing, not JSON, of another format or version, or lacks a field."""
    index_path = os.path.join(path, INDEX_NAME)
    if not os.path.isdir(path):
        raise TaskError(f"{path}: no such corpus directory")
    try:
        with open(index_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise TaskError(f"{path}: no {INDEX_NAME}: not a corpus made by `ddloco data prepare` "
                        "(or its preparation did not finish)") from None
    except OSError as e:
        raise TaskError(f"{index_path}: cannot read: {e.strerror}") from None
    try:
        index = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _fail(path, f"index.json is not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise _fail(path, f"index.json is not a {FORMAT!r} index")
    if index.get("version") != VERSION:
        raise _fail(path, f"index.json has version {index.get('version')!r}, this ddloco reads version {VERSION}")
    if index.get("dtype") not in DTYPES:
        raise _fail(path, f"index.json has dtype {index.get('dtype')!r}, expected one of {', '.join(DTYPES)}")
    if not isinstance(index.get("eos_id"), int):
        raise _fail(path, "index.json has no integer eos_id")
    tok = index.get("tokenizer")
    if (not isinstance(tok, dict) or not isinstance(tok.get("hash"), str)
            or not isinstance(tok.get("vocab_size"), int)):
        raise _fail(path, "index.json has no tokenizer {hash, vocab_size}")
    for split in ("train", "heldout"):
        _check_shards(path, index, split)
    return index, raw
