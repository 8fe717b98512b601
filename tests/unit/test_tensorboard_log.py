"""`ddloco up --tensorboard DIR`: one clear line and exit 2 without the package; eval/loss
against tokens in DIR's event files with it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddloco import cli
from ddloco.tensorboard_log import EVAL_LOSS_TAG, MISSING, TensorBoardLog, tensorboard_missing

pytestmark = pytest.mark.timeout(60)


def test_up_with_tensorboard_but_no_package_exits_2_with_one_line_before_starting_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    monkeypatch.chdir(tmp_path)
    assert tensorboard_missing() == MISSING
    rc = cli.main(["up", "--tensorboard", str(tmp_path / "tb"), "--learners", "1", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == ("ddloco up --tensorboard needs the tensorboard package: "
                   "pip install 'decoupled-diloco[tensorboard]'\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing may start (no runs/, no tb/)"


def test_eval_loss_is_written_with_tokens_as_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the optional tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    with TensorBoardLog(tmp_path / "tb") as log:
        log.add_eval(0, 5.5)
        log.add_eval(40_960, 3.25)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Tags()["scalars"] == [EVAL_LOSS_TAG]
    assert [(e.step, e.value) for e in events.Scalars(EVAL_LOSS_TAG)] == [(0, 5.5), (40_960, 3.25)]
