"""``ddloco bench prepare``: is ``ddloco data prepare`` as fast as the tokenizer lets it be?

On the same local files, each repeat measures (1) the tokenizer's own batch encoding of the files'
text, already in memory (``encode_batch_fast``, and ``encode_batch`` with offsets, each on the
batches of lines that prepare gives it), and (2) the whole ``ddloco data prepare`` command as a
user runs it (a process: reading the files, encoding, writing the parts, the shards and the
index), both in tokens per second; the ratio (2) ÷ the faster of (1) is the figure (target >=
0.5: the tokenizer's Rust speed is the limit). The default files are the Python standard
library's sources, copied again and again up to ``--mb`` MB; the default tokenizer a byte-level
BPE of ``--vocab`` tokens trained on the first 4 MB of them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from common import exits


def make_corpus(root: Path, mb: float) -> list[Path]:
    """The standard library's .py files copied into ``root`` (round after round) up to ``mb`` MB."""
    stdlib = Path(os.__file__).parent
    sources = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    out, total, rnd = [], 0, 0
    while total < mb * 1e6:
        for src in sources:
            if total >= mb * 1e6:
                break
            dest = root / f"r{rnd:02d}" / src.relative_to(stdlib)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
            total += dest.stat().st_size
            out.append(dest)
        rnd += 1
    return out


def train_tokenizer_dir(files: list[Path], vocab: int, dest: Path) -> str:
    from ddloco.data.tokenizer import train_bpe
    texts, size = [], 0
    for f in files:
        if size > 4e6:
            break
        texts.append(f.read_text(errors="replace"))
        size += len(texts[-1])
    train_bpe(iter(texts), vocab).save_pretrained(dest)
    return str(dest)


def encode_rate(tokenizer_dir: str, files: list[Path]) -> dict[str, float]:
    """Tokens/s of the tokenizer's own batch encoding on the files' lines (read beforehand)."""
    import tokenizers
    from ddloco.data.inputs import BATCH_CHARS
    tok = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    batches = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace", newline="") as fh:
            while lines := fh.readlines(BATCH_CHARS):
                batches.append(lines)
    out = {}
    for name in ("encode_batch_fast", "encode_batch"):
        encode = getattr(tok, name)
        t0 = time.perf_counter()
        tokens = sum(len(e.ids) for b in batches for e in encode(b, add_special_tokens=False))
        out[name] = tokens / (time.perf_counter() - t0)
        out["tokens"] = tokens
    return out


def prepare_rate(tokenizer_dir: str, corpus: Path, out: Path, workers: int) -> dict[str, float]:
    """Tokens/s of the whole `ddloco data prepare` command, run as a process."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "ddloco", "data", "prepare", "--input", str(corpus), "--out", str(out),
           "--tokenizer", tokenizer_dir, "--workers", str(workers), "--quiet"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - t0
    index = json.loads((out / "index.json").read_text())
    tokens = sum(s["tokens"] for s in index["train"] + index["heldout"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="ddloco bench prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", metavar="DIR", help="a folder of text files (default: the standard library's "
                    "sources copied up to --mb MB into a temporary folder)")
    ap.add_argument("--mb", type=float, default=30.0, help="size of the default corpus in MB (default 30)")
    ap.add_argument("--tokenizer", metavar="DIR", help="an HF tokenizer directory (default: a byte-level BPE of "
                    "--vocab tokens trained on the corpus's first 4 MB)")
    ap.add_argument("--vocab", type=int, default=8192, help="the default tokenizer's vocabulary (default 8192)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each side (default 3)")
    ap.add_argument("--workers", type=int, default=1, help="`ddloco data prepare --workers` (default 1)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(list(argv))
    if args.repeats < 1 or args.mb <= 0:
        print("ddloco bench prepare: --repeats must be >= 1 and --mb > 0", file=sys.stderr)
        return exits.USAGE
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        work = Path(tmp)
        corpus = Path(args.input) if args.input else work / "corpus"
        files = sorted(p for p in corpus.rglob("*") if p.is_file()) if args.input else make_corpus(corpus, args.mb)
        tok_dir = args.tokenizer or train_tokenizer_dir(files, args.vocab, work / "tokenizer")
        rows = []
        for r in range(args.repeats):
            enc = encode_rate(tok_dir, files)
            prep = prepare_rate(tok_dir, corpus, work / "out", args.workers)
            best = max(enc["encode_batch_fast"], enc["encode_batch"])
            rows.append({"encode_batch_fast_tokens_per_s": enc["encode_batch_fast"],
                         "encode_batch_tokens_per_s": enc["encode_batch"], "prepare_tokens_per_s": prep["tokens_per_s"],
                         "prepare_seconds": prep["seconds"], "tokens": prep["tokens"],
                         "ratio": prep["tokens_per_s"] / best})
            print(f"[bench prepare] repeat {r + 1}/{args.repeats}: ratio {rows[-1]['ratio']:.3f}", file=sys.stderr)
        mb = sum(f.stat().st_size for f in files) / 1e6
    ratios = [row["ratio"] for row in rows]
    result: dict[str, Any] = {"mb": mb, "files": len(files), "workers": args.workers, "repeats": rows,
                              "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                              "ratio_max": max(ratios), "target": 0.5, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"corpus            {mb:,.1f} MB in {len(files)} files, {rows[0]['tokens']:,} tokens, {os.cpu_count()} CPUs")
    for k, row in enumerate(rows):
        print(f"repeat {k + 1}          encode_batch_fast {row['encode_batch_fast_tokens_per_s'] / 1e6:.2f} M tok/s, "
              f"encode_batch {row['encode_batch_tokens_per_s'] / 1e6:.2f} M tok/s, ddloco data prepare "
              f"{row['prepare_tokens_per_s'] / 1e6:.2f} M tok/s ({row['prepare_seconds']:.1f} s): ratio {row['ratio']:.3f}")
    print(f"ratio             {result['ratio_median']:.3f} median (min {result['ratio_min']:.3f}, max "
          f"{result['ratio_max']:.3f}); target >= 0.5")
    return 0
