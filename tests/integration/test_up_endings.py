"""How `ddloco up` ends and starts again, as a user runs it (real processes, real signals): Ctrl-C
keeps the model, an unwritable --report is refused before anything starts, every run gets its
own run id, and --resume names exactly one stopped run or refuses, creating nothing."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
CNN = ("--task", "examples.cnn:task", "--learners", "2", "--syncers", "1")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
"""These runs work in their own directory (runs/ there); the task module is found on PYTHONPATH."""


def ddloco(*args: str, cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddloco", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=ENV)


def test_ctrl_c_saves_the_freshest_model_loadable_strict_and_exits_130(tmp_path):
    report = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "ddloco", "up", *CNN, "--steps", "0", "--minutes", "2",
                             "--step-time-floor-ms", "20", "--report", str(report)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any(re.search(r"\| merges [1-9]", ln) for ln in lines), 60,
                   what="progress showing merges")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    out = "".join(lines)
    # no --run-id: a run id of its own, shown at start and in the summary, naming the work directory
    run_id = re.search(r"^run +(demo-[0-9a-f]{6}): ", out, re.M).group(1)
    assert re.search(rf"^interrupted run {run_id}: ", out, re.M), out[-1500:]
    run_dir, = (tmp_path / "runs").glob(f"{run_id}-*")
    from ddloco.export import from_checkpoints, load_state
    from examples.cnn import task
    from common.task import evaluate
    t = task()
    model = t.model()
    model.load_state_dict(load_state(report / "model.safetensors"), strict=True)
    # the freshest complete model: what the shards checkpointed as they stopped
    stopped, versions = from_checkpoints(run_dir / "checkpoints", run_id, task=t)
    assert sum(versions.values()) > 0
    assert all(torch.equal(v, stopped.state_dict()[k]) for k, v in model.state_dict().items())
    rep = json.loads((report / "report.json").read_text())
    assert rep["interrupted"] is True and rep["run_id"] == run_id
    assert abs(evaluate(t, model) - rep["eval_loss_final"]) < 1e-4   # the report describes this model
    assert json.loads((run_dir / "state.json").read_text())["versions_total"] == sum(versions.values())


def _immutable_dir(tmp_path: Path) -> Path:
    d = tmp_path / "frozen"
    d.mkdir()
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE and ext4/xfs)")
    return d


@pytest.mark.parametrize("where", ["under a regular file", "immutable directory"])
def test_an_unwritable_report_dir_is_one_line_exit_2_before_anything_starts(tmp_path, where):
    # root ignores permission bits: a path below a regular file (ENOTDIR), and a directory made
    # immutable with chattr +i (EPERM), stop root too
    work = tmp_path / "work"
    work.mkdir()
    if where == "under a regular file":
        (tmp_path / "afile").write_text("")
        target = tmp_path / "afile" / "report"
    else:
        target = _immutable_dir(tmp_path)
    try:
        res = ddloco("up", *CNN, "--steps", "5", "--report", str(target), cwd=work)
    finally:
        if where == "immutable directory":
            subprocess.run(["chattr", "-i", str(target)], check=True)
    assert res.returncode == 2, res.stdout[-1500:] + res.stderr[-1500:]
    problem = "Not a directory" if where == "under a regular file" else "Operation not permitted"
    assert res.stderr.startswith(f"ddloco up: --report {target}: cannot write the report there ({problem}")
    assert res.stderr.count("\n") == 1 and res.stdout == "", res.stdout + res.stderr
    assert list(work.iterdir()) == [], "a refused run started something"   # no runs/ directory
    assert not target.exists() or list(target.iterdir()) == []              # the probe file was removed


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Two stopped, resumable runs with the same run id ``twin`` (the second a copy of the first,
    as if run again later): the working directory and the two work directories."""
    cwd = tmp_path_factory.mktemp("twins")
    first = ddloco("up", *CNN, "--steps", "8", "--run-id", "twin", cwd=cwd)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    one, = (cwd / "runs").glob("twin-*")
    two = cwd / "runs" / "twin-20990101-000000"
    shutil.copytree(one, two)
    return cwd, one, two


def test_resume_of_an_ambiguous_missing_or_mismatched_run_is_refused_and_creates_nothing(twin_runs):
    cwd, one, two = twin_runs
    before = sorted((cwd / "runs").iterdir())
    res = ddloco("up", "--resume", "twin", "--steps", "4", cwd=cwd)
    assert res.returncode == 2, res.stdout[-1500:] + res.stderr[-1500:]
    head, *candidates = res.stderr.splitlines()
    assert head == "ddloco up: --resume twin: 2 stopped runs have run id 'twin'; pick one by passing its directory:"
    state = json.loads((one / "state.json").read_text())
    assert sorted(c.split("   (")[0] for c in candidates) == [f"  --resume {one.relative_to(cwd)}",
                                                               f"  --resume {two.relative_to(cwd)}"], candidates
    assert all(f"versions {state['versions_total']}, {state['tokens_total']:,} tokens" in c for c in candidates)
    for argv, line in [(("--resume", "nope"), "ddloco up: --resume nope: no stopped run 'nope' with checkpoints "
                                              "under runs/"),
                       (("--resume", str(two), "--syncers", "2"), "ddloco up: --resume: the run had 1 syncers")]:
        res = ddloco("up", *argv, "--steps", "4", cwd=cwd)
        assert res.returncode == 2 and res.stderr.startswith(line), res.stdout[-1500:] + res.stderr[-1500:]
        assert res.stderr.count("\n") == 1, res.stderr
    assert sorted((cwd / "runs").iterdir()) == before, "a refused resume left a directory behind"


def test_resume_given_a_run_directory_continues_that_run(twin_runs):
    cwd, one, two = twin_runs
    state, other = json.loads((two / "state.json").read_text()), (one / "state.json").read_text()
    res = ddloco("up", "--resume", str(two.relative_to(cwd)), "--steps", "4", "--report", "r2", cwd=cwd)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rep = json.loads((cwd / "r2" / "report.json").read_text())
    assert rep["run_id"] == "twin" and rep["resumed_from"] == str(two.relative_to(cwd))
    assert rep["eval_curve"][0]["versions_total"] == state["versions_total"]
    assert json.loads((two / "state.json").read_text())["tokens_total"] > state["tokens_total"]
    assert (one / "state.json").read_text() == other, "the other run of the same id was changed"
