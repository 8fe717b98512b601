"""The baseline of ``ddloco bench loop``: a plain PyTorch training loop with no ddloco code.

    python ddloco/bench/plain_hf_loop.py --model-dir DIR --data DIR --seq-len 128 --batch-size 8 \
        --steps 200 --threads 2 --lr 3e-3 --json

It imports torch, numpy and transformers only (run as a file, never as part of the package): the
model is ``AutoModelForCausalLM.from_config`` of ``DIR/config.json`` (SDPA attention), the batches
are windows of ``seq_len + 1`` tokens read by memory map from the train shards of a directory
made by ``ddloco data prepare`` (its ``index.json``), the optimizer is ``torch.optim.AdamW``. What
a ddloco learner adds on top of this loop (its data stream, token counting, the schedule, the
sync path's hooks) is the difference ``ddloco bench loop`` measures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _windows(data: str, seq_len: int):
    """Every train window of ``seq_len + 1`` tokens, shard by shard, as int64 arrays (cycled)."""
    import numpy as np
    with open(os.path.join(data, "index.json")) as f:
        index = json.load(f)
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    shards = [np.memmap(os.path.join(data, s["file"]), dtype=dtype, mode="r") for s in index["train"]]
    while True:
        for tokens in shards:
            for start in range(0, len(tokens) - seq_len, seq_len):
                yield np.asarray(tokens[start:start + seq_len + 1], dtype=np.int64)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="a directory with the model's config.json")
    ap.add_argument("--data", required=True, help="a directory made by `ddloco data prepare`")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                    help="PyTorch's fused AdamW kernel (default on: what a ddloco learner uses on CPU and CUDA)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                            weight_decay=args.weight_decay, fused=args.fused or None)
    windows = _windows(args.data, args.seq_len)
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        batch = torch.from_numpy(np.stack([next(windows) for _ in range(args.batch_size)]))
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    wall = time.perf_counter() - t0
    res = {"steps": args.steps, "wall_s": round(wall, 3), "steps_per_s": round(args.steps / wall, 4),
           "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4),
           "params": sum(p.numel() for p in model.parameters())}
    print(json.dumps(res) if args.json else res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
