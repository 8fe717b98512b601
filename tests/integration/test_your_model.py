"""Your model, your data: user tasks through `ddloco up`, by hand, the Python API; buffers,
slices, export, resume, and refusals before anything is written."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from common import control
from common.config import AlgoConfig, Endpoints, LearnerOptions, RunConfig
from common.keys import Keys
from common.redis_server import free_port
from common.task import Task, evaluate
from tests.conftest import TINY_TOML, start_guarded, tiny_batches, tiny_loss, wait_until

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]


def _json_or_none(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:
        return None


def ddloco(*args: str, cwd: Path = REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddloco", *args], capture_output=True, text=True, cwd=cwd, **kw)


def test_up_trains_the_example_cnn_and_its_exported_model_scores_the_reported_loss(tmp_path):
    report = tmp_path / "report"
    res = ddloco("up", "--task", "examples.cnn:task", "--learners", "3", "--syncers", "2", "--steps", "150",
                 "--minutes", "4", "--report", str(report), "--run-id", "cnn-e2e", timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rep = json.loads((report / "report.json").read_text())
    from ddloco.export import load_state
    from examples.cnn import task
    t = task()
    model = t.model()
    model.load_state_dict(load_state(report / "model.safetensors"), strict=True)
    loss = evaluate(t, model)   # eval() mode: BatchNorm uses the merged running statistics
    assert abs(loss - rep["eval_loss_final"]) < 1e-4, (loss, rep["eval_loss_final"])
    assert loss <= 0.5 * rep["eval_loss_initial"], (loss, rep["eval_loss_initial"])
    assert rep["every_learner_contributed"] and rep["processes_left"] == []
    assert rep["every_fragment_merged"] and rep["fragments_never_merged"] == [], rep["fragments_never_merged"]
    # honest learners: no claim refused, and no first answer cut even mildly (they come before any
    # step time is known; the scheduler's 0.2 s guess once clamped every one of them). A later
    # answer may be clamped by at most 2 x on a loaded machine (its previous answer reached the
    # shard late: timing noise, counted apart from rejections)
    assert not {"steps_claim", "tokens_claim"} & set(rep["rejections"]), rep["rejections"]
    logs = REPO / re.search(r"logs in (\S+)", res.stdout).group(1)
    clamped = [e for log in sorted(logs.glob("syncer-*.log")) for e in map(_json_or_none, log.read_text().splitlines())
               if e and e.get("event") == "syncer.claims_clamped"]
    assert len(clamped) == rep["claims_clamped"], (len(clamped), rep["claims_clamped"])
    assert [e for e in clamped if e["first"]] == [], clamped
    answers = sum(int(s["answers"]) for s in rep["shard_stats"].values())
    assert rep["claims_clamped"] <= 0.05 * answers, (rep["claims_clamped"], answers)


def test_every_fragment_merges_whatever_it_holds_buffers_only_integer_counters_slices_or_tiny_tensors(tmp_path):
    """P = 24 over a model whose fragments hold slices of one large weight, BatchNorm statistics
    and its integer counter, an integer buffer that grows by the batch size every step and a float
    buffer (fragments of buffers only), a bias and a scalar: every fragment merges. (Before, the
    counters' jumps counted in the outer-gradient norm bound: every answer to those fragments was
    dropped, they kept their initial values, and `up` reported success.)"""
    report = tmp_path / "report"
    res = ddloco("up", "--task", "tests.integration.layout_model:task", "--learners", "2", "--syncers", "2",
                 "--steps", "120", "--step-time-floor-ms", "25", "--fragments", "24", "--minutes", "3",
                 "--report", str(report), "--run-id", "layouts", timeout=200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rep = json.loads((report / "report.json").read_text())
    assert rep["fragments_never_merged"] == [] and rep["every_fragment_merged"], rep["fragments_never_merged"]
    assert rep["fragments_lagging"] == {}, rep["fragments_lagging"]
    assert rep["eval_loss_final"] < 0.3 * rep["eval_loss_initial"], (rep["eval_loss_initial"], rep["eval_loss_final"])
    from ddloco.export import load_state
    from tests.integration.layout_model import task
    model = task().model()
    model.load_state_dict(load_state(report / "model.safetensors"), strict=True)
    assert int(model.seen.min()) > 0 and int(model.norm.num_batches_tracked) > 0   # the counters merged too
    assert float(model.input_mean.abs().sum()) > 0


def test_up_resume_continues_from_the_stopped_versions_and_eval_loss(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    first = ddloco("up", "--config", str(cfg), "--run-id", "again", "--learners", "2", "--syncers", "2",
                   "--steps", "24", "--report", "r1", cwd=tmp_path, timeout=200)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    # the stopped run's checkpoints hold the model its report ended with
    ckpt = next((tmp_path / "runs").glob("again-*/checkpoints"))
    # (--recalibrate-bn on a model without BatchNorm: a note, and the same file as without it)
    exported = ddloco("export", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "offline.safetensors"),
                      "--recalibrate-bn", "3", cwd=tmp_path, timeout=60)
    assert exported.returncode == 0, exported.stderr[-1500:]
    assert ("note: no normalization layer tracks running statistics: nothing to recalibrate (--recalibrate-bn 3 "
            "has no effect)") in exported.stdout, exported.stdout
    from ddloco.export import load_state
    offline, final = load_state(tmp_path / "offline.safetensors"), load_state(tmp_path / "r1" / "model.safetensors")
    assert offline.keys() == final.keys() and all(torch.equal(offline[k], final[k]) for k in final)
    second = ddloco("up", "--resume", "again", "--learners", "2", "--syncers", "2", "--steps", "24",
                    "--report", "r2", cwd=tmp_path, timeout=200)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    r1 = json.loads((tmp_path / "r1" / "report.json").read_text())
    r2 = json.loads((tmp_path / "r2" / "report.json").read_text())
    stopped_at = r1["eval_curve"][-1]
    resumed_at = r2["eval_curve"][0]
    assert stopped_at["versions_total"] > 0
    assert resumed_at["versions_total"] == stopped_at["versions_total"], "versions went back"
    assert resumed_at["loss"] == pytest.approx(stopped_at["loss"], abs=1e-6)
    assert resumed_at["tokens"] == r1["tokens_total"]
    assert r2["eval_curve"][-1]["versions_total"] > stopped_at["versions_total"]
    assert r2["eval_curve_before"] == r1["eval_curve"]
    # the learners went on with their data streams instead of replaying them
    states = list((tmp_path / "runs").glob("again-*/state.json"))
    assert len(states) == 1, states   # next to the checkpoints: the first part's directory
    state = json.loads(states[0].read_text())
    assert state["data_positions"] == {"learner-0": 48, "learner-1": 48}
    # the run's token count (the LR schedule's) went on across the resume: every process's share
    assert sum(state["token_shares"].values()) == r2["tokens_total"] == 2 * r1["tokens_total"]
    # (a second resume reads this state.json, which the second part rewrote: 48, not 24)


class BatchNormNet(torch.nn.Module):
    """5 parameter tensors (+3 BatchNorm buffers): fewer tensors than P = 24 fragments."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.bn(self.fc1(x) * 3.0 + 2.0)))   # stats far from (0, 1)


