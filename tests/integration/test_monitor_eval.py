"""``ddloco up``'s monitor evaluates the global model off its control loop."""
from __future__ import annotations

import threading

import pytest

from common import control
from common.config import ConfigFile, Endpoints, RunConfig, UpOptions
from common.keys import Keys
from tests.conftest import tiny_task, wait_until

pytestmark = pytest.mark.timeout(60)


def test_a_slow_evaluation_never_holds_the_control_loop(redis_server, monkeypatch) -> None:
    import ddloco.monitor as mon
    release, started = threading.Event(), threading.Event()
    calls = []

    def slow_fetch(r, keys, n, **kw):        # the shards' reply path, held until released
        calls.append(n)
        started.set()
        release.wait(30)
        raise TimeoutError("held by the test")
    monkeypatch.setattr(mon, "fetch_fragments", slow_fetch)
    cfg = ConfigFile(run=RunConfig(), endpoints=Endpoints(run_id="m", redis_url=redis_server.url),
                     up=UpOptions(eval_every_s=0.0))
    r = control.connect(redis_server.url)
    lines: list[str] = []
    monitor = mon.Monitor(cfg, r, Keys("m"), tiny_task(), learner_ids=["a"], say=lines.append)
    monitor.tick()                                   # starts an evaluation, returns at once
    wait_until(started.is_set, 10, what="the evaluation to start on its thread")
    for _ in range(3):                               # the loop goes on; no second evaluation piles up
        monitor.tick()
    assert calls == [len(monitor.plan)] and monitor._eval_thread.is_alive()
    release.set()
    monitor.wait_evaluation(10)
    assert not monitor._eval_thread.is_alive()
    assert any("eval       skipped: held by the test" in line for line in lines), lines
