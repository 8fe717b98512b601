"""The learner's step-time estimate, which the shards space their rounds by."""
from __future__ import annotations

import pytest

from learner.core import STEP_TIME_WARMUP, step_time_estimate


def _run(times: list[float]) -> list[float]:
    ema, out = 0.0, []
    for seen, t in enumerate(times):
        ema = step_time_estimate(ema, t, seen)
        out.append(ema)
    return out


def test_the_first_step_is_left_out_and_the_next_ones_averaged_before_the_ema() -> None:
    """A slow first step (AdamW's moments allocated, fresh memory touched) must not make the
    shards think a step takes longer than it does: 3.4 s then 0.6 s steps read 0.6 s at once."""
    est = _run([3.4] + [0.6] * STEP_TIME_WARMUP)
    assert est[0] == 0.0                                   # no estimate yet: the shards keep theirs
    assert all(e == pytest.approx(0.6) for e in est[1:])
    est = _run([3.4, 0.5, 0.7, 0.9])
    assert est[-1] == pytest.approx(0.7)                   # a plain mean while warming up
    est = _run([3.4] + [0.6] * STEP_TIME_WARMUP + [1.6])
    assert est[-1] == pytest.approx(0.9 * 0.6 + 0.1 * 1.6)  # then an EMA (0.9)
