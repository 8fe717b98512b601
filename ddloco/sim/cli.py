"""`ddloco sim` / `python -m ddloco.sim`: the goodput simulator at paper scale.

    table      the paper's Table 1 (goodput vs chips and learners): ours, the paper's, the diff
    run        one scenario: --chips N --learners M --quorum K (or --mode dp|elastic)
    hetero     heterogeneous learners: K = M lock-step vs K = 1 vs K = 1 + grace window
    bandwidth  WAN bandwidth for >= 90 % utilisation: data-parallel vs Decoupled DiLoCo

Exit codes: 0 success, 1 runtime failure, 2 bad usage.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any, Sequence

from common.exits import FAILURE as EXIT_FAILURE
from common.exits import USAGE as EXIT_USAGE
from ddloco.sim import bandwidth as bw
from ddloco.sim.cluster import (DEFAULT_FAILURES, MODES, Estimate, FailureModel, Scenario, Summary,
                         simulate_seeds)
from ddloco.sim.hetero import HeteroConfig, Policy, simulate_hetero, standard_policies



class UsageError(ValueError):
    """A flag value the simulator refuses."""


def _positive_int(text: str) -> int:
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


MAX_FAILURES = 5_000_000


def _failures(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_FAILURES:
        raise argparse.ArgumentTypeError(f"at most {MAX_FAILURES:,} failures per seed, got {text}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


_MODEL_HELP = {
    "chip_mtbi_years": "mean time between interruptions per chip, years",
    "slice_chips": "chips taken out together by one failure (the swappable slice)",
    "repair_s": "seconds until a failed slice is back",
    "downscale_s": "elastic pause after a failure, s",
    "upscale_s": "elastic pause when a repaired slice rejoins, s",
    "rejoin_wait_s": "a repaired slice rejoins at the next pause or after at most this, s",
    "restart_s": "non-elastic data-parallel restart after a failure, s",
    "dp_spare_fraction": "non-elastic data-parallel: fraction of slices kept as hot spares",
    "step_s": "training step; a failure throws away the partial step, s",
}


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("failure model (defaults: the calibration in README.md, \"The calibration\")")
    for f in dataclasses.fields(FailureModel):
        kind = _positive_int if f.type in (int, "int") else _float
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=f.default,
                       metavar="X", help=f"{_MODEL_HELP[f.name]} (default {f.default:g})")


def _add_seed_flags(p: argparse.ArgumentParser, *, failures: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--seeds", type=_positive_int, default=5, help="seeds to average (default 5)")
    g.add_argument("--failures", type=_failures, default=failures,
                   help=f"chip failures sampled per seed and cell (default {failures}, "
                   f"at most {MAX_FAILURES:,})")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _model(args: argparse.Namespace) -> FailureModel:
    return FailureModel(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FailureModel)})


def _est(e: Estimate) -> dict[str, float | None]:
    return {"mean": e.mean, "ci95": e.ci95}


def _summary_dict(s: Summary) -> dict[str, Any]:
    return {"scenario": dataclasses.asdict(s.scenario), "label": s.scenario.label,
            "goodput": _est(s.goodput), "uptime": _est(s.uptime), "seeds": s.seeds,
            "failures_min_per_seed": s.failures_min, "failures_total": s.failures_total}


def _finite(obj: Any) -> Any:
    """NaN/inf (e.g. a CI from one seed) become null: the output stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _print_json(obj: Any) -> None:
    print(json.dumps(_finite(obj), indent=2, allow_nan=False))


def _pm(e: Estimate, scale: float = 100.0) -> str:
    ci = "n/a" if math.isnan(e.ci95) else f"{scale * e.ci95:.1f}"
    return f"{scale * e.mean:.1f} ±{ci}"


# --------------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------------

