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
    control.register_shard(pipe, keys, 0, {"status": "running", "merges": 3, "dropped": 0, "rpc": "tcp://127.0.0.1:7000",
                                           "shards": 1})
    pipe.hset(keys.fragment(2), mapping={"version": 3, "shard": 0, "round": 1})
    pipe.execute()
    control.sync_members(r, keys)   # the shard's control refresh: membership from the heartbeats


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


def test_status_names_a_fragment_that_stopped_merging_what_it_holds_and_why(redis_server, capsys):
    """The global model's last evaluation (written by `up`'s monitor), when there is one. Three fragments merged 10 times, one is still at version 0 and its shard recorded why: `ddloco
    status` prints a WARNING naming the fragment, its tensors (from the run's recorded layout) and
    the reason; a fragment within a few versions of the others is not named."""
    from ddloco.cli import main
    from common.fragments import plan_layout, plan_fragments, TensorSpec
    r = control.connect(redis_server.url)
    keys = Keys("lagging")
    control.publish_run_config(r, keys, RunConfig(algo=AlgoConfig(fragments=4)))
    specs = [TensorSpec("conv.weight", (64, 8)), TensorSpec("bn.num_batches_tracked", (), "int_buffer"),
             TensorSpec("fc.weight", (64, 8)), TensorSpec("fc.bias", (8,))]
    plan = plan_fragments(specs, 4, align=64)
    control.record_layout(r, keys, plan_layout(plan))
    stuck = next(f.index for f in plan if any(q.kind == "int_buffer" for q in f.pieces))
    for p in range(4):
        r.hset(keys.fragment(p), mapping={"version": 0 if p == stuck else 10 - (p == (stuck + 1) % 4) * 2,
                                          "shard": 0, "round": -1})
    r.hset(keys.fragment(stuck), mapping={"problem": "every answer dropped by the norm bound", "failed_rounds": 9})
    assert main(["status", "--insecure", "--redis-url", redis_server.url, "--run-id", "lagging"]) == 0
    assert "global model: not evaluated yet" in capsys.readouterr().out
    r.hset(keys.eval, mapping={"loss": 0.5, "initial_loss": 2.3, "tokens": 1234, "at": time.time()})
    assert main(["status", "--insecure", "--redis-url", redis_server.url, "--run-id", "lagging"]) == 0
    out = capsys.readouterr().out
    assert "global model: eval loss 0.5000 (initial 2.3000) at 1,234 tokens" in out, out
    warnings = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, out
    assert f"fragment {stuck} " in warnings[0] and "bn.num_batches_tracked (int_buffer)" in warnings[0], warnings
    assert "every answer dropped by the norm bound; 9 rounds failed" in warnings[0], warnings


def test_lagging_fragments_are_far_behind_the_median_only():
    from ddloco.status import lagging_fragments
    assert lagging_fragments({0: 0, 1: 2, 2: 2, 3: 1}) == []          # early: nobody is behind yet
    assert lagging_fragments({0: 0, 1: 10, 2: 9, 3: 11}) == [0]
    assert lagging_fragments({0: 40, 1: 60, 2: 58, 3: 61}) == []       # slower, not stopped
    assert lagging_fragments({0: 20, 1: 60, 2: 58, 3: 61}) == []       # behind, but still merging
    assert lagging_fragments({0: 20, 1: 60, 2: 58, 3: 61}, {0: 4}) == [0]   # behind, and its rounds fail
    assert lagging_fragments({0: 10, 1: 60, 2: 58, 3: 61}) == [0]      # below a quarter of the median
    assert lagging_fragments({0: 3, 1: 7, 2: 8, 3: 7}) == []           # a short run's slower fragment


def test_a_run_that_did_not_train_says_why():
    from ddloco.monitor import Monitor
    ok = {"fragments_never_merged": [], "fragments_lagging": {}, "eval_loss_initial": 2.3, "eval_loss_final": 0.2}
    assert Monitor.problems(ok) == []
    bad = {**ok, "fragments_never_merged": [12, 13], "eval_loss_final": 2.4,
           "fragments_lagging": {"12": "fragment 12 ...", "5": "fragment 5 (holds x) is at version 1 ..."}}
    assert Monitor.problems(bad) == ["fragment(s) 12, 13 never merged (their values are the initial model's)",
                                     "fragment 5 (holds x) is at version 1 ...",
                                     "the final model's eval loss 2.4000 is not below the initial 2.3000"]


def test_watch_into_a_file_writes_every_view_as_it_is_drawn(redis_server, tmp_path):
    """`ddloco status --watch > file` (no terminal): each refresh is in the file at once, so a
    view stopped by a signal leaves what it showed (before, the file stayed empty)."""
    import os
    import subprocess
    import sys
    from tests.conftest import wait_until
    _a_run_in_redis(redis_server.url, "watched")
    out = tmp_path / "status.txt"
    with open(out, "w") as fh:
        p = subprocess.Popen([sys.executable, "-m", "ddloco", "status", "--insecure", "--redis-url", redis_server.url,
                              "--run-id", "watched", "--watch", "0.1"], stdout=fh, stderr=subprocess.STDOUT,
                             env={**os.environ, "COLUMNS": "140"})
        try:
            wait_until(lambda: out.read_text().count("alpha-learner") >= 2, 30, interval_s=0.05,
                       what="two views in the file while the watch runs")
        finally:
            p.terminate()
            p.wait(timeout=10)
    assert "beta-learner" in out.read_text()
