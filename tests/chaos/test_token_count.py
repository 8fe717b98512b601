"""Chaos: Redis restarts empty while learners train on the run's token count (real processes)."""
from __future__ import annotations

import contextlib
import json

import pytest
import redis

from common import control
from common.keys import Keys
from tests.chaos.test_learner_faults import TINY, Daemons
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(150)

STEPS = 300
TOKENS_PER_STEP = 4 * 16        # TINY_TOML: batch_size × seq_len
WARMUP_TOKENS = 100_000
"""Longer than the run (2 × 300 × 64 tokens): the schedule stays in its warm-up, the LR ∝ the count."""


def _log_events(path, name: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if isinstance(e, dict) and e.get("event") == name:
                out.append(e)
    return out


def test_redis_restarting_empty_twice_loses_no_token_and_no_learning_rate_goes_back(tmp_path, redis_server):
    """Two learners on a warm-up schedule, Redis killed and restarted empty twice while they
    train: at the end the run's counter equals the sum of the learners' own token counts exactly,
    and no learner's schedule ever read a count below one it had used (its LR never went back)."""
    d = Daemons(tmp_path, redis_server.url)
    d.cfg.write_text(TINY.replace("[algo]\n", "[algo]\nlr_schedule = \"constant\"\n"
                                              f"lr_warmup_tokens = {WARMUP_TOKENS}\n"))
    keys = Keys("chaos")
    r = control.connect(redis_server.url)

    def steps(n: str) -> int:
        try:
            return int(r.hget(keys.learner(n), "steps") or 0)
        except redis.RedisError:      # Redis is restarting
            return 0

    def counter() -> int:
        return int(r.get(keys.tokens) or 0)
    learners = ("a", "b")
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        d.start("syncer", "syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck"))
        for i, n in enumerate(learners):
            d.start(n, "learner", *d.net, "--config", str(d.cfg), "--learner-id", n, "--data-shard", str(i),
                    "--steps", str(STEPS))
        for at in (STEPS // 4, STEPS // 2):       # twice during training
            wait_until(lambda: all(steps(n) >= at for n in learners), 120, interval_s=0.05,
                       what=f"both learners past step {at}")
            assert all(steps(n) < STEPS for n in learners), "the learners finished before Redis restarted"
            redis_server.restart_empty()
        for n in learners:
            assert d.procs[n].wait(timeout=90) == 0, f"learner {n} failed"
        expected = len(learners) * STEPS * TOKENS_PER_STEP
        with contextlib.suppress(AssertionError):   # the shard's next refresh has every learner's last tokens
            wait_until(lambda: counter() == expected, 5, interval_s=0.05, what="the run's counter")
        own = {lid: int(h["tokens"]) for (lid, _inc), h in control.learner_lives(r, keys).items()}
        assert own == {n: STEPS * TOKENS_PER_STEP for n in learners}, own
        got = counter()
        assert got == sum(own.values()), (f"the run's counter holds {got} tokens, the learners trained "
                                          f"{sum(own.values())} ({(got - expected) / expected:+.2%})")
        for n in learners:
            went_back = _log_events(tmp_path / f"{n}.log", "learner.schedule_went_back")
            h = r.hgetall(keys.learner(n))
            assert int(h["schedule_regressions"]) == 0 and not went_back, (n, h["schedule_regressions"], went_back)
            assert int(h["schedule_tokens"]) >= STEPS * TOKENS_PER_STEP, h["schedule_tokens"]
    finally:
        d.stop_all()
    assert d.procs["syncer"].returncode == 0
