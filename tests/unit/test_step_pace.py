"""learner/pace.py: the record of the run token counts the learning-rate schedule reads, and the
loss EMA, at fixed inputs."""
from __future__ import annotations

import threading

import pytest
import torch

from common.config import AlgoConfig, LearnerOptions
from common.log import get_logger
from learner.pace import StepPace
from learner.stats import LearnerStats

pytestmark = pytest.mark.timeout(30)


def _pace() -> StepPace:
    algo = AlgoConfig(lr_warmup_tokens=1000, lr_schedule="constant")
    return StepPace(stats=LearnerStats(), options=LearnerOptions(), algo=algo, log=get_logger("test"),
                    stop=threading.Event())


def test_a_schedule_read_below_the_highest_is_a_counted_regression_until_it_catches_up() -> None:
    pace = _pace()
    pace.note_schedule_tokens(500.0)
    pace.note_schedule_tokens(250.0)
    pace.note_schedule_tokens(100.0)
    assert (pace.stats.schedule_tokens, pace.stats.schedule_regressions) == (500.0, 2)
    assert pace._schedule_dip == (2, pytest.approx(0.2))       # lowest lr ratio: 100 / 500 tokens of warm-up
    pace.note_schedule_tokens(600.0)
    assert (pace.stats.schedule_tokens, pace.stats.schedule_regressions, pace._schedule_dip) == (600.0, 2, None)


def test_the_loss_ema_starts_at_the_first_loss_then_moves_by_five_percent() -> None:
    pace = _pace()
    pace.note_loss(torch.tensor(2.0))
    pace.note_loss(torch.tensor(4.0))
    assert pace.stats.loss_ema == pytest.approx(0.95 * 2.0 + 0.05 * 4.0)