def _bn_task() -> Task:
    def batches(stream: int, seed: int, start: int):
        it = tiny_batches(stream)
        for _ in range(start):
            next(it)
        return it
    held = [next(tiny_batches(999)) for _ in range(4)]
    return Task(name="bn-net", model=BatchNormNet, batches=batches, loss=tiny_loss, eval_batches=lambda: iter(held))


def test_python_api_trains_a_batchnorm_model_with_more_fragments_than_tensors(redis_server):
    import ddloco
    task = _bn_task()
    ep = Endpoints(run_id="api", redis_url=redis_server.url, broker_pub=f"tcp://127.0.0.1:{free_port()}",
                   broker_sub=f"tcp://127.0.0.1:{free_port()}")
    run = RunConfig(algo=AlgoConfig(fragments=24, sync_every_steps=4, inner_warmup_steps=2, uplink_codec="int8"))
    stop = threading.Event()
    errors: list[BaseException] = []
    threads = [start_guarded(errors, ddloco.run_broker, endpoints=ep, stop=stop)]
    threads += [start_guarded(errors, ddloco.run_shard, task, endpoints=ep, run=run, stop=stop, shard=k, shards=2,
                                options=ddloco.SyncerOptions(checkpoint_dir="", initial_step_time_s=0.02))
                for k in range(2)]
    r = control.connect(ep.redis_url)
    keys = Keys("api")
    wait_until(lambda: len(control.shard_table(r, keys)) == 2 or errors, 30, what="two shards up")
    initial = evaluate(task, ddloco.load_global_model(redis_url=ep.redis_url, run_id="api", task=task))
    opts = dict(max_steps=120, step_time_floor_ms=3, heartbeat_interval_s=0.1)
    learners = [start_guarded(errors, ddloco.train, task, endpoints=ep, run=run,
                        options=LearnerOptions(learner_id=f"l{m}", data_shard=m, **opts)) for m in range(3)]
    wait_until(lambda: int(r.hget(keys.learner("l0"), "steps") or 0) >= 40 or errors, 60, what="mid-run")
    late = start_guarded(errors, ddloco.train, task, endpoints=ep, run=None,   # a 4th learner joins with the run's config
                   options=LearnerOptions(learner_id="late", data_shard=3, **opts))
    for t in learners + [late]:
        t.join(timeout=120)
    assert not errors, errors
    assert int(r.hget(keys.learner("late"), "merged_contributions") or 0) >= 1
    model = ddloco.load_global_model(redis_url=ep.redis_url, run_id="api", task=task)
    stop.set()
    bn = model.bn
    assert not torch.allclose(bn.running_mean, torch.zeros(16), atol=0.3), "running mean never merged"
    assert not torch.allclose(bn.running_var, torch.ones(16), atol=0.3), "running var never merged"
    final = evaluate(task, model)
    assert final <= 0.5 * initial, (initial, final)
    # eval() mode with the merged statistics is as good as train() mode's batch statistics
    model.train()
    with torch.no_grad():
        batch_stats = sum(float(tiny_loss(model, b)) for b in _bn_task().eval_batches()) / 4
    assert final <= 1.5 * batch_stats + 0.05, (final, batch_stats)


