"""A tiny tokenizer and corpus for the ``hf`` task's tests, made here without a download: a BPE
tokenizer trained with ``tokenizers`` on a few standard-library sources, saved as a Hugging Face
tokenizer directory, and a corpus in ``ddloco data prepare``'s format (index.json + token shards)."""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

SOURCES = ("textwrap.py", "string.py", "bisect.py", "heapq.py", "shlex.py", "fnmatch.py")
"""Standard-library files the texts come from (the last one is held out)."""
TINY_CONFIG = {"config.hidden_size": "64", "config.intermediate_size": "128", "config.num_hidden_layers": "2",
               "config.num_attention_heads": "4", "config.num_key_value_heads": "4",
               "config.max_position_embeddings": "128"}
"""Task args of a tiny Llama (hidden 64, 2 layers)."""


def texts(max_chars: int = 12_000) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text()[:max_chars] for name in SOURCES]


def make_tokenizer(out_dir: Path, vocab_size: int = 300, extra: str = "") -> Path:
    """A byte-level BPE tokenizer trained on ``texts()`` (plus ``extra``), saved with
    ``PreTrainedTokenizerFast.save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts() + ([extra] if extra else []), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    fast.save_pretrained(str(out_dir))
    return out_dir


def make_corpus(out_dir: Path, tokenizer_dir: Path, *, train_repeat: int = 1, with_tokenizer: bool = True) -> Path:
    """``out_dir`` as `ddloco data prepare` writes it: the first sources in train-00000.bin, the
    last in heldout-00000.bin (uint16 ids, documents ended by eos), index.json; a copy of the
    tokenizer in ``out_dir/tokenizer`` when ``with_tokenizer``."""
    from transformers import AutoTokenizer

    from ddloco.data import tokenizer_hash
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = texts()
    eos = tok.eos_token_id
    split: dict[str, list[dict[str, Any]]] = {"train": [], "heldout": []}
    inputs = []
    for name, part in (("train", docs[:-1] * train_repeat), ("heldout", docs[-1:])):
        ids: list[int] = []
        for doc in part:
            one = tok(doc)["input_ids"]
            ids += one + [eos]
            inputs.append({"path": name, "bytes": len(doc.encode()), "tokens": len(one) + 1, "split": name})
        fname = f"{name}-00000.bin"
        np.array(ids, dtype=np.uint16).tofile(out_dir / fname)
        split[name].append({"file": fname, "tokens": len(ids)})
    index = {"format": "ddloco-tokens", "version": 1, "dtype": "uint16", "eos_id": eos,
             "tokenizer": {"hash": tokenizer_hash(tok), "source": str(tokenizer_dir), "vocab_size": len(tok)},
             "train": split["train"], "heldout": split["heldout"], "inputs": inputs,
             "heldout_fraction": 0.2, "seed": 0}
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    if with_tokenizer:
        tok.save_pretrained(str(out_dir / "tokenizer"))
    return out_dir


def offline_env() -> dict[str, str]:
    """This process's environment with the hub turned off (no test may download)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
