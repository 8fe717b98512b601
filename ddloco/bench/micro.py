"""`ddloco bench`: micro benchmarks of the hot paths (codecs, wire framing, merge, broker).

Timings are medians over repeats on this machine; compare figures from one run only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from common import quant, wire
from common.config import AlgoConfig
from common.merge import OuterAccumulator, contribution_weights, outer_step
from common.robust import NormClipper, fair_weights, fold_round
from ddloco.bench.broker import bench_broker, bench_curve
from ddloco.bench.timing import _median_ms, memcpy_ms


@contextlib.contextmanager
def _implementation(impl: str) -> Iterator[None]:
    """Within the block the codecs (and merge) run the C kernels (``c``) or torch."""
    built = quant._kernels
    quant._kernels = built if impl == "c" else None
    try:
        yield
    finally:
        quant._kernels = built


def bench_codec(numel: int, repeats: int) -> list[dict[str, Any]]:
    """Encode/decode time, payload size and max abs error of each codec on N(0,1) values, and
    their speed relative to a memcpy of the same fp32 values measured in the same process.
    ``impl`` says which implementation ran (``quant.KERNEL``); where the C kernels are built,
    the int8/int4 rows are repeated with the torch implementation (``impl`` = torch)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    copy = memcpy_ms(numel, repeats)
    rows = [{"codec": "memcpy", "impl": "torch", "numel": numel, "bytes": 4 * numel, "bits_per_value": 32.0,
             "encode_ms": copy, "decode_ms": copy, "encode_input_GB_per_s": numel * 4 / copy / 1e6,
             "max_abs_error": 0.0, "encode_vs_memcpy": 1.0, "decode_vs_memcpy": 1.0,
             "encode_vs_memcpy_range": [1.0, 1.0], "decode_vs_memcpy_range": [1.0, 1.0]}]
    runs = [(codec, quant.KERNEL if codec in ("int8", "int4") else "torch") for codec in quant.CODECS]
    if quant.KERNEL == "c":
        runs += [("int8", "torch"), ("int4", "torch")]
    for codec, impl in runs:
        with _implementation(impl):
            frames = quant.encode(x, codec)
            err = float((quant.decode(frames, codec, numel) - x).abs().max())
            enc = ratio_runs(lambda: quant.encode(x, codec), numel, repeats)
            dec = ratio_runs(lambda: quant.decode(frames, codec, numel), numel, repeats)
        nbytes = quant.payload_nbytes(numel, codec)
        rows.append({"codec": codec, "impl": impl, "numel": numel, "bytes": nbytes,
                     "bits_per_value": 8 * nbytes / numel, "encode_ms": enc["ms"], "decode_ms": dec["ms"],
                     "encode_input_GB_per_s": numel * 4 / enc["ms"] / 1e6, "max_abs_error": err,
                     "encode_vs_memcpy": enc["vs_memcpy"], "decode_vs_memcpy": dec["vs_memcpy"],
                     "encode_vs_memcpy_range": enc["range"], "decode_vs_memcpy_range": dec["range"]})
    return rows


def ratio_runs(fn: Callable[[], Any], memcpy_numel: int, repeats: int, runs: int = 3) -> dict[str, Any]:
    """``fn``'s median time and its speed against a memcpy of ``memcpy_numel`` fp32 values, each
    measured ``runs`` times alternately in this process: {ms, vs_memcpy (memcpy ÷ fn, median of the
    runs' ratios), range [lowest, highest ratio]}."""
    pairs = [(_median_ms(fn, repeats), memcpy_ms(memcpy_numel, repeats)) for _ in range(runs)]
    ratios = [copy / ms for ms, copy in pairs]
    return {"ms": statistics.median(ms for ms, _ in pairs), "vs_memcpy": statistics.median(ratios),
            "range": [min(ratios), max(ratios)]}


