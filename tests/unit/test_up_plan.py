"""What `ddloco up` starts, from its options alone (ddloco/up_plan.py: no process, port or file)."""
import itertools

import pytest

from ddloco.up_plan import plan_up

pytestmark = pytest.mark.timeout(30)


def _plan(**kw):
    ports = itertools.count(9000)
    args = dict(learners=3, syncers=2, steps=50, config_path="runs/r/config.toml", insecure=False,
                port=lambda: next(ports), cpu_count=8, python="py")
    return plan_up(**{**args, **kw})


def test_every_daemon_gets_a_metrics_port_in_start_order_and_learners_share_the_cpus():
    plan = _plan(extra_learners=2)
    assert plan.learner_ids == ("learner-0", "learner-1", "learner-2") and plan.extra_ids == ("extra-0", "extra-1")
    assert list(plan.metrics_ports.items()) == [
        ("broker", 9000), ("shard0", 9001), ("shard1", 9002), ("learner-0", 9003), ("learner-1", 9004),
        ("learner-2", 9005), ("extra-0", 9006), ("extra-1", 9007)]
    assert plan.metrics_urls["shard1"] == "http://127.0.0.1:9002/metrics"
    assert plan.threads_per_learner == 2 and _plan(cpu_count=2).threads_per_learner == 1
    assert _plan(learner_threads=5).threads_per_learner == 5       # up --learner-threads
    assert "--threads" in (argv := _plan(learner_threads=5).learner_argv("learner-0", 0)) \
        and argv[argv.index("--threads") + 1] == "5"
    assert dict(plan.slots["learner-1"]) == {"index": 1, "slowdown": None, "metrics_port": 9004}
    assert "extra-0" not in plan.slots   # a temporary learner has no slot: never replaced


def test_a_learner_argv_carries_its_slot_the_budget_and_the_step_time_floor():
    plan = _plan(slowdowns=[1.0, 3.0], step_time_floor_ms=25.0)
    common = ["--config", "runs/r/config.toml", "--log-format", "json"]
    assert plan.learner_argv("learner-2", 2) == [
        "py", "-m", "ddloco", "learner", *common, "--learner-id", "learner-2", "--data-shard", "2",
        "--threads", "2", "--steps", "50", "--slowdown", "1.0", "--step-time-floor-ms", "25.0",
        "--metrics-host", "127.0.0.1", "--metrics-port", "9005"]
    standby = plan.learner_argv("standby", 0)   # the standby factory: no slot, no metrics port of its own
    assert "--slowdown" not in standby and "--metrics-port" not in standby and standby[-2:] == ["--step-time-floor-ms", "25.0"]


def test_the_broker_and_shards_argv_and_insecure_reaches_every_daemon():
    plan = _plan(insecure=True)
    common = ["--config", "runs/r/config.toml", "--log-format", "json", "--insecure"]
    assert plan.broker_argv(xsub_bind="tcp://127.0.0.1:1", xpub_bind="tcp://127.0.0.1:2", run_id="r", fragments=4,
                            max_message_mb=1.5) == [
        "py", "-m", "ddloco", "broker", *common, "--xsub", "tcp://127.0.0.1:1", "--xpub", "tcp://127.0.0.1:2",
        "--run-id", "r", "--shards", "2", "--fragments", "4", "--max-message-mb", "1.5",
        "--metrics-host", "127.0.0.1", "--metrics-port", "9000"]
    assert plan.shard_argv(1) == ["py", "-m", "ddloco", "syncer", *common, "--shard", "1", "--shards", "2",
                                  "--metrics-host", "127.0.0.1", "--metrics-port", "9002"]
    assert "--insecure" in plan.learner_argv("learner-0", 0)


def test_learners_are_forked_only_on_a_cpu_machine_with_no_gpu_visible():
    """A GPU machine running CPU learners: the forks' first backward failed there (autograd's
    device threads, started in the standby), so each learner starts as its own process."""
    from ddloco.up_plan import forks_learners
    assert forks_learners(has_fork=True, device="cpu", cuda_visible=False)
    assert not forks_learners(has_fork=True, device="cpu", cuda_visible=True)
    assert not forks_learners(has_fork=True, device="cuda", cuda_visible=True)
    assert not forks_learners(has_fork=False, device="cpu", cuda_visible=False)
