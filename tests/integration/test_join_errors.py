"""A learner that cannot join a run says why, and says it soon: real Redis, real Learner objects."""
from __future__ import annotations

import dataclasses
import threading

import pytest
from structlog.testing import capture_logs

from common import control
from common.config import Endpoints, LearnerOptions, RunConfig, TaskConfig
from common.keys import Keys
from learner.core import Learner, LearnerRefused
from common.task import hash_data
from tests.conftest import tiny_task, wait_until

pytestmark = pytest.mark.timeout(30)


def test_learner_waiting_for_an_unknown_run_id_warns_within_5_s_naming_the_runs_there(redis_server):
    r = control.connect(redis_server.url)
    control.publish_run_config(r, Keys("exp-1"), RunConfig())          # the run the operator meant
    stop = threading.Event()
    errors: list[BaseException] = []

    def join() -> None:
        try:
            learner.prepare()
        except BaseException as e:   # RunConfigMissing once stopped: surfaced below
            errors.append(e)

    with capture_logs() as logs:
        learner = Learner(endpoints=Endpoints(run_id="exp1", redis_url=redis_server.url),
                          options=LearnerOptions(learner_id="l0", join_timeout_s=120.0), task=tiny_task(), stop=stop)
        t = threading.Thread(target=join, daemon=True)
        t.start()
        try:
            warning = wait_until(lambda: next((e for e in logs if e["event"] == "learner.run_config_missing"), None),
                                 timeout_s=5.0, what="a learner.run_config_missing warning within 5 s")
        finally:
            stop.set()
            t.join(5.0)
    assert warning["log_level"] == "warning"
    assert warning["detail"] == (f"no run config for run id 'exp1' in Redis at {redis_server.url} yet: is the run "
                                 "id right? runs seen there: exp-1"), warning
    assert [type(e).__name__ for e in errors] == ["RunConfigMissing"], errors
    assert "runs seen there: exp-1" in str(errors[0])


def test_learner_whose_data_differs_from_the_runs_is_refused_naming_both_digests_and_sources(redis_server):
    r = control.connect(redis_server.url)
    keys = Keys("data")
    run_task = dataclasses.replace(tiny_task(), data_digest=hash_data(b"the run's corpus"),
                                   data_source="Python 3.11's standard library")
    this_task = dataclasses.replace(tiny_task(), data_digest=hash_data(b"another corpus"),
                                    data_source="Python 3.12's standard library")
    started = RunConfig(task=TaskConfig(spec="", name="tiny", data_digest=run_task.data_digest,
                                        data_source=run_task.data_source))
    control.publish_run_config(r, keys, started)
    learner = Learner(endpoints=Endpoints(run_id="data", redis_url=redis_server.url),
                      options=LearnerOptions(learner_id="l0", join_timeout_s=5.0), task=this_task)
    with pytest.raises(LearnerRefused) as refused:
        learner.prepare()
    assert str(refused.value) == (
        f"refused: data digest differs: run has {run_task.data_digest}, this process has {this_task.data_digest} "
        "(its data: Python 3.12's standard library; the run's: Python 3.11's standard library)")
    # the same task with the run's data joins
    same = Learner(endpoints=Endpoints(run_id="data", redis_url=redis_server.url),
                   options=LearnerOptions(learner_id="l1", join_timeout_s=5.0), task=run_task)
    same.prepare()
    assert same.run_cfg.digest() == started.digest()


def test_learner_started_while_redis_is_down_waits_for_it_and_joins(tmp_path):
    """A learner started during a Redis restart (an operator's, or `up --chaos`'s) says so and
    joins once Redis answers, instead of exiting with a ConnectionError."""
    from common.redis_server import EmbeddedRedis, free_port
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    stop = threading.Event()
    errors: list[BaseException] = []

    def join() -> None:
        try:
            learner._redis_patient(learner._join_control, "join")
        except BaseException as e:
            errors.append(e)

    with capture_logs() as logs:
        learner = Learner(endpoints=Endpoints(run_id="later", redis_url=url),
                          options=LearnerOptions(learner_id="l0"), task=tiny_task(), stop=stop)
        t = threading.Thread(target=join, daemon=True)
        t.start()
        try:
            wait_until(lambda: any(e["event"] == "learner.redis_unavailable" for e in logs), timeout_s=10.0,
                       what="the learner saying Redis is unavailable")
            with EmbeddedRedis(port=port) as srv:
                control.publish_run_config(control.connect(srv.url), Keys("later"), RunConfig())
                t.join(20.0)
                assert not t.is_alive() and errors == [], errors
                assert learner.redis is not None and learner.run_cfg.algo.fragments == RunConfig().algo.fragments
        finally:
            stop.set()
            t.join(5.0)