def bench_wire(numel: int, repeats: int) -> list[dict[str, Any]]:
    """Full message encode (quantize + header + CRC) and decode (checks + CRC) of one fragment:
    a learner's answer and a received update (``--numel 41666667``: a 1 B-parameter model's
    fragment with P = 24). ``impl`` as in ``bench_codec`` (int4 with torch too where the C kernels
    are built)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    rows = []
    runs = [("fp32", "torch"), ("int4", quant.KERNEL)] + ([("int4", "torch")] if quant.KERNEL == "c" else [])
    for codec, impl in runs:
        def enc() -> list[Any]:
            return wire.encode(kind=wire.UPDATE, run="bench", sender="b", fragment=0, values=x, codec=codec,
                               round=1, base=0, steps=24, tokens=24 * 1024)
        with _implementation(impl):
            frames = [bytes(memoryview(f)) for f in enc()]
            e = ratio_runs(enc, numel, repeats)
            d = ratio_runs(lambda: wire.decode(frames).values(), numel, repeats)
            rows.append({"codec": codec, "impl": impl, "numel": numel, "message_bytes": wire.message_nbytes(frames),
                         "encode_ms": e["ms"],
                         "decode_header_ms": _median_ms(lambda: wire.decode(frames), repeats),
                         "decode_values_ms": d["ms"], "encode_vs_memcpy": e["vs_memcpy"],
                         "encode_vs_memcpy_range": e["range"], "decode_values_vs_memcpy": d["vs_memcpy"],
                         "decode_values_vs_memcpy_range": d["range"]})
    return rows


def bench_merge(numel: int, repeats: int, learners: Sequence[int] = (2, 4, 8)) -> list[dict[str, Any]]:
    """The shard's merge path of one fragment (24 tensors) with M answers, as ``Shard._compute_merge``
    runs it: the round's fair weights, each Δ_m = Θ − (Θ^base + δ_m) measured, bounded by its
    learner's history and the round's weighted median, folded into the accumulator
    (``common.robust.fold_round``; RDA per tensor, with the C kernels where built), then the outer
    step; its speed relative to a memcpy of its fp32 inputs (M deltas) measured in the same
    process; the whole path from the int4 answers as they arrive to the encoded broadcast
    (``path_ms``, ``path_vs_memcpy``: memcpy of the M fp32 inputs ÷ the path, median of three
    runs, and their range; ``merge_path``); with the shard's allocator setting
    (``common.lifecycle.tune_allocator``, for the rest of the process); and the same merge without the robust rules (token weights, every answer folded as
    sent: ``plain_ms``), so ``robust_cost`` = merge_ms / plain_ms − 1 is what the rules cost."""
    from common.lifecycle import tune_allocator
    tune_allocator()                       # the shard daemon's allocator setting (syncer/cli.py)
    per = numel // 24
    spans = tuple((i * per, (i + 1) * per, i == 0) for i in range(24))
    n = per * 24
    algo = AlgoConfig()
    rows = []
    for m in learners:
        gen = torch.Generator().manual_seed(m)
        deltas = [torch.randn(n, generator=gen) for _ in range(m)]
        theta, base, mom = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.zeros(n)
        scratch = (torch.empty(n), torch.empty(n), torch.empty(n))   # the shard reuses them per fragment
        tokens, steps = [1024.0 * 24 * (1 + 0.1 * i) for i in range(m)], [24] * m
        clipper = NormClipper()
        answers = [(f"l{i}", base, d, 24.0) for i, d in enumerate(deltas)]

        def merge() -> None:
            w, _ = fair_weights(tokens, steps)
            acc = OuterAccumulator(n, spans, "rda", scratch=scratch[:2], robust_buffers=True, robust_radius=True)
            fold_round(acc, theta, answers, w.tolist(), clipper, buf=scratch[2])
            outer_step(theta, mom, acc.result(), spans, algo)

        def plain() -> None:
            w = contribution_weights(tokens, steps).tolist()
            acc = OuterAccumulator(n, spans, "rda", scratch=scratch[:2])
            for d, wm in zip(deltas, w):
                acc.add_answer(theta, base, d, wm, buf=scratch[2])
            outer_step(theta, mom, acc.result(), spans, algo)
        pairs = [(_median_ms(merge, repeats), _median_ms(plain, repeats)) for _ in range(3)]
        ms, plain_ms = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        path = merge_path(deltas, theta, repeats)
        plain_path: list[float] = []   # alternated with the robust path, a pair at a time (drift cancels)
        path_costs: list[float] = []
        for _ in range(5 if quant._kernels is not None else 0):
            a, b = merge_path(deltas, theta, repeats, rounds=1)[0], merge_path(deltas, theta, repeats, rounds=1,
                                                                                 robust=False)[0]
            plain_path.append(b)
            path_costs.append(a / b - 1)
        copies = [memcpy_ms(m * n, repeats) for _ in range(3)]
        copy = statistics.median(copies)
        path_ratios = [c / p for c, p in zip(copies, path)]
        merge_ratios = [c / p[0] for c, p in zip(copies, pairs)]
        rows.append({"learners": m, "numel": n, "merge_ms": ms, "plain_ms": plain_ms,
                     "robust_cost": ms / plain_ms - 1,
                     "robust_cost_range": [min(a / b - 1 for a, b in pairs), max(a / b - 1 for a, b in pairs)],
                     "memcpy_inputs_ms": copy, "merge_vs_memcpy": statistics.median(merge_ratios),
                     "merge_vs_memcpy_range": [min(merge_ratios), max(merge_ratios)],
                     "path_ms": statistics.median(path), "path_vs_memcpy": statistics.median(path_ratios),
                     "path_vs_memcpy_range": [min(path_ratios), max(path_ratios)],
                     # the whole path with the robust rules ÷ the same path without them, − 1
                     "path_plain_ms": statistics.median(plain_path) if plain_path else None,
                     "path_robust_cost": statistics.median(path_costs) if path_costs else None,
                     "path_robust_cost_range": [min(path_costs), max(path_costs)] if path_costs else None})
    return rows


def merge_path(deltas: Sequence[torch.Tensor], theta: torch.Tensor, repeats: int, *,
               codec: str = "int4", rounds: int = 3, robust: bool = True) -> list[float]:
    """The shard's whole path for one fragment, ``rounds`` medians of ``repeats`` (ms): each answer
    (``deltas``, sent as int4 UPDATE messages, the frames as they come off the socket) decoded and
    checked as the shard's intake does, the round merged on its worker (``syncer.merging.compute_merge``:
    robust weights and bounds, RDA, outer step) and the update encoded for the broadcast
    (the run's int4 downlink). Θ of 24 equal parameter pieces; the bases are Θ. ``robust=False``:
    the same intake, kernels (the round's answers decoded tile by tile) and broadcast with the
    robust rules off (token weights, no norm bounds, no median radius): what the rules cost."""
    from common.fragments import Fragment, Piece, TensorSpec
    from syncer.merging import compute_merge
    from syncer.state import Answer, MergeInput
    import threading
    n = theta.numel()
    per = n // 24
    spec = Fragment(0, tuple(Piece(TensorSpec(f"w{i:02d}", (per,)), 0, per) for i in range(24)))
    theta = theta[:per * 24].contiguous()
    messages = [[bytes(memoryview(f)) for f in wire.encode(kind=wire.UPDATE, run="bench", sender=f"l{i}", fragment=0,
                                                           values=d[:per * 24].contiguous(), codec=codec, round=1,
                                                           base=0, steps=24, tokens=24 * 1024 * (10 + i))]
                for i, d in enumerate(deltas)]
    algo, scratch, clipper = AlgoConfig(), threading.local(), NormClipper()
    bases, momentum = {0: theta.clone()}, torch.zeros_like(theta)

    def one_round() -> None:
        answers = []
        for frames in messages:                           # the loop's intake
            msg = wire.decode(frames, expect_run="bench")
            answers.append(Answer(sender=msg.sender, base=msg.base, steps=msg.steps, tokens=msg.tokens,
                                  delta=msg.values_for_merge(), received_at=0.0, clip_steps=float(msg.steps)))
        if not robust:
            plain_round(answers)
            return
        weights, _ = fair_weights([a.tokens for a in answers], [a.steps for a in answers])
        result = compute_merge(MergeInput(spec=spec, theta=theta, master=None, momentum=momentum, bases=bases,
                                          answers=tuple(answers), weights=weights, clipper=clipper, algo=algo,
                                          version=0, epoch=1, run_id="bench", sender="s", scratch=scratch,
                                          largest_numel=theta.numel()))
        if not result.frames:
            raise RuntimeError("bench merge: the measured round did not merge")

    def plain_round(answers: list[Any]) -> None:
        from syncer.merging import broadcast_merged, scratch_buffers
        weights = contribution_weights([a.tokens for a in answers], [a.steps for a in answers]).tolist()
        acc = OuterAccumulator(n, spec.spans, algo.merge_rule, scratch=scratch_buffers(scratch, n, largest=n)[:2],
                               robust_buffers=True, robust_radius=False)
        pairs = [(bases[a.base], a.delta) for a in answers]
        if not acc.round_kernels(theta, pairs):
            raise RuntimeError("bench merge: the plain path needs the C kernels (make setup builds them)")
        measured = acc.measure_round(theta, pairs)
        acc.fold_round(theta, [(b, d, w, 1.0, m) for (b, d), w, m in zip(pairs, weights, measured)])
        new, _ = outer_step(theta, momentum, acc.result(), spec.spans, algo)
        broadcast_merged(MergeInput(spec=spec, theta=theta, master=None, momentum=momentum, bases=bases, answers=(),
                                    weights=None, clipper=clipper, algo=algo, version=0, epoch=1, run_id="bench",
                                    sender="s", scratch=scratch, largest_numel=n), new)
    return [_median_ms(one_round, repeats) for _ in range(rounds)]


def bench_adamw(numel: int, repeats: int) -> list[dict[str, Any]]:
    """One inner AdamW step over ``numel`` parameters (matrices 1,024 or 2,048 wide, like the
    synthetic model's layers) with PyTorch's default CPU implementation (a loop over the
    tensors), ``foreach`` and ``fused`` (what ``learner.inner`` uses where it can): the median step,
    the first step of a fresh optimizer (it allocates the two moments), and the step's speed
    relative to a memcpy of the parameters' fp32 values measured in the same process."""
    width = 2048 if numel >= 1 << 24 else 1024 if numel >= 1 << 20 else 64
    rows_per = max(1, numel // width)
    shapes = [(min(width, rows_per - r), width) for r in range(0, rows_per, width)]
    copy = memcpy_ms(numel, repeats)
    out = []
    for impl in ("default", "foreach", "fused"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0,
                                **({} if impl == "default" else {impl: True}))
        t0 = time.perf_counter()
        opt.step()
        first = (time.perf_counter() - t0) * 1000.0
        step = _median_ms(opt.step, repeats)
        out.append({"impl": impl, "numel": sum(p.numel() for p in params), "step_ms": step,
                    "first_step_ms": first, "step_vs_memcpy": copy / step})
        del opt, params
    return out


def bench_learner(numel: int, repeats: int) -> list[dict[str, Any]]:
    """A learner's sync work on one fragment, its old passes vs one pass (ddloco/bench/learner_path.py)."""
    from ddloco.bench.learner_path import bench_learner as learner_path
    return learner_path(numel, repeats)


BENCHES = {"codec": bench_codec, "wire": bench_wire, "merge": bench_merge, "broker": bench_broker,
           "curve": bench_curve, "adamw": bench_adamw, "learner": bench_learner}


def _print_table(name: str, rows: list[dict[str, Any]]) -> None:
    print(f"## {name}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else
                 "-".join(f"{x:.3g}" for x in v) if isinstance(v, list) and all(isinstance(x, float) for x in v)
                 else str(v) for v in r.values()]
        print("| " + " | ".join(cells) + " |")
    print()


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "sync":   # the real daemons at scale: its own flags (ddloco bench sync --help)
        from ddloco.bench.sync import main as sync_main
        return sync_main(argv[1:])
    if argv and argv[0] == "prepare":  # ddloco data prepare vs its tokenizer (ddloco bench prepare --help)
        from ddloco.bench.prepare import main as prepare_main
        return prepare_main(argv[1:])
    if argv and argv[0] == "insider":  # a compromised learner vs the clean run (ddloco bench insider --help)
        from ddloco.bench.insider import main as insider_main
        return insider_main(argv[1:])
    if argv and argv[0] == "loop":   # a learner vs a plain PyTorch loop on the hf task (ddloco bench loop --help)
        from ddloco.bench.loop import main as loop_main
        return loop_main(argv[1:])
    if argv and argv[0] == "corpus":   # learner RSS on a 2 GB corpus vs a small one (ddloco bench corpus --help)
        from ddloco.bench.corpus_rss import main as corpus_main
        return corpus_main(argv[1:])
    if argv and argv[0] == "group":  # a torchrun learner per rank, DDP vs FSDP (ddloco bench group --help)
        from ddloco.bench.group import main as group_main
        return group_main(argv[1:])
    ap = argparse.ArgumentParser(prog="ddloco bench", description="Micro benchmarks of the hot paths. "
                                 "Timings are medians on this machine; compare figures from one run only.")
    ap.add_argument("name", choices=[*BENCHES, "all"], help="(and group: a torchrun learner's cost per rank, "
                    "DDP vs FSDP, ddloco bench group --help; sync: the real daemons with a synthetic "
                    "model of N parameters, ddloco bench sync --help) codec: encode/decode time, size and error of each "
                    "codec; wire: whole-message encode/decode; merge: a syncer merge of one fragment and the "
                    "shard's whole path; broker: throughput to 2 live subscribers through the broker daemon, "
                    "the broker on a thread, zmq.proxy and a direct socket (vs_direct), and with one that never reads "
                    "(delivered counts, time from the first send to the last arrival); curve: the broker path with and without "
                    "CurveZMQ; adamw: one inner AdamW step, PyTorch's default CPU loop vs foreach vs fused; learner: a "
                    "learner's sync work on one fragment (snapshot, answer, receive, apply), its old passes vs one "
                    "pass, vs a memcpy of the bytes touched; all: every one")
    ap.add_argument("--numel", type=int, default=1 << 20, help="elements per fragment (default 1,048,576)")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per figure of codec, wire and merge "
                    "(default 20; broker and curve take the median of 5 runs)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, like a learner's helper)")
    ap.add_argument("--transport", choices=["tcp", "ipc", "both"], default="tcp",
                    help="broker: the relay's transport, tcp on loopback (default), ipc (a broker and "
                    "members on one host), or both side by side (vs_tcp: ipc's rate over tcp's)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(list(argv))
    if args.numel < 64 or args.repeats < 1 or args.threads < 1:
        ap.error("--numel must be >= 64, --repeats and --threads >= 1")
    torch.set_num_threads(args.threads)
    from common.log import configure_logging
    configure_logging(level="warning")  # results on stdout, nothing else
    names = list(BENCHES) if args.name == "all" else [args.name]
    transports = ("tcp", "ipc") if args.transport == "both" else (args.transport,)
    out = {n: bench_broker(args.numel, args.repeats, transports=transports) if n == "broker"
           else BENCHES[n](args.numel, args.repeats) for n in names}
    if args.json:
        print(json.dumps({"numel": args.numel, "threads": args.threads, "results": out}, indent=2))
    else:
        print(f"numel={args.numel:,} threads={args.threads} repeats={args.repeats} (medians)\n")
        for n, rows in out.items():
            _print_table(n, rows)
    return 0