def test_bad_tasks_exit_2_with_one_line_and_write_nothing_to_redis(tmp_path, redis_server, monkeypatch, capsys):
    (tmp_path / "badtask.py").write_text(
        "import torch\nfrom ddloco import Task\n"
        "def nan(width: int = 4):\n"
        "    return Task(name='nan', model=lambda: torch.nn.Linear(width, 1),\n"
        "                batches=lambda s, seed, start: iter([torch.ones(2, width)] * 3),\n"
        "                loss=lambda m, b: m(b).sum() * float('nan'))\n"
        "def tiny():\n"
        "    return Task(name='tiny', model=lambda: torch.nn.Linear(2, 1),\n"
        "                batches=lambda s, seed, start: iter([torch.ones(2, 2)] * 3), loss=lambda m, b: m(b).mean())\n"
        "not_a_task = 3\n")
    net = ["--insecure", "--redis-url", redis_server.url, "--run-id", "bad", "--broker-pub", f"tcp://127.0.0.1:{free_port()}",
           "--broker-sub", f"tcp://127.0.0.1:{free_port()}"]
    cases = [("learner", ["--task", "nosuchmodule:task"], "cannot import task module 'nosuchmodule'"),
             ("learner", ["--task", "badtask:not_a_task"], "is a int, not a Task"),
             ("learner", ["--task", "badtask:nan", "--fragments", "2"], "loss of the initial model on the first batch is nan"),
             ("syncer", ["--task", "badtask:tiny"], "cannot split a model of 3 elements (2 tensors) into 24 fragments"),
             ("learner", ["--task", "badtask:nan", "--task-arg", "depth=2"], "takes no task arg(s) depth")]
    from ddloco.cli import main   # in-process (the CLI's own code path; a process each cost ~3 s of imports)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    threads = torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def run(*argv: str) -> tuple[int, str]:
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
        finally:   # what a daemon's main sets for its process
            torch.set_num_threads(threads)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return rc, capsys.readouterr().err
    with monkeypatch.context() as env:
        env.setenv("DDLOCO_TASK", "badtask:tiny")   # compose's way of naming the task
        rc, err = run("syncer", *net)
    assert rc == 2 and "cannot split a model of 3 elements" in err, err[-1500:]
    for command, extra, needle in cases:
        rc, err = run(command, *net, *extra)
        assert rc == 2, (command, extra, err[-1500:])
        assert needle in err and "Traceback" not in err, err[-1500:]
        assert control.connect(redis_server.url).keys("*") == [], f"{extra} wrote to Redis"


