"""``ddloco data prepare``: the command line of ``ddloco.data.prepare`` (the only code here that
reads argv). Exit codes (common.exits): 0 success, 2 bad input (one line), 130 interrupted."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from common.exits import USAGE
from common.task_args import TaskError

DESCRIPTION = """\
prepare: tokenize input files into a corpus directory OUT that training reads in place
(`--task hf --task-arg data=OUT`): OUT/index.json, OUT/train-*.bin and OUT/heldout-*.bin (raw
uint16/uint32 token ids, documents separated by eos), OUT/tokenizer/. Text files are read directly
(a file is one document); .jsonl/.json/.parquet through `datasets` (a record is one document).
Interrupted (Ctrl-C, a kill), the same command again goes on where it stopped (docs/data.md)."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddloco data", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["prepare"], help="prepare: tokenize files into a corpus directory")
    ap.add_argument("--input", nargs="+", required=True, metavar="FILE_OR_GLOB",
                    help="input files, folders (read recursively, hidden files left out) or globs (quote them)")
    ap.add_argument("--out", required=True, metavar="DIR", help="the corpus directory (new or empty, or the "
                    "one an interrupted run of the same command left)")
    tok = ap.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="an HF tokenizer directory (or a hub name already "
                     "in the local cache; nothing is downloaded); copied to OUT/tokenizer")
    tok.add_argument("--train-tokenizer", type=int, metavar="VOCAB", help="train a byte-level BPE of VOCAB tokens on "
                     "the train inputs (deterministic) and save it to OUT/tokenizer")
    ap.add_argument("--text-field", default="text", help="the field of json/jsonl/parquet records holding the "
                    "text (default text)")
    ap.add_argument("--workers", type=int, default=1, metavar="N", help="processes encoding input files in "
                    "parallel (default 1; the tokenizer already uses every core within a file)")
    ap.add_argument("--heldout-fraction", type=float, default=0.01, help="fraction of the files held out for "
                    "evaluation, chosen by a seeded hash of their path, at least one; a single file: its last "
                    "fraction of documents (of lines for a text file) (default 0.01)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the held-out choice (default 0)")
    ap.add_argument("--shard-tokens", type=int, default=1 << 28, metavar="N", help="at most N tokens per shard "
                    "file (default 2**28)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a "
                    "terminal) and no summary line")
    return ap


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    from ddloco.data.prepare import PrepareOptions, prepare
    try:
        opts = PrepareOptions(inputs=tuple(args.input), out=args.out, tokenizer=args.tokenizer,
                              train_tokenizer=args.train_tokenizer, text_field=args.text_field,
                              workers=args.workers, heldout_fraction=args.heldout_fraction, seed=args.seed,
                              shard_tokens=args.shard_tokens, quiet=args.quiet)
        index = prepare(opts)
    except TaskError as e:
        print(f"ddloco data prepare: {e}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print("\nddloco data prepare: interrupted; run the same command again to go on where it stopped",
              file=sys.stderr)
        return 130
    if not args.quiet:
        train = sum(s["tokens"] for s in index["train"])
        held = sum(s["tokens"] for s in index["heldout"])
        print(f"prepared {args.out}: {train:,} train tokens in {len(index['train'])} shard(s), {held:,} held-out "
              f"tokens, {len(index['inputs'])} input file(s), {index['dtype']}, tokenizer "
              f"{index['tokenizer']['hash']} (vocab {index['tokenizer']['vocab_size']:,})")
    return 0
