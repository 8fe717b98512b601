"""``make gpu-quality DRY=1``: the whole GPU quality sweep (env preparation, both lanes, every
stage, every output file) on this CPU at tiny sizes."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_writes_the_four_files_with_finite_rows(tmp_path: Path) -> None:
    out = tmp_path / "q"
    proc = subprocess.run([sys.executable, "-m", "ddloco.bench.gpu_quality", str(out), "--dry"], cwd=REPO,
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(["quality.json", "quality.md", "quality.png",
                                                             "quality_logs.tar.gz"])
    doc = json.loads((out / "quality.json").read_text())
    assert [s["status"] for s in doc["meta"]["stages"]] == ["ok"] * 8      # inproc, two cluster lanes (one at the largest)
    assert sorted({s["lane"] for s in doc["meta"]["stages"]}) == ["cluster", "cluster2", "inproc"]
    assert len(doc["rows"]) == 3
    for row in doc["rows"]:
        for key in ("dp_emulated", "diloco_sync", "decoupled", "diloco_sync_ratio", "decoupled_ratio"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (row["size"], key, row[key])
        assert 0.5 < row["decoupled_ratio"] < 2.0
    assert [len(r["dp_emulated_seeds"]) for r in doc["rows"]] == [2, 2, 1]
    assert [r["decoupled_seeds"] for r in doc["rows"]] == [[0, 1], [0, 1], [0]]   # no seed without a dp one
    md = (out / "quality.md").read_text()
    assert all(f"| {r['size']} |" in md for r in doc["rows"])
    last = proc.stdout.strip().splitlines()
    assert last[0].split()[:2] == ["size", "params"] and len(last) == 4       # the short table, last
    with tarfile.open(out / "quality_logs.tar.gz") as tar:
        names = tar.getnames()
        reports = [json.load(tar.extractfile(n)) for n in names if n.endswith("/report.json")]
    assert "env.json" in names and sum(n.endswith("stage.log") for n in names) == 8
    # the cluster's learners kept the dry profile's step floor (20 ms): their step EMA is not under it
    assert len(reports) == 5 and all(r["decoupled_floor_ms"] == [20.0] for r in doc["rows"])
    for rep in reports:
        emas = [float(h["step_ema_s"]) for h in rep["learner_stats"].values()]
        assert len(emas) == 4 and min(emas) >= 0.0195, emas
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"
