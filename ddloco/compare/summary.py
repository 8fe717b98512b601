"""`ddloco compare`'s summary of the runs: each system's mean final eval loss with its 95 %
interval, the paired ratios to DP, the curves at equal tokens, and compare.md / compare.png."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

def _t95(df: int) -> float:
    """Two-sided 95 % Student-t quantile with ``df`` degrees of freedom."""
    from scipy.stats import t
    return float(t.ppf(0.975, df))


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % Student-t interval of the mean; a single value has width 0."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    m = statistics.fmean(values)
    if n == 1:
        return m, m, m
    half = _t95(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return m, m - half, m + half


def _interp(curve: Sequence[Sequence[float]], x: float) -> float:
    pts = sorted((float(a), float(b)) for a, b in curve)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def _paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float, float] | None:
    """Mean and 95 % CI of a's final loss ÷ b's over the seeds both ran (None: no common seed)."""
    paired = [a["per_seed"][k] / b["per_seed"][k] for k in a["per_seed"] if k in b["per_seed"]]
    return mean_ci(paired) if paired else None


def summarise(results: dict[str, list[dict[str, Any]]], eval_points: int) -> dict[str, Any]:
    """Per system: mean and 95 % CI of the final eval loss, tokens, wall, bytes/token, per-seed
    values, the curve on a common token grid (mean, min, max over seeds), ratios to dp."""
    out: dict[str, Any] = {}
    for system, runs in results.items():
        if not runs:
            continue
        finals = [r["eval_loss_final"] for r in runs]
        m, lo, hi = mean_ci(finals)
        tokens = max(r["tokens"] for r in runs)
        grid = [round(tokens * k / eval_points) for k in range(eval_points + 1)]
        band = [[_interp(r["curve"], x) for r in runs] for x in grid]
        out[system] = {
            "eval_loss_final": m, "eval_loss_ci": [lo, hi], "tokens": tokens,
            "wall_s": statistics.fmean(r["wall_s"] for r in runs),
            "bytes_per_token": statistics.fmean(r["bytes_per_token"] for r in runs),
            "seeds": [r["seed"] for r in runs],
            "per_seed": {str(r["seed"]): r["eval_loss_final"] for r in runs},
            "curve": {"tokens": grid, "mean": [statistics.fmean(b) for b in band],
                      "min": [min(b) for b in band], "max": [max(b) for b in band]},
            "runs": runs,
        }
    if "dp" in out:
        for system, s in out.items():
            paired = _paired_ratio(s, out["dp"])
            if paired:
                s["ratio_to_dp"], s["ratio_to_dp_ci"] = paired[0], list(paired[1:])
    if "decoupled" in out:   # the defaults against their own variants (issue 9: int4 vs fp32, K = 1 vs K = M)
        for system in ("decoupled_fp32", "decoupled_lockstep"):
            paired = _paired_ratio(out["decoupled"], out[system]) if system in out else None
            if paired:
                out["decoupled"].setdefault("ratio_to", {})[system] = list(paired)
    if "single" in out:
        one = out["single"]
        for system, s in out.items():
            if system == "single":
                continue
            gains = [one["per_seed"][k] - s["per_seed"][k] for k in s["per_seed"] if k in one["per_seed"]]
            if gains:
                gm, glo, ghi = mean_ci(gains)
                s["gain_over_single"] = gm          # one learner's loss minus this system's, same seed
                s["gain_over_single_ci"] = [glo, ghi]
            s["ci_below_single"] = (len(s["runs"]) > 1 and len(one["runs"]) > 1
                                    and s["eval_loss_ci"][1] < one["eval_loss_ci"][0])
    return out


def write_markdown(path: Path, summary: dict[str, Any], meta: dict[str, Any]) -> None:
    lines = [f"# ddloco compare: {meta['task']} task, M = {meta['learners']}, {meta['tokens']:,} tokens, "
             f"seeds {meta['seeds']}", "",
             f"Command: `{meta['command']}`", "",
             "| system | final eval loss (mean, 95 % CI) | ÷ DP (paired by seed) | below single (paired) | per seed | tokens | wall s | bytes/token |",
             "|---|---|---|---|---|---|---|---|"]
    for system, s in summary.items():
        ratio = (f"{s['ratio_to_dp']:.3f} [{s['ratio_to_dp_ci'][0]:.3f}, {s['ratio_to_dp_ci'][1]:.3f}]"
                 if "ratio_to_dp" in s else "")
        gain = (f"{s['gain_over_single']:+.3f} [{s['gain_over_single_ci'][0]:+.3f}, {s['gain_over_single_ci'][1]:+.3f}]"
                + (" (CIs apart)" if s.get("ci_below_single") else "") if "gain_over_single" in s else "")
        per = " / ".join(f"{v:.3f}" for v in s["per_seed"].values())
        lines.append(f"| {system} | {s['eval_loss_final']:.3f} [{s['eval_loss_ci'][0]:.3f}, {s['eval_loss_ci'][1]:.3f}]"
                     f" | {ratio} | {gain} | {per} | {s['tokens']:,} | {s['wall_s']:.0f} | {s['bytes_per_token']:.1f} |")
    for other, (m, lo, hi) in summary.get("decoupled", {}).get("ratio_to", {}).items():
        lines += ["", f"decoupled ÷ {other}, paired by seed: {m:.4f} [{lo:.4f}, {hi:.4f}]"]
    lines += ["", "below single: one learner's final loss minus the system's, same seed (positive: better than "
              "one learner at equal steps), mean and 95 % CI over seeds; \"CIs apart\" when the system's CI "
              "lies wholly below one learner's.", "",
              "Algorithm config (all systems): `" + json.dumps(meta["algo"], sort_keys=True) + "`", "",
              *([f"The cluster systems' learners stepped no faster than {meta['cluster_step_time_floor_ms']:g} ms "
                 "(--step-time-floor-ms).", ""] if meta.get("cluster_step_time_floor_ms") else []),
              "Wall times of in-process systems run side by side (`--jobs`) share the cores; "
              "compare them only within one system.", ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, summary: dict[str, Any], title: str) -> None:
    """Mean eval loss vs tokens per system (line), min to max over seeds (band, same colour)."""
    from ddloco.plots import compare_plot
    compare_plot(path, summary, title)