def cmd_table(args: argparse.Namespace) -> int:
    from ddloco.sim.table import CHIPS, ROWS, TOLERANCE_POINTS, build_table, format_table, plot_table

    model = _model(args)
    t0 = time.perf_counter()
    cells = build_table(model, seeds=args.seeds, failures=args.failures)
    elapsed = time.perf_counter() - t0
    outside = [c for c in cells if not c.within_tolerance]
    worst = max(cells, key=lambda c: abs(c.diff_points))
    if args.plot:
        plot_table(cells, args.plot)
    if args.json:
        _print_json({
            "parameters": model.as_dict(), "seeds": args.seeds, "failures_per_seed": args.failures,
            "columns": list(CHIPS), "rows": list(ROWS),
            "cells": [c.as_dict() for c in cells],
            "max_abs_diff_points": abs(worst.diff_points),
            "cells_outside_tolerance": [f"{c.row} @ {c.chips}" for c in outside],
            "tolerance_points": TOLERANCE_POINTS, "elapsed_s": elapsed, "plot": args.plot})
        return 0
    print(f"Table 1: goodput under failures ({args.seeds} seeds x ~{args.failures} failures "
          f"per cell; Decoupled DiLoCo rows: K = 1)")
    print("parameters: " + ", ".join(f"{k}={v:g}" for k, v in model.as_dict().items()))
    print()
    print(format_table(cells))
    print()
    print(f"max |ours - paper| = {abs(worst.diff_points):.1f} points ({worst.row} @ "
          f"{worst.chips:,} chips); cells outside ±{TOLERANCE_POINTS:g}: "
          f"{len(outside)}{' (' + ', '.join(f'{c.row} @ {c.chips:,}' for c in outside) + ')' if outside else ''}")
    print(f"fewest failures in one seed of one cell: {min(c.ours.failures_min for c in cells):,}; "
          f"elapsed {elapsed:.1f} s")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


# --------------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    if args.mode != "diloco" and (args.learners, args.quorum) != (1, 1):
        raise UsageError(f"--mode {args.mode} is one job: leave --learners and --quorum at 1")
    scenario = Scenario(chips=args.chips, mode=args.mode, learners=args.learners,
                        quorum=args.quorum)
    model = _model(args)
    t0 = time.perf_counter()
    s = simulate_seeds(scenario, model, seeds=args.seeds, failures=args.failures)
    elapsed = time.perf_counter() - t0
    if args.json:
        _print_json({**_summary_dict(s), "parameters": model.as_dict(), "elapsed_s": elapsed})
        return 0
    print(f"{scenario.label} on {scenario.chips:,} chips"
          + (f" ({scenario.chips / scenario.learners:,.0f} chips per learner)"
             if scenario.mode == "diloco" else ""))
    print(f"  goodput {_pm(s.goodput)} %   uptime {_pm(s.uptime)} %   (mean ±95% CI over "
          f"{s.seeds} seeds, >= {s.failures_min:,} failures each)")
    print("  parameters: " + ", ".join(f"{k}={v:g}" for k, v in model.as_dict().items()))
    print(f"  elapsed {elapsed:.2f} s")
    return 0


# --------------------------------------------------------------------------------------------
# hetero
# --------------------------------------------------------------------------------------------