def test_a_learner_restarted_at_global_token_count_t_uses_the_scheduled_lr_for_t(make_cluster):
    from learner.inner import lr_at
    algo = AlgoConfig(fragments=2, sync_every_steps=4, inner_warmup_steps=1, lr_schedule="cosine",
                      lr_warmup_tokens=64, lr_decay_tokens=3000, lr_min_ratio=0.1)
    cluster = make_cluster(RunConfig(algo=algo))
    cluster.start_shard(0, 1)
    first = cluster.learner("a", 0, max_steps=60)
    cluster.start_learner(first).join(timeout=60)
    r = control.connect(cluster.endpoints.redis_url)
    # the shard takes the learner's own count in at its next control refresh (0.5 s)
    t_run = wait_until(lambda: int(r.get(Keys(cluster.endpoints.run_id).tokens) or 0) == 60 * 16 and 60 * 16, 5,
                       what="the run's token counter at the learner's tokens")
    again = cluster.learner("a", 0, max_steps=1)      # the same learner restarted: one step
    cluster.start_learner(again).join(timeout=60)
    assert not cluster.errors, cluster.errors
    assert again.stats.lr == pytest.approx(lr_at(algo, t_run, 0)), (again.stats.lr, t_run)
    assert again.stats.lr < 0.9 * lr_at(algo, 64, 0)     # decayed: not the start of the schedule
    assert again.data_position == 60


def test_gradient_accumulation_counts_every_micro_batch_and_its_data_position(make_cluster):
    algo = AlgoConfig(fragments=2, sync_every_steps=4, inner_warmup_steps=1, inner_grad_accum=3, inner_grad_clip=1.0)
    cluster = make_cluster(RunConfig(algo=algo))
    cluster.start_shard(0, 1)
    learner = cluster.learner("acc", 0, max_steps=2, flush_timeout_s=0)
    cluster.start_learner(learner).join(timeout=60)
    assert not cluster.errors, cluster.errors
    assert learner.stats.steps == 2 and learner.stats.tokens == 2 * 3 * 16
    assert learner.data_position == 0 and int(learner._counters()["data_position"]) == 6   # batches, not steps


