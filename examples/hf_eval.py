"""Load a model trained by ``ddloco up --task hf`` with transformers alone, score it, let it write.

    python examples/hf_eval.py reports/llama/hf data/stdlib --seq-len 128 --batch-size 8

No ddloco code: ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
open the report's ``hf/`` directory (or ``ddloco export --format hf --out DIR``), and the eval loss is
computed on the held-out windows exactly as the run's evaluation does (docs/tasks.md, "Eval loss,
exactly"): it prints the report's ``eval_loss_final`` (to float rounding), then a greedy sample.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def heldout_windows(data: str, seq_len: int) -> list[np.ndarray]:
    """The corpus's held-out windows in order: each held-out shard cut from its start into
    consecutive windows of ``seq_len + 1`` tokens (a shard's shorter tail left out)."""
    with open(os.path.join(data, "index.json")) as f:
        index = json.load(f)
    windows = []
    for shard in index["heldout"]:
        ids = np.fromfile(os.path.join(data, shard["file"]), dtype=np.dtype(index["dtype"]).newbyteorder("<"))
        windows += [ids[w * (seq_len + 1):(w + 1) * (seq_len + 1)] for w in range(len(ids) // (seq_len + 1))]
    return windows


def eval_loss(model: torch.nn.Module, windows: list[np.ndarray], batch_size: int, eval_batches: int) -> float:
    """Mean over batches of each batch's causal-LM cross-entropy (nats per token), fp32, eval mode."""
    windows, losses = windows[:batch_size * eval_batches], []
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            b = torch.from_numpy(np.stack(windows[i:i + batch_size]).astype(np.int64))
            logits = model(input_ids=b[:, :-1]).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten()).item())
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a directory written by up --report DIR (DIR/hf) or export --format hf")
    ap.add_argument("data", help="the corpus directory the run trained on (made by `ddloco data prepare`)")
    ap.add_argument("--seq-len", type=int, required=True, help="the run's seq_len")
    ap.add_argument("--batch-size", type=int, required=True, help="the run's batch_size")
    ap.add_argument("--eval-batches", type=int, default=8, help="the run's eval_batches (default 8)")
    ap.add_argument("--prompt", default="def ", help="the start of the greedy sample")
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    loss = eval_loss(model, heldout_windows(args.data, args.seq_len), args.batch_size, args.eval_batches)
    print(f"eval loss {loss:.4f} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    ids = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print("sample  ", repr(tokenizer.decode(out[0])))


if __name__ == "__main__":
    main()