def cmd_hetero(args: argparse.Namespace) -> int:
    cfg = HeteroConfig(learners=args.learners, slow_fraction=args.slow_fraction,
                       slowdown=args.slowdown, noise=args.noise, step_s=args.step_s,
                       fragments=args.fragments, sync_every_steps=args.sync_every, tau=args.tau,
                       grace_gamma=args.grace_gamma, sync_s=args.sync_s, rounds=args.rounds)
    policies = standard_policies(cfg.learners)
    if args.quorum is not None:
        if args.quorum > cfg.learners:
            raise UsageError(f"--quorum {args.quorum} exceeds --learners {cfg.learners}")
        policies.append(Policy(name=f"K={args.quorum}" + (" + grace" if not args.no_grace else ""),
                               quorum=args.quorum, grace=not args.no_grace, lockstep=False))
    t0 = time.perf_counter()
    rows = []
    for pol in policies:
        runs = [simulate_hetero(cfg, pol, seed=s) for s in range(args.seeds)]
        rows.append({
            "policy": pol.name, "quorum": pol.quorum, "grace": pol.grace, "lockstep": pol.lockstep,
            "goodput": _est(Estimate.of([r.goodput for r in runs])),
            "included": _est(Estimate.of([r.included for r in runs])),
            "included_slow": _est(Estimate.of([r.included_slow for r in runs])),
            "merge_latency_steps": _est(Estimate.of([r.merge_latency_steps for r in runs])),
        })
    elapsed = time.perf_counter() - t0
    if args.json:
        _print_json({"config": cfg.as_dict(), "seeds": args.seeds, "policies": rows,
                     "elapsed_s": elapsed})
        return 0
    print(f"{cfg.learners} learners, {cfg.slow_learners} of them {cfg.slowdown:.0%} slower, "
          f"{cfg.noise:.0%} per-step noise; a round every H/P = {cfg.steps_per_round:g} steps, "
          f"tau={cfg.tau}, gamma={cfg.grace_gamma:g}, sync {cfg.sync_s:g} s; "
          f"{args.seeds} seeds x {cfg.rounds} rounds")
    print()
    print("| policy | goodput % | answers merged per round % | slow learners' answers merged % "
          "| round open->merge (steps) |")
    print("|---|---|---|---|---|")
    for r in rows:
        def pct(d: dict[str, float]) -> str:
            if not math.isfinite(d["mean"]):
                return "n/a"
            ci = f" ±{100 * d['ci95']:.1f}" if math.isfinite(d["ci95"]) else ""
            return f"{100 * d['mean']:.1f}{ci}"
        lat = r["merge_latency_steps"]
        print(f"| {r['policy']} | {pct(r['goodput'])} | {pct(r['included'])} | "
              f"{pct(r['included_slow'])} | {lat['mean']:.2f} |")
    print()
    print("lock-step learners wait at every round for the slowest; decoupled learners (K < M) "
          "never wait,\nso their goodput is 100 % by construction and the cost shows as answers "
          "left out of the merge.")
    print(f"elapsed {elapsed:.1f} s")
    return 0


# --------------------------------------------------------------------------------------------
# bandwidth
# --------------------------------------------------------------------------------------------

def cmd_bandwidth(args: argparse.Namespace) -> int:
    cfg = bw.BandwidthConfig(params=args.params, step_s=args.step_s, fragments=args.fragments,
                             sync_every_steps=args.sync_every, tau=args.tau,
                             utilisation=args.utilisation, dp_overlap=args.dp_overlap)
    codecs = ["fp32", "bf16", "int4"] if args.codec is None else [args.codec]
    rows = []
    for method in ("dp", "diloco"):
        for codec in codecs:
            gbit = bw.required_bits_per_s(cfg, method, codec) / 1e9
            paper = bw.PAPER_GBIT_S.get((method, codec))
            rows.append({"method": method, "codec": codec, "gbit_s": gbit, "paper_gbit_s": paper})
    implied = [{"method": m, "codec": c, "paper_gbit_s": g,
                "implied_params": bw.implied_params(cfg, m, c, g)}
               for (m, c), g in bw.PAPER_GBIT_S.items()]
    notes = bw.assumptions(cfg)
    if args.json:
        _print_json({"config": cfg.as_dict(), "results": rows, "paper_implied_params": implied,
                     "assumptions": notes})
        return 0
    print(f"WAN bandwidth to keep >= {cfg.utilisation:.0%} compute utilisation, "
          f"{cfg.params:.3g} parameters, {cfg.step_s:g} s steps")
    print()
    print("| method | codec | Gbit/s | paper Gbit/s (its model size) |")
    print("|---|---|---|---|")
    names = {"dp": "data-parallel", "diloco": "Decoupled DiLoCo"}
    for r in rows:
        paper = "" if r["paper_gbit_s"] is None else f"{r['paper_gbit_s']:g}"
        print(f"| {names[r['method']]} | {r['codec']} | {r['gbit_s']:.3g} | {paper} |")
    print()
    print("parameters implied by each of the paper's figures under these assumptions:")
    for i in implied:
        print(f"  {names[i['method']]} {i['codec']} {i['paper_gbit_s']:g} Gbit/s -> "
              f"{i['implied_params'] / 1e9:.2f} B parameters")
    print()
    print("assumptions:")
    for n in notes:
        print(f"  - {n}")
    return 0


