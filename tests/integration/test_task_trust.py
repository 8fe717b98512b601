"""Nothing a member writes into Redis is imported as code: a process joining without --task loads
the run's task only when it is a built-in or allowed on its own machine (real Redis, real processes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import common.task as contract
from common import control
from common.config import RunConfig, TaskConfig
from common.keys import Keys
from tests.conftest import start_hand_daemons, stop_processes

pytestmark = pytest.mark.timeout(240)

EVIL_MODULE = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")
from tests.conftest import tiny_task
def task():
    return tiny_task()
"""


def _plant(r, run_id: str, spec: str, args: dict | None = None) -> None:
    """What a compromised learner can do with the run's Redis user: rewrite the stored spec."""
    keys = Keys(run_id)
    blob = r.hget(keys.config, "blob")
    doc = json.loads(blob) if blob else {"digest": "x", "config": RunConfig().to_dict(), "created_at": 0}
    doc["config"]["task"]["spec"] = spec
    doc["config"]["task"]["args"] = args or {}
    r.hset(keys.config, "blob", json.dumps(doc))


def _cmd(*argv: str, env: dict[str, str], cwd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddloco", *argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_a_task_spec_planted_in_redis_is_never_imported_by_a_learner_or_export(tmp_path, redis_server, monkeypatch):
    marker = tmp_path / "pwned"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "evilmod.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mods), os.getcwd()]), "DDLOCO_INSECURE": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("DDLOCO_TASKS_ALLOWED", None)
    r = control.connect(redis_server.url)
    net = ["--redis-url", redis_server.url, "--run-id", "evil"]
    for spec, args in (("evilmod:task", {}), ("os:system", {"command": f"touch {marker}"})):
        _plant(r, "evil", spec, args)
        learner = _cmd("learner", *net, "--insecure", "--learner-id", "l0", env=env, cwd=str(mods))
        assert learner.returncode == 2, learner.stderr[-2000:]
        assert learner.stderr.strip().splitlines()[-1] == (
            f"ddloco learner: refused to import the run's task {spec!r}: the run config (in Redis, writable by any "
            f"member) names it, and this machine imports only built-in tasks and the ones it names itself; if you "
            f"trust it, pass --task {spec} or set DDLOCO_TASKS_ALLOWED={spec}"), learner.stderr[-2000:]
        export = _cmd("export", *net, "--out", str(tmp_path / "m.safetensors"), env=env, cwd=str(mods))
        assert export.returncode == 2, export.stderr[-2000:]
        assert export.stderr.strip().startswith(f"ddloco export: refused to import the run's task {spec!r}")
        assert not marker.exists(), "the planted task ran"
    # the machine's own allow-list lets it in (so the marker above would have shown an import)
    _plant(r, "evil", "evilmod:task")
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.setattr(contract, "_allowed_specs", frozenset())
    contract.allow_tasks("ddloco.tasks.gpt:gpt, evilmod:task".split(","))   # as DDLOCO_TASKS_ALLOWED is read
    task, _ = contract.bind_task(control.fetch_run_config(r, Keys("evil")), shared=True)
    assert task.name == "tiny" and marker.exists()


def test_task_args_from_the_run_config_must_be_plain_values(monkeypatch):
    run = RunConfig(task=TaskConfig(spec="digits", args={"batch_size": {"__import__": "os"}}))
    with pytest.raises(contract.TaskNotAllowed, match="task args batch_size of 'digits'"):
        contract.bind_task(run, shared=True)
    monkeypatch.setattr(contract, "_allowed_specs", frozenset())
    assert contract.task_allowed("digits") and contract.task_allowed("ddloco.tasks.digits:digits")
    assert not contract.task_allowed("os:system")
    contract.allow_tasks(["mine:task "])
    assert contract.task_allowed("mine:task")


def test_a_learner_and_export_without_task_still_join_a_run_of_a_built_in_task(tmp_path, redis_server):
    d = start_hand_daemons(tmp_path, redis_server.url, "builtin")
    env = {k: v for k, v in d.env.items() if k != "DDLOCO_TASKS_ALLOWED"}
    try:
        learner = subprocess.run([sys.executable, "-m", "learner", *d.net, "--learner-id", "b0", "--steps", "4"],
                                 env=env, capture_output=True, text=True, timeout=180)
        assert learner.returncode == 0, learner.stderr[-2000:]
        out = tmp_path / "m.safetensors"
        export = _cmd("export", "--redis-url", redis_server.url, "--run-id", "builtin", "--out", str(out),
                      env=env, cwd=str(tmp_path))
        assert export.returncode == 0, export.stderr[-2000:]
        assert out.exists()
    finally:
        stop_processes(d.procs)


def test_a_process_bringing_its_own_task_records_no_unchecked_spec_from_redis(monkeypatch):
    """A shard or learner given --task joins a run whose stored spec it never imports: it does not
    record that spec as its own (its checkpoints, which `ddloco export --checkpoint-dir` trusts,
    never carry a spec nobody checked); a spec it allows is kept."""
    from tests.conftest import tiny_task
    monkeypatch.setattr(contract, "_allowed_specs", frozenset())
    planted = RunConfig(task=TaskConfig(spec="os:system", name="tiny"))
    _, bound = contract.bind_task(planted, tiny_task(), shared=True)
    assert bound.task.spec == ""
    contract.allow_tasks(["mine:task"])
    _, bound = contract.bind_task(RunConfig(task=TaskConfig(spec="mine:task", name="tiny")), tiny_task(), shared=True)
    assert bound.task.spec == "mine:task"
