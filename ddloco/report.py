"""`--report DIR`: report.json and the PNG plots of a run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.plot import Series, line_chart, timeline_chart


def learner_intervals(samples: list[tuple[float, str]]) -> list[tuple[float, float, str]]:
    """Collapse (t, state) samples into (start, end, state) bars."""
    out: list[tuple[float, float, str]] = []
    for (t, s), nxt in zip(samples, samples[1:] + [None]):
        end = nxt[0] if nxt else t + 1.0
        if out and out[-1][2] == s and abs(out[-1][1] - t) < 1e-9:
            out[-1] = (out[-1][0], end, s)
        else:
            out.append((t, end, s))
    return out


MARK_LABELS = {"learner_kill": "K", "stall": "S", "resume": "C", "shard_kill": "SK", "shard_wipe": "SW",
               "broker_restart": "B", "redis_restart": "R", "extra_start": "E+", "extra_stop": "E-"}
"""Short labels of the marks on timeline.png."""


def write_report(out_dir: Path, report: dict[str, Any], monitor: Any) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    tmp.replace(out_dir / "report.json")
    curve = report["eval_curve"]
    line_chart(out_dir / "eval_loss.png",
               [Series("global model, held-out", [e["tokens"] for e in curve], [e["loss"] for e in curve],
                       style="line+points")],
               title="Eval loss vs tokens", xlabel="tokens (all learners)", ylabel="loss (nats/byte)")
    tl = report["merge_timeline"]
    line_chart(out_dir / "merges.png", [Series("merge", [t for t, _ in tl], [p for _, p in tl], style="points")],
               title="Merges over time per fragment", xlabel="seconds", ylabel="fragment")
    rows = [(lid, learner_intervals(monitor.samples[lid])) for lid in monitor.learner_ids]
    marks = [(t, MARK_LABELS.get(k, k[:2].upper())) for t, k, _ in getattr(monitor, "marks", [])]
    timeline_chart(out_dir / "timeline.png", rows, title="Learners: boot / up / blocked / down",
                   xlabel="seconds" + (" - K kill, S stall, C resume, SK SW shard kill/wipe, B broker, R Redis, E+ E- extra"
                                       if marks else ""),
                   marks=marks, size=(1300, 440) if marks else (800, 400))