# --------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddloco sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Run 'ddloco sim COMMAND --help' for a command's flags.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser("table", help="the paper's Table 1: ours vs the paper's goodput",
                       description="Reproduce the paper's Table 1 (goodput vs chips for DP, elastic "
                       "DP and M = 2, 4, 8, 16 learners at K = 1) with one parameter set.")
    _add_model_flags(t)
    _add_seed_flags(t, failures=DEFAULT_FAILURES)
    t.add_argument("--plot", metavar="FILE.png", help="draw goodput vs chips per row beside the "
                   "paper's points")
    t.set_defaults(func=cmd_table)

    r = sub.add_parser("run", help="one scenario: --chips N --learners M --quorum K",
                       description="Goodput and uptime of one scenario (mean and 95 % CI over "
                       "seeds).")
    r.add_argument("--chips", type=_positive_int, required=True, help="N: provisioned chips")
    r.add_argument("--learners", type=_positive_int, default=1, help="M (default 1)")
    r.add_argument("--quorum", type=_positive_int, default=1, help="K (default 1)")
    r.add_argument("--mode", choices=MODES, default="diloco",
                   help="dp (non-elastic), elastic, or diloco (default)")
    _add_model_flags(r)
    _add_seed_flags(r, failures=DEFAULT_FAILURES)
    r.set_defaults(func=cmd_run)

    _add_hetero(sub)
    _add_bandwidth(sub)
    return p


def _add_hetero(sub: Any) -> None:
    defaults = HeteroConfig()
    h = sub.add_parser("hetero", help="heterogeneous learners: lock-step vs K=1 vs K=1 + grace",
                       description="Learners with different step times and per-step noise: "
                       "goodput and answers merged per round for K = M lock-step, K = 1 and "
                       "K = 1 with the adaptive grace window (common.quorum's policy).")
    h.add_argument("--learners", type=_positive_int, default=defaults.learners,
                   help=f"M (default {defaults.learners})")
    h.add_argument("--slow-fraction", type=_float, default=defaults.slow_fraction,
                   help=f"fraction of slow learners (default {defaults.slow_fraction:g})")
    h.add_argument("--slowdown", type=_float, default=defaults.slowdown,
                   help=f"slow learners' extra step time (default {defaults.slowdown:g})")
    h.add_argument("--noise", type=_float, default=defaults.noise,
                   help=f"per-step noise, standard deviation (default {defaults.noise:g})")
    h.add_argument("--step-s", type=_float, default=defaults.step_s,
                   help=f"fast learners' step time, s (default {defaults.step_s:g})")
    h.add_argument("--fragments", type=_positive_int, default=defaults.fragments,
                   help=f"P (default {defaults.fragments}); a round every H/P steps")
    h.add_argument("--sync-every", type=_positive_int, default=defaults.sync_every_steps,
                   help=f"H (default {defaults.sync_every_steps})")
    h.add_argument("--tau", type=_positive_int, default=defaults.tau,
                   help=f"tau (default {defaults.tau})")
    h.add_argument("--grace-gamma", type=_float, default=defaults.grace_gamma,
                   help=f"gamma of the grace window (default {defaults.grace_gamma:g})")
    h.add_argument("--sync-s", type=_float, default=defaults.sync_s,
                   help=f"merge + broadcast time per round, s (default {defaults.sync_s:g})")
    h.add_argument("--rounds", type=_positive_int, default=defaults.rounds,
                   help=f"rounds per seed (default {defaults.rounds})")
    h.add_argument("--quorum", type=_positive_int, default=None,
                   help="also run this decoupled quorum K (with grace unless --no-grace)")
    h.add_argument("--no-grace", action="store_true", help="with --quorum: no grace window")
    h.add_argument("--seeds", type=_positive_int, default=5, help="seeds (default 5)")
    h.add_argument("--json", action="store_true", help="print one JSON object")
    h.set_defaults(func=cmd_hetero)


