"""Tokenizers for corpora: the identity hash shared by ``prepare`` and the task, offline loading,
and training a byte-level BPE locally. ``transformers``/``tokenizers`` are imported lazily (the
``[hf]`` extra)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

from common.task_args import TaskError

EXTRA_HINT = "pip install 'decoupled-diloco[hf]'"
MIN_VOCAB = 258
SPECIAL_TOKENS = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}


def require(module: str) -> Any:
    """Import ``module`` of the [hf] extra, or a one-line TaskError saying how to install it."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TaskError(f"{module} is not installed: {EXTRA_HINT}") from None


def tokenizer_hash(tok: Any) -> str:
    """sha256 (16 hex) of a tokenizer's canonical JSON: its model, vocabulary, merges, normalizer,
    pre-tokenizer, decoder and added tokens; not its padding/truncation settings nor its
    post-processor (the special tokens added around a text, which corpora are encoded without and
    ``transformers`` may rewrite on load). Accepts a ``transformers`` fast tokenizer or a
    ``tokenizers.Tokenizer``."""
    backend = getattr(tok, "backend_tokenizer", tok)
    if not hasattr(backend, "to_str"):
        raise TaskError(f"tokenizer {type(tok).__name__} is not a fast (Rust) tokenizer: cannot hash it")
    spec = json.loads(backend.to_str())
    for runtime in ("padding", "truncation", "post_processor"):  # corpora are encoded without special tokens
        spec.pop(runtime, None)
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def load_tokenizer(name_or_dir: str) -> Any:
    """A fast HF tokenizer from a directory (or a hub name already in the local cache); never
    downloads. TaskError (one line) when it cannot be resolved offline or is not a fast tokenizer."""
    transformers = require("transformers")
    local = os.path.isdir(name_or_dir)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(name_or_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for "cannot resolve"
        where = "directory" if local else "name (not in the local cache; offline)"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TaskError(f"tokenizer {name_or_dir!r}: cannot load this {where}: {first[:200]}") from None
    if not getattr(tok, "is_fast", False):
        raise TaskError(f"tokenizer {name_or_dir!r} is not a fast (Rust) tokenizer")
    return tok


def eos_id(tok: Any) -> int:
    """The id written between documents: eos, else sep, else a TaskError."""
    for attr in ("eos_token_id", "sep_token_id"):
        value = getattr(tok, attr, None)
        if isinstance(value, int):
            return value
    raise TaskError("tokenizer has no eos token (nor sep): cannot separate documents")


@dataclass(frozen=True)
class CorpusTokenizer:
    """What ``ddloco data prepare`` encodes with: the Rust tokenizer, its eos id, vocabulary size and
    hash, and how to write it as an HF tokenizer directory."""
    backend: Any
    eos_id: int
    vocab_size: int
    hash: str
    save: Callable[[str], None]


def _config_eos(folder: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(folder, name)) as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            return eos
    return None


def _from_hf(tok: Any) -> CorpusTokenizer:
    return CorpusTokenizer(backend=tok.backend_tokenizer, eos_id=eos_id(tok), vocab_size=len(tok),
                           hash=tokenizer_hash(tok), save=tok.save_pretrained)


def resolve_tokenizer(name_or_dir: str) -> CorpusTokenizer:
    """A directory holding ``tokenizer.json`` and an eos token in its config is read with
    ``tokenizers`` alone (fast: no ``transformers`` import) and copied file by file; anything else
    goes through ``load_tokenizer``. Never downloads."""
    file = os.path.join(name_or_dir, "tokenizer.json")
    eos = _config_eos(name_or_dir) if os.path.isfile(file) else None
    if eos is None:
        return _from_hf(load_tokenizer(name_or_dir))
    backend = require("tokenizers").Tokenizer.from_file(file)
    eos_token_id = backend.token_to_id(eos)
    if eos_token_id is None:
        raise TaskError(f"tokenizer {name_or_dir!r}: its eos token {eos!r} is not in its vocabulary")

    def save(dest: str) -> None:
        shutil.copytree(name_or_dir, dest, ignore=shutil.ignore_patterns(".*"))
    return CorpusTokenizer(backend=backend, eos_id=eos_token_id, vocab_size=backend.get_vocab_size(True),
                           hash=tokenizer_hash(backend), save=save)


def train_bpe(texts: Any, vocab_size: int) -> Any:
    """Train a byte-level BPE (deterministic for the same texts) on an iterator of strings; the
    ``transformers`` fast tokenizer with eos/bos/pad set to ``<|endoftext|>``."""
    tokenizers = require("tokenizers")
    transformers = require("transformers")
    if vocab_size < MIN_VOCAB:
        raise TaskError(f"a byte-level BPE needs a vocabulary of at least {MIN_VOCAB} (256 bytes + eos), got {vocab_size}")
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[SPECIAL_TOKENS["eos_token"]], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(texts, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, **SPECIAL_TOKENS)


def train_tokenizer(texts: Any, vocab_size: int) -> CorpusTokenizer:
    """``train_bpe`` as the tokenizer ``ddloco data prepare`` encodes with."""
    return _from_hf(train_bpe(texts, vocab_size))
