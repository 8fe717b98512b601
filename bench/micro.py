"""`ddloco bench`: micro benchmarks of the hot paths (codecs, wire framing, merge).

Timings are medians over repeats on this machine; compare figures from one run only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from common import quant, wire
from common.merge import contribution_weights, merge_outer_gradients, outer_nesterov_step


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0


def bench_codec(numel: int, repeats: int) -> list[dict[str, Any]]:
    """Encode/decode time, payload size and max abs error of each codec on N(0,1) values."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for codec in quant.CODECS:
        frames = quant.encode(x, codec)
        err = float((quant.decode(frames, codec, numel) - x).abs().max())
        enc = _median_ms(lambda: quant.encode(x, codec), repeats)
        dec = _median_ms(lambda: quant.decode(frames, codec, numel), repeats)
        nbytes = quant.payload_nbytes(numel, codec)
        rows.append({"codec": codec, "numel": numel, "bytes": nbytes, "bits_per_value": 8 * nbytes / numel,
                     "encode_ms": enc, "decode_ms": dec, "encode_input_GB_per_s": numel * 4 / enc / 1e6,
                     "max_abs_error": err})
    return rows


def bench_wire(numel: int, repeats: int) -> list[dict[str, Any]]:
    """Full message encode (quantize + header + CRC) and decode (checks + CRC) of one fragment."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    rows = []
    for codec in ("fp32", "int4"):
        def enc() -> list[Any]:
            return wire.encode(kind=wire.UPDATE, run="bench", sender="b", fragment=0, values=x, codec=codec,
                               round=1, base=0, steps=24, tokens=24 * 1024)
        frames = [bytes(memoryview(f)) for f in enc()]
        rows.append({"codec": codec, "numel": numel, "message_bytes": wire.message_nbytes(frames),
                     "encode_ms": _median_ms(enc, repeats),
                     "decode_header_ms": _median_ms(lambda: wire.decode(frames), repeats),
                     "decode_values_ms": _median_ms(lambda: wire.decode(frames).values(), repeats)})
    return rows


def bench_merge(numel: int, repeats: int, learners: Sequence[int] = (2, 4, 8)) -> list[dict[str, Any]]:
    """Syncer merge of one fragment (24 tensors): weights, per-tensor RDA, outer Nesterov step."""
    per = numel // 24
    spans = tuple((i * per, (i + 1) * per, i == 0) for i in range(24))
    n = per * 24
    rows = []
    for m in learners:
        g = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
        theta, mom = torch.zeros(n), torch.zeros(n)

        def merge() -> None:
            w = contribution_weights([1024.0 * 24] * m, [24] * m)
            outer_nesterov_step(theta, mom, merge_outer_gradients(g, w, spans), lr=0.7, momentum_coef=0.9)
        rows.append({"learners": m, "numel": n, "merge_ms": _median_ms(merge, repeats)})
    return rows


BENCHES = {"codec": bench_codec, "wire": bench_wire, "merge": bench_merge}


def _print_table(name: str, rows: list[dict[str, Any]]) -> None:
    print(f"## {name}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()]
        print("| " + " | ".join(cells) + " |")
    print()


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="ddloco bench", description="Micro benchmarks of the hot paths. "
                                 "Timings are medians on this machine; compare figures from one run only.")
    ap.add_argument("name", choices=[*BENCHES, "all"], help="which benchmark")
    ap.add_argument("--numel", type=int, default=1 << 20, help="elements per fragment (default 1,048,576)")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per figure (default 20)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, like a learner's helper)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(list(argv))
    if args.numel < 64 or args.repeats < 1 or args.threads < 1:
        ap.error("--numel must be >= 64, --repeats and --threads >= 1")
    torch.set_num_threads(args.threads)
    names = list(BENCHES) if args.name == "all" else [args.name]
    out = {n: BENCHES[n](args.numel, args.repeats) for n in names}
    if args.json:
        print(json.dumps({"numel": args.numel, "threads": args.threads, "results": out}, indent=2))
    else:
        print(f"numel={args.numel:,} threads={args.threads} repeats={args.repeats} (medians)\n")
        for n, rows in out.items():
            _print_table(n, rows)
    return 0