def _add_bandwidth(sub: Any) -> None:
    bdef = bw.BandwidthConfig()
    b = sub.add_parser("bandwidth", help="WAN bandwidth: data-parallel vs Decoupled DiLoCo",
                       description="Bandwidth per learner to keep compute utilisation >= u, "
                       "for fp32/bf16/int4 payloads; the assumptions are printed with the result.")
    b.add_argument("--params", type=_float, default=bdef.params,
                   help=f"model parameters (default {bdef.params:g})")
    b.add_argument("--step-s", type=_float, default=bdef.step_s,
                   help=f"compute time per step, s (default {bdef.step_s:g})")
    b.add_argument("--fragments", type=_positive_int, default=bdef.fragments,
                   help=f"P (default {bdef.fragments})")
    b.add_argument("--sync-every", type=_positive_int, default=bdef.sync_every_steps,
                   help=f"H (default {bdef.sync_every_steps})")
    b.add_argument("--tau", type=_positive_int, default=bdef.tau, help=f"tau (default {bdef.tau})")
    b.add_argument("--utilisation", type=_float, default=bdef.utilisation,
                   help=f"compute utilisation to keep (default {bdef.utilisation:g})")
    b.add_argument("--dp-overlap", type=_float, default=bdef.dp_overlap,
                   help=f"fraction of a DP step the all-reduce hides behind (default "
                   f"{bdef.dp_overlap:g})")
    b.add_argument("--codec", choices=sorted(bw.CODEC_BITS), default=None,
                   help="only this payload codec (default: fp32, bf16, int4)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=cmd_bandwidth)
    _add_replay(sub)


def _add_replay(sub: Any) -> None:
    r = sub.add_parser("replay", help="goodput predicted on a measured failure schedule vs measured "
                                      "(a `ddloco compare --chaos/--hetero` report)",
                       description="Replays every run of a `ddloco compare --chaos/--hetero` report through "
                                   "the schedule simulator (ddloco/sim/replay.py: the same kill times, step times, "
                                   "checkpoint interval, the measured cold start and rejoin costs) and prints "
                                   "predicted vs measured goodput per system.")
    r.add_argument("report", metavar="DIR", help="the compare report directory (compare.json, runs/)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from statistics import fmean
    from ddloco.sim.replay import replay_dir
    try:
        rows = replay_dir(args.report)
    except (OSError, KeyError, ValueError) as e:
        raise UsageError(f"{args.report} is not a readable `ddloco compare --chaos/--hetero` report: {e!r}") from None
    if args.json:
        print(json.dumps({"runs": rows}))
        return 0
    print("| system | seeds | measured goodput | predicted | predicted - measured (points) |")
    print("|---|---|---|---|---|")
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        m, p = fmean(r["measured"] for r in mine), fmean(r["predicted"] for r in mine)
        per_seed = ", ".join(f"{100 * (r['predicted'] - r['measured']):+.1f}" for r in mine)
        print(f"| {system} | {len(mine)} | {m:.3f} | {p:.3f} | {100 * (p - m):+.1f} (per seed {per_seed}) |")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `ddloco sim ARGS` (argv excludes "sim"); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:           # --help (0) or a usage error (2, already printed)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return int(args.func(args))
    except (UsageError, ValueError) as exc:
        print(f"ddloco sim {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return 0
    except OSError as exc:
        print(f"ddloco sim {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
