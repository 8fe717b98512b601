"""The `ddloco` commands as a user runs them: real processes, real Redis, real sockets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import control
from common.keys import Keys
from common.redis_server import free_port
from tests.conftest import TINY_TOML as TINY, wait_until

pytestmark = pytest.mark.timeout(240)




def ddloco(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddloco", *args], capture_output=True, text=True, **kw)


@pytest.mark.parametrize("command", ["up", "status", "keys", "broker", "syncer", "learner", "sim", "bench", "export",
                                     "compare", "fuzz", "chaos"])
def test_every_command_has_help(command):
    res = ddloco(command, "--help", timeout=60)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def test_bad_config_value_exits_2_with_reason(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[algo]\nquorum = 0\n")
    res = ddloco("up", "--config", str(cfg), timeout=60)
    assert res.returncode == 2
    assert "algo.quorum must be >= 1" in res.stderr


def test_up_runs_a_cluster_writes_report_and_leaves_no_process(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    report = tmp_path / "report"
    res = ddloco("up", "--config", str(cfg), "--learners", "2", "--syncers", "2", "--steps", "40",
                 "--step-time-floor-ms", "25", "--minutes", "3", "--report", str(report), "--run-id", "e2e", cwd=tmp_path, timeout=200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rep = json.loads((report / "report.json").read_text())
    for field in ("run_id", "learners", "syncers", "wall_s", "tokens_total", "eval_loss_initial", "eval_loss_final",
                  "merges", "goodput", "uptime", "global_downtime_s", "bytes_up", "bytes_down",
                  "dropped_messages", "failures_injected"):
        assert field in rep, field
    assert rep["learners"] == 2 and rep["syncers"] == 2
    assert rep["steps_total"] == 80 and rep["tokens_total"] == 80 * 4 * 16
    assert rep["every_learner_contributed"] and rep["every_fragment_merged"], rep["contributors"]
    assert rep["eval_loss_final"] < rep["eval_loss_initial"]
    assert rep["processes_left"] == []
    for png in ("eval_loss.png", "merges.png", "timeline.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # secure by default: CURVE keys per member, a Redis password, nothing refused in a clean run
    assert rep["security"] == {"curve": True, "redis_auth": True, "redis_tls": False}
    assert rep["auth_failures"] == 0 and rep["broker_refused"] == {}
    run_dir = next((tmp_path / "runs").iterdir())
    assert (run_dir / "keys" / "public" / "learner" / "learner-1.key").exists()
    toml = (run_dir / "config.toml").read_text()
    assert "keys_dir" in toml and "@" not in toml.split("redis_url", 1)[1].split("\n", 1)[0]  # no password in files
    assert oct((run_dir / "access.env").stat().st_mode & 0o777) == "0o600"
    pids = [int(h["pid"]) for h in rep["learner_stats"].values()] + [int(h["pid"]) for h in rep["shard_stats"].values()]
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]


def test_daemons_by_hand_status_and_refused_learner(tmp_path, redis_server):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    pub, sub = free_port(), free_port()
    net = ["--insecure", "--redis-url", redis_server.url, "--broker-pub", f"tcp://127.0.0.1:{pub}",
           "--broker-sub", f"tcp://127.0.0.1:{sub}", "--run-id", "byhand", "--log-format", "json"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DDLOCO_INSECURE": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "broker", "--xsub", f"tcp://127.0.0.1:{pub}",
                               "--xpub", f"tcp://127.0.0.1:{sub}"], env=env, stderr=subprocess.DEVNULL),
             subprocess.Popen([sys.executable, "-m", "syncer", "--config", str(cfg), *net,
                               "--checkpoint-dir", str(tmp_path / "ck")], env=env, stderr=subprocess.DEVNULL)]
    try:
        # a learner needs only the broker, Redis and the run id: the config comes from Redis
        learner = subprocess.Popen([sys.executable, "-m", "learner", *net, "--learner-id", "hand-1", "--steps", "30"],
                                   env=env, stderr=subprocess.PIPE, text=True)
        procs.append(learner)
        _, err = learner.communicate(timeout=120)
        assert learner.returncode == 0, err[-2000:]
        res = ddloco("status", "--json", *net[:-2], timeout=60)
        assert res.returncode == 0, res.stderr
        st = json.loads(res.stdout)
        assert st["learners"]["hand-1"]["steps"] == 30
        assert st["learners"]["hand-1"]["merged_contributions"] >= 1
        assert sum(f["version"] for f in st["fragments"].values()) >= 1
        text = ddloco("status", *net[:-2], timeout=60)
        assert text.returncode == 0 and "hand-1" in text.stdout and "fragments (p:version)" in text.stdout
        # a restarted learner (same id) resumes its data position instead of replaying its batches
        again = ddloco("learner", *net, "--learner-id", "hand-1", "--steps", "10", timeout=120)
        assert again.returncode == 0, again.stderr[-2000:]
        r = control.connect(redis_server.url)
        assert r.hget(Keys("byhand").learner("hand-1"), "data_position") == "40"
        res = ddloco("learner", *net, "--config", str(cfg), "--quorum", "2", "--steps", "5", timeout=120)
        assert res.returncode == 3
        assert "refused" in res.stderr and "algo.quorum=2 (run has 1)" in res.stderr
        procs[1].terminate()  # graceful: checkpoint on SIGTERM
        assert procs[1].wait(timeout=30) == 0
        assert (tmp_path / "ck" / "byhand-shard0of1.pt").exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_ctrl_c_stops_every_process_and_still_writes_the_report(tmp_path):
    import signal
    import threading
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    report = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "ddloco", "up", "--config", str(cfg), "--learners", "2",
                             "--syncers", "1", "--steps", "0", "--minutes", "5", "--step-time-floor-ms", "20",
                             "--report", str(report), "--run-id", "ctrlc"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("merges" in ln and "| merges 0 |" not in ln for ln in lines), 120,
                   what="progress showing merges")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    rep = json.loads((report / "report.json").read_text())
    assert rep["interrupted"] is True and rep["processes_left"] == []
    pids = [int(h["pid"]) for h in rep["learner_stats"].values()] + [int(h["pid"]) for h in rep["shard_stats"].values()]
    assert len(pids) == 3 and not [p for p in pids if Path(f"/proc/{p}").exists()]
    # learners stopped gracefully (deregistered) on the single SIGTERM from `up`
    assert {h["status"] for h in rep["learner_stats"].values()} == {"left"}


def test_bench_reports_every_codec_with_exact_sizes():
    res = ddloco("bench", "codec", "--numel", "4096", "--repeats", "2", "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    rows = {r["codec"]: r for r in json.loads(res.stdout)["results"]["codec"]}
    assert set(rows) == {"fp32", "bf16", "int8", "int4"}
    assert rows["int4"]["bytes"] == 4096 // 2 + 2 * (4096 // 64)
    assert rows["fp32"]["max_abs_error"] == 0.0
