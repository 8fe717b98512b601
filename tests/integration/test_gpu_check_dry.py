"""``make gpu-check DRY=1``'s path on this CPU at tiny sizes, so that no GPU minute is spent on a
typo (issue "Proven where our users train"): the environment, the CUDA tests' command and one bench
stage run for real, with every output file. The other bench stage runs the same code with other
flags: tests/unit/test_gpu_check.py parses both stages' commands (`make gpu-check DRY=1` runs all,
~100 s)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_its_stages_and_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ddloco.bench.gpu_check", str(out), "--dry", "--only", "cuda_tests",
                           "--only", "bench_gpu"], cwd=REPO, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["mode"] == "dry" and res["env"]["facts"]["torch"]
    assert res["cuda_tests"]["rc"] == 0 and "skipped" in res["cuda_tests"]["summary"]
    assert "bench_cpu" not in res
    for stage in ("bench_gpu",):
        f = res[stage]["figures"]
        assert res[stage]["rc"] == 0 and math.isfinite(f["ratio"]) and f["ratio"] > 0, (stage, f)
        assert f["bytes_up_per_step"] > 0 and f["late_fraction"] is not None
    assert set(res["verdicts"]) == {"gpu_1b"}
    assert "| bench_gpu | 0 |" in (out / "gpu_check.md").read_text()
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("bench_gpu.log") for n in names) and any(n.endswith("bench.json") for n in names)
    # what comes back from the GPU machine: a few flat files (its tool returns at most 8)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md", "gpu_check_logs.tar.gz"]