def test_digits_with_four_learners_exports_a_model_of_at_least_90_percent_accuracy(tmp_path):
    report = tmp_path / "report"
    res = ddloco("up", "--task", "digits", "--learners", "4", "--syncers", "2", "--steps", "150",
                 "--report", str(report), "--run-id", "digits", cwd=tmp_path, timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    from ddloco.export import load_state
    from common.task import load_task
    from ddloco.tasks.digits import heldout_accuracy
    model = load_task("digits").model()
    model.load_state_dict(load_state(report / "model.safetensors"), strict=True)
    assert heldout_accuracy(model) >= 0.9


def test_cli_learner_and_export_given_only_task_join_a_run_started_from_python(tmp_path, monkeypatch, make_cluster):
    """A run started with a Task object and non-default settings: `ddloco learner --task` joins it
    with the run's settings (checked to be the same task), `ddloco export --task` exports it."""
    (tmp_path / "usertask.py").write_text(
        "import torch\nfrom ddloco import Task\n"
        "def task(width: int = 8):\n"
        "    def batches(stream, seed, start):\n"
        "        g = torch.Generator().manual_seed(1000 * stream + start)\n"
        "        while True:\n"
        "            x = torch.randn(16, width, generator=g)\n"
        "            yield (x, x.sum(1, keepdim=True))\n"
        "    return Task(name='user', model=lambda: torch.nn.Linear(width, 1), batches=batches,\n"
        "                loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), config={'width': width})\n")
    monkeypatch.chdir(tmp_path)
    from common.task import load_task
    run = RunConfig(algo=AlgoConfig(fragments=3, sync_every_steps=4, inner_warmup_steps=1))
    cluster = make_cluster(run, run_id="pyrun", task=load_task("usertask:task"))
    cluster.start_shard(0, 1)
    net = ["--redis-url", cluster.endpoints.redis_url, "--run-id", "pyrun", "--broker-pub",
           cluster.endpoints.broker_pub, "--broker-sub", cluster.endpoints.broker_sub]
    res = ddloco("learner", *net, "--insecure", "--task", "usertask:task", "--learner-id", "cli", "--steps", "12",
                 cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr[-1500:]
    r = control.connect(cluster.endpoints.redis_url)
    assert int(r.hget(Keys("pyrun").learner("cli"), "merged_contributions") or 0) >= 1
    other = ddloco("learner", *net, "--insecure", "--task", "usertask:task", "--task-arg", "width=9", "--steps", "2",
                   cwd=tmp_path, timeout=120)
    assert other.returncode == 3 and "width=9 (run has 8)" in other.stderr, other.stderr[-1500:]
    out = tmp_path / "m.safetensors"
    exp = ddloco("export", *net, "--task", "usertask:task", "--out", str(out), cwd=tmp_path, timeout=120)
    assert exp.returncode == 0, exp.stderr[-1500:]
    from ddloco.export import load_state
    assert set(load_state(out)) == {"weight", "bias"}
    assert not cluster.errors, cluster.errors


def test_the_readme_recipe_by_hand_trains_the_example_cnn_with_a_late_learner(tmp_path):
    """examples/by_hand.sh: Redis, broker, 2 syncers, 3 learners as processes with --task on each, a
    4th learner joining mid-run without --task; exports from the live run and the checkpoints."""
    env = {**os.environ, "OUT": str(tmp_path / "bh"), "B": str(Path(sys.executable).parent)}
    res = subprocess.run(["bash", str(REPO / "examples" / "by_hand.sh")], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stdout.splitlines() if "held-out loss" in ln]
    assert len(lines) == 2, res.stdout[-2000:]
    scores = [ln.split("->")[1].split()[0] for ln in lines]
    assert scores[0] == scores[1], lines            # live export == checkpoint export
    initial = float(lines[0].split("held-out loss")[1].split("->")[0])
    assert float(scores[0]) <= 0.5 * initial, lines
    late = [ln for ln in res.stdout.splitlines() if ln.startswith("late ")]
    assert late and int(late[0].split()[6]) >= 1, res.stdout[-2000:]   # its answers were merged


def test_the_python_api_example_runs_a_whole_cluster_in_one_script():
    res = subprocess.run([sys.executable, "-m", "examples.python_api"], capture_output=True, text=True, cwd=REPO,
                         timeout=200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("global model held-out loss"))
    initial, final = (float(x.split()[0]) for x in line.split("loss ")[1].split(" -> "))
    assert final <= 0.5 * initial, line
