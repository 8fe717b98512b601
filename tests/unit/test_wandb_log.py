"""`ddloco up --wandb PROJECT` without the wandb package: one clear line and exit 2, before
anything starts (the run itself: tests/integration/test_wandb_run.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddloco import cli
from ddloco.wandb_log import MISSING, wandb_missing

pytestmark = pytest.mark.timeout(60)


def test_up_with_wandb_but_no_package_exits_2_with_one_line_before_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    monkeypatch.chdir(tmp_path)
    assert wandb_missing() == MISSING
    rc = cli.main(["up", "--wandb", "proj", "--learners", "1", "--steps", "1", "--report", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == "ddloco up --wandb needs the wandb package: pip install 'decoupled-diloco[wandb]'\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing may start (no runs/, no report dir)"


@pytest.mark.parametrize("mode, project, why", [
    ("offline", "a/b", "Invalid project name 'a/b'"),
    ("online", "proj", "No API key configured"),   # no `wandb login` (a fresh HOME), no WANDB_API_KEY
])
def test_a_wandb_run_that_cannot_start_is_one_line_exit_2_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        mode: str, project: str, why: str) -> None:
    pytest.importorskip("wandb", reason="the optional wandb package is not installed")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name, value in {"HOME": tmp_path / "home", "WANDB_CONFIG_DIR": tmp_path / "cfg", "WANDB_DIR": tmp_path / "wb",
                        "WANDB_MODE": mode, "WANDB_SILENT": "true", "NETRC": tmp_path / "netrc"}.items():
        monkeypatch.setenv(name, str(value))
    rc = cli.main(["up", "--task", "digits", "--wandb", project, "--learners", "1", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"ddloco up: --wandb {project}: wandb could not start a run: "
                                                          f"{why}"), err
    assert "WANDB_MODE=offline" in err
    assert not (tmp_path / "runs").exists(), "nothing may start"
