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
