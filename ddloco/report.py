"""`--report DIR`: report.json and the PNG plots of a run."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from common.config import ConfigError
from common.files import write_atomic
from ddloco.plots import eval_loss_plot, merges_plot, timeline_plot


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
MARK_MEANINGS = {"K": "learner killed", "S": "learner stalled", "C": "stalled learner resumed",
                 "SK": "shard killed", "SW": "shard wiped", "B": "broker restarted", "R": "Redis restarted",
                 "E+": "temporary learners start", "E-": "temporary learners stop"}
"""What each short label means (the legend of timeline.png)."""


def check_report_dir(out_dir: Path) -> None:
    """``--report DIR`` can be written: created if missing, a probe file written and removed.
    Checked before a run starts (a run must not end with nowhere to put its report and model);
    ConfigError naming the directory and the problem otherwise."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--report {out_dir}: it is a file, not a directory; give a directory (created if missing)")
    probe = out_dir / f".ddloco-write-probe-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"ddloco")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as e:
        where = f": {e.filename}" if e.filename and str(e.filename) != str(probe) else ""
        raise ConfigError(f"--report {out_dir}: cannot write the report there ({e.strerror or e}{where}); "
                          f"give a writable directory") from None


def write_report(out_dir: Path, report: dict[str, Any], monitor: Any) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "report.json", json.dumps(report, indent=2, sort_keys=True, default=str))
    eval_loss_plot(out_dir / "eval_loss.png", report["eval_curve"],
                   task=report.get("config", {}).get("task", {}).get("name", ""))
    merges_plot(out_dir / "merges.png", report["merge_timeline"])
    if any(e.get("samples") for e in report["eval_curve"]):
        write_atomic(out_dir / "samples.md", samples_markdown(report["eval_curve"]))
    rows = [(lid, learner_intervals(monitor.samples[lid])) for lid in monitor.learner_ids]
    marks = [(t, MARK_LABELS.get(k, k[:2].upper())) for t, k, _ in getattr(monitor, "marks", [])]
    timeline_plot(out_dir / "timeline.png", rows, marks=marks, mark_key=MARK_MEANINGS)


def samples_markdown(eval_curve: list[dict[str, Any]]) -> str:
    """samples.md: the global model's greedy samples (``Task.samples``) at each evaluation, with
    its tokens and eval loss (prompt and continuation split by `` || ``)."""
    lines = ["# Samples of the global model", "",
             "Greedy continuations of held-out prompts at each evaluation (prompt || continuation).", ""]
    for e in eval_curve:
        if not e.get("samples"):
            continue
        tag = " (final)" if e.get("final") else ""
        lines += [f"## {int(e['tokens']):,} tokens, eval loss {float(e['loss']):.4f}{tag}", ""]
        lines += [f"- `{json.dumps(text, ensure_ascii=False)[1:-1].replace('`', chr(39))}`" for text in e["samples"]]
        lines.append("")
    return "\n".join(lines)


def broker_counters(r: Any, keys: Any) -> dict[str, Any]:
    """The broker's security counters (its ``broker`` hash): refused CURVE handshakes
    (``auth_failures``, by reason) and published messages dropped by the role rules."""
    import redis as redis_lib
    from common import entries
    try:
        h = r.hgetall(keys.broker)
    except redis_lib.RedisError:
        h = {}
    return entries.parse_broker_entry(h)


def add_chaos_results(report: dict[str, Any], runner: Any, sup: Any, *, chaos: Any,
                      marks: list[tuple[float, str, str]]) -> None:
    """The chaos harness's figures (``ChaosRunner.results``) and the supervisor's spares into
    ``report``; each fault also a mark of the timeline, on the report's clock (the monitor's)."""
    res = runner.results()
    report.update(res)
    report["chaos"] = str(chaos)
    report["versions_regressed"] = report.get("versions_regressed", 0) + res["shard_versions_regressed"]
    report["spares_used"] = sup.spares_used
    report["spares_failed"] = sup.spares_failed
    for e in res["chaos_events"]:
        e["t"] = round(e["t"] + runner.report_t0, 3)
        marks.append((e["t"], e["kind"], e["target"]))
