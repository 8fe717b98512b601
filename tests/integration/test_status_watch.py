"""`ddloco status --watch`: the live view of a run's state in a real Redis."""
from __future__ import annotations

import io
import time

import pytest

from common import control
from common.config import AlgoConfig, RunConfig
from common.keys import Keys

pytestmark = pytest.mark.timeout(60)


def _a_run_in_redis(url: str, run_id: str) -> None:
    """What a running cluster leaves in Redis: the run config, two live learners, a shard, a merged fragment."""
    r = control.connect(url)
    keys = Keys(run_id)
    control.publish_run_config(r, keys, RunConfig(algo=AlgoConfig(fragments=4)))
    pipe = r.pipeline(transaction=False)
    for lid, steps in (("alpha-learner", 12), ("beta-learner", 7)):
        control.beat(pipe, keys, lid, {"status": "training", "steps": steps, "tokens": 16 * steps,
                                       "step_ema_s": 0.01, "loss_ema": 1.25}, ttl_s=30)
    control.register_shard(pipe, keys, 0, {"status": "running", "merges": 3, "dropped": 0, "rpc": "tcp://127.0.0.1:7000"})
    pipe.hset(keys.fragment(2), mapping={"version": 3, "shard": 0, "round": 1})
    pipe.execute()


def test_render_shows_every_learner_and_the_fragments(redis_server):
    from rich.console import Console
    from ddloco.status import collect_status, render
    _a_run_in_redis(redis_server.url, "watched")
    st = collect_status(control.connect(redis_server.url), Keys("watched"))
    console = Console(file=io.StringIO(), width=140, record=True)
    console.print(render(st, updated_at=time.time()))
    text = console.export_text()
    assert "alpha-learner" in text and "beta-learner" in text, text
    assert "training" in text and "2 live learner(s)" in text, text
    assert "versions min 0, median 0, max 3, sum 3; 1 round(s) open" in text, text
    assert "tcp://127.0.0.1:7000" in text and "error" not in text, text


def test_watch_refreshes_count_times_and_shows_a_lost_redis_instead_of_crashing(redis_server, capsys):
    from ddloco.cli import main
    _a_run_in_redis(redis_server.url, "watched")
    argv = ["status", "--insecure", "--redis-url", redis_server.url, "--run-id", "watched", "--watch", "0.05"]
    assert main([*argv, "--count", "2"]) == 0
    out = capsys.readouterr().out
    assert "alpha-learner" in out and "beta-learner" in out, out
    redis_server.stop()   # Redis goes away: the view says so, keeps asking, and the command does not crash
    assert main([*argv, "--count", "1"]) == 1
    out = capsys.readouterr().out
    assert "error: Redis at" in out and "(retrying)" in out, out
    assert main(["status", "--insecure", "--redis-url", redis_server.url, "--run-id", "w", "--watch", "--json"]) == 2
