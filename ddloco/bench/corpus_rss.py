"""``ddloco bench corpus``: a learner's memory does not grow with the corpus (token shards by memory map).

    ddloco bench corpus --small data/tok --tokens 1e9 --steps 60 --task-arg config.hidden_size=256 ...

``--small`` is a directory made by ``ddloco data prepare`` (e.g. of the Python standard library's
sources, ~20 MB of tokens). The bench writes a large corpus next to it from the same tokens:
its documents repeated in a new seeded order each pass until ``--tokens`` tokens (1e9 uint16
tokens: 2 GB of shards), with an index of the same format and tokenizer. It then trains the
``hf`` task for ``--steps`` steps with one learner on each corpus (``ddloco up --learners 1
--syncers 1``, the same model and batches) and compares the learners' peak RSS (their own
heartbeat figure): the large corpus must cost no more than a few MB more (the issue's bar: 300 MB).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from common import exits
from common.files import write_atomic

SHARD_TOKENS = 1 << 27
"""Tokens per shard file of the large corpus (256 MB of uint16)."""


def _documents(tokens: Any, eos: int) -> list[tuple[int, int]]:
    """(start, end) of each document of ``tokens`` (ends include their eos)."""
    import numpy as np
    ends = np.flatnonzero(np.asarray(tokens) == eos) + 1
    starts = np.concatenate([[0], ends[:-1]])
    return [(int(a), int(b)) for a, b in zip(starts, ends) if b > a]


def grow(small: Path, big: Path, tokens: int, *, seed: int = 0, say=print) -> dict[str, Any]:
    """Write the large corpus ``big`` from ``small``'s train tokens (its held-out shards copied as they are)."""
    import numpy as np
    index = json.loads((small / "index.json").read_text())
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    train = np.concatenate([np.fromfile(small / s["file"], dtype=dtype) for s in index["train"]])
    docs = _documents(train, int(index["eos_id"]))
    if not docs:
        raise SystemExit(f"ddloco bench corpus: {small} has no train document")
    big.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards, written, buf, t0 = [], 0, [], time.monotonic()
    in_buf = 0
    while written + in_buf < tokens:
        for d in rng.permutation(len(docs)):
            a, b = docs[d]
            buf.append(train[a:b])
            in_buf += b - a
            if in_buf >= SHARD_TOKENS or written + in_buf >= tokens:
                chunk = np.concatenate(buf)[:max(0, tokens - written)]
                name = f"train-{len(shards):05d}.bin"
                chunk.astype(dtype).tofile(big / name)
                shards.append({"file": name, "tokens": int(len(chunk))})
                written, buf, in_buf = written + len(chunk), [], 0
                say(f"[bench corpus] {written / 1e6:,.0f} M of {tokens / 1e6:,.0f} M tokens "
                    f"({time.monotonic() - t0:.0f} s)")
                if written >= tokens:
                    break
    for s in index["heldout"]:
        (big / s["file"]).write_bytes((small / s["file"]).read_bytes())
    if (small / "tokenizer").is_dir() and not (big / "tokenizer").exists():
        (big / "tokenizer").symlink_to((small / "tokenizer").resolve())
    grown = {**index, "train": shards, "inputs": [{"path": f"{small} repeated and shuffled (seed {seed})",
                                                   "bytes": int(written * dtype.itemsize), "tokens": written,
                                                   "split": "train"}]}
    write_atomic(big / "index.json", json.dumps(grown, indent=1).encode())
    return grown


def _peak_rss(args: argparse.Namespace, data: Path, out: Path, tag: str) -> float:
    report = out / tag
    task_args = [x for item in [f"data={data}", *args.task_arg] for x in ("--task-arg", item)]
    cmd = [sys.executable, "-m", "ddloco", "up", "--insecure", "--quiet", "--run-id", f"bcorpus-{tag}-{os.getpid()}",
           "--task", "hf", *task_args, "--learners", "1", "--syncers", "1", "--steps", str(args.steps),
           "--eval-every-s", "1e9", "--report", str(report)]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode not in (exits.OK, exits.DID_NOT_TRAIN) or not (report / "report.json").exists():
        raise RuntimeError(f"ddloco up ({tag}) exited {proc.returncode}: {proc.stderr[-2000:]}")
    (h,) = json.loads((report / "report.json").read_text())["learner_stats"].values()
    return float(h["peak_rss_mb"])


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="ddloco bench corpus", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", required=True, help="a directory made by `ddloco data prepare`")
    ap.add_argument("--tokens", type=float, default=1e9, help="tokens of the large corpus (default 1e9: 2 GB of uint16)")
    ap.add_argument("--big", help="where to write the large corpus and keep it (default: next to the "
                    "reports, removed after; an existing one with an index is reused)")
    ap.add_argument("--steps", type=int, default=60, help="inner steps of each run (default 60)")
    ap.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="more args of the hf task (repeat; data= is set by the bench)")
    ap.add_argument("--report", help="keep the runs' reports and bench.json here (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(list(argv))
    small = Path(args.small)
    if not (small / "index.json").exists():
        ap.error(f"--small {small}: no index.json (make one with `ddloco data prepare`)")
    out = Path(args.report) if args.report else Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    out.mkdir(parents=True, exist_ok=True)
    big = Path(args.big) if args.big else out / "big"
    if not (big / "index.json").exists():
        grow(small, big, int(args.tokens), say=lambda s: print(s, file=sys.stderr, flush=True))
    index = json.loads((big / "index.json").read_text())
    big_bytes = sum((big / s["file"]).stat().st_size for s in index["train"])
    small_bytes = sum((small / s["file"]).stat().st_size for s in json.loads((small / "index.json").read_text())["train"])
    rss_small = _peak_rss(args, small, out, "small")
    rss_big = _peak_rss(args, big, out, "big")
    res = {"small_train_mb": round(small_bytes / 2**20, 1), "big_train_mb": round(big_bytes / 2**20, 1),
           "learner_peak_rss_mb_small": rss_small, "learner_peak_rss_mb_big": rss_big,
           "difference_mb": round(rss_big - rss_small, 1), "steps": args.steps}
    (out / "bench.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2) if args.json else
          f"learner peak RSS: {rss_small:.0f} MB on {res['small_train_mb']} MB of tokens, {rss_big:.0f} MB on "
          f"{res['big_train_mb']} MB of tokens (difference {res['difference_mb']} MB; reports in {out})")
    if not args.big:
        import shutil
        shutil.rmtree(big, ignore_errors=True)
    return exits.OK


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
