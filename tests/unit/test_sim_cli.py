"""`ddloco sim` command line (sim.cli.main): JSON outputs, plots, exit codes, help."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddloco.sim.cli import main

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def run_json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_table_json_has_every_cell_beside_the_paper(capsys, tmp_path: Path) -> None:
    plot = tmp_path / "goodput.png"
    out = run_json(capsys, ["table", "--json", "--seeds", "2", "--failures", "400",
                            "--plot", str(plot)])
    assert len(out["cells"]) == 30
    assert {c["row"] for c in out["cells"]} == set(out["rows"])
    for c in out["cells"]:
        assert 0.0 < c["goodput"] <= 1.0 and 0.0 < c["uptime"] <= 1.0
        assert c["diff_points"] == pytest.approx(100 * (c["goodput"] - c["paper_goodput"]))
        assert c["failures_min_per_seed"] >= 300
    assert out["parameters"]["slice_chips"] == 1024
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_flags_override_the_failure_model(capsys) -> None:
    out = run_json(capsys, ["table", "--json", "--seeds", "2", "--failures", "300",
                            "--restart-s", "10", "--chip-mtbi-years", "4"])
    assert out["parameters"]["restart_s"] == 10 and out["parameters"]["chip_mtbi_years"] == 4


def test_run_json(capsys) -> None:
    out = run_json(capsys, ["run", "--chips", "150000", "--learners", "4", "--quorum", "2",
                            "--seeds", "2", "--failures", "500", "--json"])
    assert out["scenario"] == {"chips": 150000, "mode": "diloco", "learners": 4, "quorum": 2}
    assert 0.0 < out["goodput"]["mean"] <= 1.0 and out["goodput"]["ci95"] is not None


def test_run_text_mentions_goodput_and_uptime(capsys) -> None:
    assert main(["run", "--chips", "2.4e6", "--mode", "dp", "--seeds", "1", "--failures",
                 "300"]) == 0
    text = capsys.readouterr().out
    assert "goodput" in text and "uptime" in text and "2,400,000" in text


def test_hetero_json_lists_the_three_policies(capsys) -> None:
    out = run_json(capsys, ["hetero", "--json", "--rounds", "100", "--seeds", "2"])
    names = [p["policy"] for p in out["policies"]]
    assert names == ["K=M=8 lock-step", "K=1", "K=1 + grace"]
    lock, k1, grace = out["policies"]
    assert k1["goodput"]["mean"] >= lock["goodput"]["mean"]
    assert grace["included"]["mean"] > k1["included"]["mean"]


def test_bandwidth_json_prints_assumptions(capsys) -> None:
    out = run_json(capsys, ["bandwidth", "--json", "--params", "1e9"])
    assert out["assumptions"] and out["config"]["params"] == 1e9
    got = {(r["method"], r["codec"]) for r in out["results"]}
    assert got == {(m, c) for m in ("dp", "diloco") for c in ("fp32", "bf16", "int4")}


@pytest.mark.parametrize("argv", [
    [], ["bogus"], ["run"], ["run", "--chips", "0"], ["run", "--chips", "x"],
    ["run", "--chips", "100", "--learners", "2", "--quorum", "3"],
    ["run", "--chips", "100", "--mode", "dp", "--learners", "2"],
    ["table", "--seeds", "0"], ["table", "--repair-s", "-5"],
    ["hetero", "--grace-gamma", "2"], ["hetero", "--quorum", "99"],
    ["bandwidth", "--utilisation", "1.5"], ["bandwidth", "--codec", "int2"],
])
def test_bad_flags_exit_2_with_a_message(capsys, argv: list[str]) -> None:
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["table"], ["run"], ["hetero"], ["bandwidth"]])
def test_help_exits_0(capsys, command: list[str]) -> None:
    assert main(command + ["--help"]) == 0
    assert "usage" in capsys.readouterr().out


def test_python_dash_m_sim_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "ddloco.sim", "bandwidth"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Decoupled DiLoCo" in proc.stdout and "assumptions" in proc.stdout


def test_json_stays_strict_when_a_figure_is_undefined(capsys) -> None:
    """No slow learners and one seed: undefined means and CIs are null, not NaN."""
    assert main(["hetero", "--json", "--slow-fraction", "0", "--seeds", "1",
                 "--rounds", "50"]) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text
    out = json.loads(text)
    assert out["policies"][0]["included_slow"] == {"mean": None, "ci95": None}
