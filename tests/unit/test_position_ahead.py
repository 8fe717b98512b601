"""learner/position_ahead.py against a real Redis: the position is written before the step, a
far Redis turns ``auto`` to the heartbeat's positions, a lost Redis is skipped for a while and
never stops the step; ``resume_at`` takes the larger of the two fields."""
from __future__ import annotations

import structlog

from common import control, positions
from common.keys import Keys
from common.redis_server import free_port
from learner import position_ahead
from learner.position_ahead import PositionAhead

KEY = Keys("pa").learner("l0")


def _log():
    return structlog.get_logger()


def test_step_mode_writes_every_position_and_resume_takes_the_larger_field(redis_server) -> None:
    w = PositionAhead("step", redis_server.url, KEY, _log())
    r = control.connect(redis_server.url)
    for pos in (3, 4, 5):
        w.write(pos, step_s=1e-6)      # however short the step: "step" always writes
    assert r.hget(KEY, "position_ahead") == "5" and w.written == 3 and w.active
    r.hset(KEY, "data_position", 4)    # the heartbeat lags behind
    assert positions.resume_at(r, Keys("pa"), "l0") == 5
    r.hset(KEY, "data_position", 9)    # a life that left: its final position
    assert positions.resume_at(r, Keys("pa"), "l0") == 9
    w.close()
    assert not w.active


def test_auto_goes_back_to_the_heartbeat_when_a_write_costs_more_than_its_share(redis_server) -> None:
    w = PositionAhead("auto", redis_server.url, KEY, _log())
    for pos in range(position_ahead.AUTO_SAMPLES - 1):
        w.write(pos, step_s=1e-6)      # a write takes far more than 2 % of a microsecond step
    assert w.active                    # not decided before AUTO_SAMPLES writes
    w.write(100, step_s=1e-6)
    assert not w.active
    w.write(200, step_s=1e-6)
    assert control.connect(redis_server.url).hget(KEY, "position_ahead") == "100"
    slow = PositionAhead("auto", redis_server.url, KEY, _log())
    for pos in range(2 * position_ahead.AUTO_SAMPLES):
        slow.write(pos, step_s=10.0)   # a 10 s step: a write is nothing beside it
    assert slow.active and slow.written == 2 * position_ahead.AUTO_SAMPLES


def test_heartbeat_mode_writes_nothing(redis_server) -> None:
    w = PositionAhead("heartbeat", redis_server.url, KEY, _log())
    w.write(7, step_s=1.0)
    assert control.connect(redis_server.url).hget(KEY, "position_ahead") is None and w.written == 0


def test_a_lost_redis_is_skipped_for_a_pause_that_doubles_and_the_step_goes_on() -> None:
    w = PositionAhead("step", f"redis://127.0.0.1:{free_port()}/0", KEY, _log())   # nothing listens
    w.write(1, step_s=0.1)
    assert w.failures == 1 and w.active
    w.write(2, step_s=0.1)             # within the pause: not tried
    assert w.failures == 1
    w._retry_at = 0.0                  # the pause is over
    w.write(3, step_s=0.1)
    assert w.failures == 2 and w._pause_s == 4 * position_ahead.RETRY_MIN_S
