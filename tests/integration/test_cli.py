"""The `ddloco` commands as a user runs them: real processes, real Redis, real sockets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import control
from common.config import ConfigError
from common.keys import Keys
from common.redis_server import free_port
from tests.conftest import TINY_TOML as TINY, start_hand_daemons, stop_processes, wait_until

pytestmark = pytest.mark.timeout(240)




def ddloco(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddloco", *args], capture_output=True, text=True, **kw)


@pytest.mark.parametrize("command", ["up", "status", "keys", "broker", "syncer", "learner", "sim", "bench", "export",
                                     "compare", "fuzz", "chaos"])
def test_every_command_has_help(command, capsys):
    from ddloco.cli import main   # in-process: one interpreter for all (a process each took ~3 s)
    try:
        rc = main([command, "--help"])
    except SystemExit as done:   # argparse's help exits; some subcommands return
        rc = done.code
    out = capsys.readouterr()
    assert rc in (0, None), out.err
    assert "usage:" in out.out


def test_the_entry_point_answers_help_without_importing_torch():
    res = subprocess.run([sys.executable, "-c", "import sys; from ddloco.cli import main\n"
                          "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout and res.stdout.strip().endswith("False"), res.stdout[-300:]


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
    pub, sub = free_port(), free_port()   # the broker's endpoints, fixed by the operator
    res = ddloco("up", "--config", str(cfg), "--learners", "2", "--syncers", "2", "--steps", "40",
                 "--step-time-floor-ms", "25", "--minutes", "3", "--report", str(report), "--run-id", "e2e",
                 "--broker-pub", f"tcp://127.0.0.1:{pub}", "--broker-sub", f"tcp://127.0.0.1:{sub}",
                 cwd=tmp_path, timeout=200)
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
    assert set(rep["metrics_endpoints"]) == {"broker", "shard0", "shard1", "learner-0", "learner-1"}
    for png in ("eval_loss.png", "merges.png", "timeline.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # secure by default: CURVE keys per member, a Redis password, nothing refused in a clean run
    assert rep["security"] == {"curve": True, "redis_auth": True, "redis_tls": False}
    assert rep["auth_failures"] == 0 and rep["broker_refused"] == {}
    run_dir = next((tmp_path / "runs").iterdir())
    assert (run_dir / "keys" / "public" / "learner" / "learner-1.key").exists()
    toml = (run_dir / "config.toml").read_text()
    assert "keys_dir" in toml and "@" not in toml.split("redis_url", 1)[1].split("\n", 1)[0]  # no password in files
    # --broker-pub / --broker-sub: the broker bound them and every child connected to them
    assert f'broker_pub = "tcp://127.0.0.1:{pub}"' in toml and f'broker_sub = "tcp://127.0.0.1:{sub}"' in toml, toml
    broker_log = (run_dir / "logs" / "broker.log").read_text()
    assert f'"xsub": "tcp://127.0.0.1:{pub}"' in broker_log and f'"xpub": "tcp://127.0.0.1:{sub}"' in broker_log
    assert oct((run_dir / "access.env").stat().st_mode & 0o777) == "0o600"
    assert json.loads((run_dir / "metrics.json").read_text()) == rep["metrics_endpoints"]
    pids = [int(h["pid"]) for h in rep["learner_stats"].values()] + [int(h["pid"]) for h in rep["shard_stats"].values()]
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]


def test_daemons_by_hand_status_and_refused_learner(tmp_path, redis_server):
    cfg = tmp_path / "tiny.toml"
    broker_metrics, shard_metrics = free_port(), free_port()   # the flag for one, the environment for the other
    d = start_hand_daemons(tmp_path, redis_server.url, "byhand", broker_args=("--metrics-port", str(broker_metrics)),
                           syncer_env={"DDLOCO_METRICS_PORT": str(shard_metrics)})
    net, env, procs = d.net, d.env, d.procs
    try:
        # a learner needs only the broker, Redis and the run id: the config comes from Redis
        learner = subprocess.Popen([sys.executable, "-m", "learner", *net, "--learner-id", "hand-1", "--steps", "30"],
                                   env=env, stderr=subprocess.PIPE, text=True)
        procs.append(learner)
        _, err = learner.communicate(timeout=120)
        assert learner.returncode == 0, err[-2000:]
        from tests.integration.test_metrics import scrape, value
        assert value(scrape(f"http://127.0.0.1:{shard_metrics}/metrics"), "ddloco_shard_merges_total") >= 1
        assert value(scrape(f"http://127.0.0.1:{broker_metrics}/metrics"), "ddloco_broker_messages_total") > 0
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
        stop_processes(procs)


@pytest.mark.timeout(330)
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
        try:   # the stop, the final evaluation and the report: seconds alone, a minute or more on the suite's loaded cores
            rc = proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            raise AssertionError("up did not end within 150 s of Ctrl-C; its last lines:\n" + "".join(lines[-30:])) from None
        assert rc == 130, "".join(lines[-30:])
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
    from common import quant
    table = json.loads(res.stdout)["results"]["codec"]
    rows = {r["codec"]: r for r in table if r["impl"] == quant.KERNEL or r["codec"] not in ("int8", "int4")}
    assert set(rows) == {"memcpy", "fp32", "bf16", "int8", "int4"}
    assert rows["int4"]["bytes"] == 4096 // 2 + 2 * (4096 // 64)
    assert rows["fp32"]["max_abs_error"] == 0.0
    assert rows["memcpy"]["encode_vs_memcpy"] == 1.0 and rows["int4"]["encode_vs_memcpy"] > 0
    # with the C kernels built, the torch implementation is measured beside them, same bytes
    impls = {(r["codec"], r["impl"]) for r in table}
    if quant.KERNEL == "c":
        assert {("int4", "c"), ("int4", "torch"), ("int8", "c"), ("int8", "torch")} <= impls
        same = [r for r in table if r["codec"] == "int4"]
        assert same[0]["bytes"] == same[1]["bytes"] and same[0]["max_abs_error"] == same[1]["max_abs_error"]


def _help(capsys, *argv: str) -> str:
    from ddloco.cli import main
    try:
        rc = main([*argv, "--help"])
    except SystemExit as done:   # argparse's --help; `sim` returns the code instead
        rc = done.code
    assert rc == 0, argv
    return capsys.readouterr().out


def _options_without_description(text: str) -> list[str]:
    """Options argparse printed with no help text after them (not on their line, nor indented below)."""
    import re
    lines = text.splitlines()
    return [m.group(2) for i, line in enumerate(lines)
            if (m := re.fullmatch(r"  (-\w, )?(--?[\w-]+)( \S+)?( \[\S+\])?", line.rstrip()))
            and not (i + 1 < len(lines) and lines[i + 1].startswith(" " * 8) and lines[i + 1].strip())]


@pytest.mark.parametrize("argv", [[], ["up"], ["status"], ["keys"], ["broker"], ["syncer"], ["learner"], ["sim"],
                                  ["sim", "table"], ["sim", "run"], ["sim", "hetero"], ["sim", "bandwidth"],
                                  ["bench"], ["export"], ["compare"], ["fuzz"], ["chaos"]])
def test_help_describes_every_flag_without_format_artifacts(argv, capsys):
    text = _help(capsys, *argv)
    assert _options_without_description(text) == [], text
    assert "%%" not in text and "docs/sim.md" not in text, text   # docs/sim.md does not exist


def test_help_lists_every_command_and_states_what_flags_do(capsys):
    top = _help(capsys)
    for command in ("up", "status", "keys", "broker", "syncer", "learner", "sim", "bench", "export", "chaos",
                    "compare", "fuzz"):
        assert f"\n    {command} " in top, (command, top)
    assert "codec, wire, merge, broker, curve" in top and "3 refused by the run" in top
    learner = _help(capsys, "learner")
    assert "stream of training batches (default: derived from the learner id)" in " ".join(learner.split())
    up = " ".join(_help(capsys, "up").split())
    assert "endpoint the broker binds for publishers (its XSUB)" in up
    assert "not used by up: it makes a key pair per member" in up


def _main_error(capsys, *argv: str) -> tuple[int, str]:
    import structlog
    from ddloco.cli import main
    logging = structlog.get_config()
    try:
        rc = main([*argv, "--insecure"])
    finally:   # the command pointed structlog at the captured stderr: give the suite its logging back
        structlog.configure(**logging)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("argv, line", [
    (["learner", "--redis-url", "http://x"], "ddloco learner: --redis-url 'http://x': not a Redis URL (expected "
                                             "redis://[USER:PASSWORD@]HOST:PORT/DB, rediss://... (TLS) or unix://PATH)"),
    (["broker", "--xsub", "bogus"], "ddloco broker: --xsub 'bogus': not a ZeroMQ endpoint (expected "
                                    "tcp://HOST:PORT, ipc://PATH or inproc://NAME)"),
    (["broker", "--xpub", "tcp://host"], "ddloco broker: --xpub 'tcp://host': a tcp endpoint is tcp://HOST:PORT "
                                         "(HOST a name, an address, * or [IPv6])"),
    (["syncer", "--rpc-bind", "tcp://0.0.0.0:70000"], "ddloco syncer: --rpc-bind 'tcp://0.0.0.0:70000': port 70000 "
                                                      "is above 65535"),
    (["syncer", "--broker-pub", "localhost:5555"], "ddloco syncer: --broker-pub 'localhost:5555': not a ZeroMQ "
                                                   "endpoint (expected tcp://HOST:PORT, ipc://PATH or inproc://NAME)"),
    (["learner", "--broker-sub", "ipc://"], "ddloco learner: --broker-sub 'ipc://': ipc:// needs a PATH without "
                                            "spaces"),
    (["learner", "--broker-sub", "ipc:///" + "x" * 107], "ddloco learner: --broker-sub 'ipc:///" + "x" * 107 + "': an "
                                                         "ipc path holds at most 107 bytes (a Unix socket's address), "
                                                         "this one 108: choose a shorter one"),
    (["learner", "--peer-bind", "tcp://*"], "ddloco learner: --peer-bind 'tcp://*': a tcp endpoint is "
                                            "tcp://HOST:PORT (HOST a name, an address, * or [IPv6])"),
    (["status", "--redis-url", "redis://:secret@host:port/0"], "ddloco status: --redis-url "
                                                               "'redis://:***@host:port/0': bad port"),
])
def test_a_malformed_url_or_endpoint_flag_is_one_line_naming_it_and_exit_2(argv, line, capsys):
    rc, err = _main_error(capsys, *argv)
    assert rc == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert "secret" not in err


@pytest.mark.parametrize("command", ["learner", "status", "up"])
def test_an_unreachable_redis_is_one_line_naming_the_flag_and_exit_2(command, capsys):
    url = f"redis://:pw@127.0.0.1:{free_port()}/0"   # nothing listens there
    rc, err = _main_error(capsys, command, "--redis-url", url, "--run-id", "r")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err, err
    assert last.startswith(f"ddloco {command}: --redis-url 'redis://:***@127.0.0.1:") and \
        "Redis does not answer there (" in last and "Connection refused" in last, err


def test_a_bad_endpoint_in_the_config_file_names_the_field(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[endpoints]\nbroker_pub = "broker:5555"\n')
    rc, err = _main_error(capsys, "learner", "--config", str(cfg))
    assert rc == 2 and err.startswith("ddloco learner: endpoints.broker_pub 'broker:5555': not a ZeroMQ endpoint"), err


def test_up_refuses_a_broker_port_already_in_use_before_starting_anything(tmp_path, capsys, monkeypatch):
    import socket
    from ddloco.up import broker_endpoints
    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, err = _main_error(capsys, "up", "--broker-pub", f"tcp://127.0.0.1:{port}", "--steps", "1")
    assert rc == 2 and err == (f"ddloco up: --broker-pub 'tcp://127.0.0.1:{port}': port {port} is already in use "
                               "(another broker or `ddloco up`?); choose another port or leave the flag out\n"), err
    assert not (tmp_path / "runs").exists()   # nothing started, nothing written
    free = free_port()
    ep = broker_endpoints(f"tcp://*:{free}", "")
    assert ep.xsub_bind == f"tcp://*:{free}" and ep.pub == f"tcp://127.0.0.1:{free}"   # bound as given, reached locally
    assert ep.xpub_bind == ep.sub and ep.sub.startswith("tcp://127.0.0.1:") and ep.sub != ep.pub
    with pytest.raises(ConfigError, match="--broker-sub 'tcp://127.0.0.1:0': give a fixed port"):
        broker_endpoints("", "tcp://127.0.0.1:0")


def test_up_refuses_an_ipc_path_a_live_process_holds_or_a_file_before_starting_anything(tmp_path):
    """The broker would unlink either one to bind its socket there: `up` refuses first (its first
    step, ``broker_endpoints``: one line, exit 2, as for a port in use), and takes a free ipc://
    path as given (bound and reached at the same path)."""
    import socket
    from ddloco.up import broker_endpoints
    (tmp_path / "notes.txt").write_text("keep")
    with socket.socket(socket.AF_UNIX) as busy:
        busy.bind(str(tmp_path / "busy"))
        busy.listen()
        with pytest.raises(ConfigError) as refused:
            broker_endpoints(f"ipc://{tmp_path}/busy", "")
    assert str(refused.value) == (f"--broker-pub 'ipc://{tmp_path}/busy': a live process listens there (another "
                                  "broker?): stop it or choose another path"), refused.value
    with pytest.raises(ConfigError, match=r"--broker-sub '.*/notes.txt': a file that is not a socket is there \(bind"):
        broker_endpoints("", f"ipc://{tmp_path}/notes.txt")
    with pytest.raises(ConfigError, match="its directory .*/nowhere does not exist"):
        broker_endpoints(f"ipc://{tmp_path}/nowhere/pub", "")
    assert (tmp_path / "notes.txt").read_text() == "keep"
    ep = broker_endpoints(f"ipc://{tmp_path}/busy", f"ipc://{tmp_path}/sub")   # a stopped process's socket: free
    assert (ep.xsub_bind, ep.pub, ep.xpub_bind, ep.sub) == (f"ipc://{tmp_path}/busy",) * 2 + (f"ipc://{tmp_path}/sub",) * 2


@pytest.fixture
def redis_with_a_run():
    """A Redis with a password holding one run, ``real-run``."""
    from common.config import RunConfig
    from common.redis_server import EmbeddedRedis
    with EmbeddedRedis(password="s3cret") as srv:
        control.publish_run_config(control.connect(srv.url), Keys("real-run"), RunConfig())
        yield srv


def _main_timed(capsys, *argv: str) -> tuple[int, str, float]:
    import time
    import structlog
    from ddloco.cli import main
    logging = structlog.get_config()
    t0 = time.monotonic()
    try:
        rc = main(list(argv))
    finally:
        structlog.configure(**logging)
    return rc, capsys.readouterr().err, time.monotonic() - t0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command, extra", [("status", ()), ("status", ("--json",)), ("export", ("--out", "m.pt")),
                                            ("fuzz", ("--count", "1")), ("chaos", ("seed=1", "--minutes", "0.1"))])
def test_a_run_id_not_in_redis_is_one_line_naming_it_the_redis_and_the_runs_there_exit_2_at_once(
        command, extra, redis_with_a_run, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err, took_s = _main_timed(capsys, command, *extra, "--redis-url", redis_with_a_run.url, "--run-id", "wrong")
    assert err == (f"ddloco {command}: no run config for run id 'wrong' in Redis at redis://:***@127.0.0.1:"
                   f"{redis_with_a_run.port}/0: is the run id right? runs seen there: real-run; a run is started by "
                   "`ddloco up` or a syncer (check --run-id and --redis-url)\n"), err
    assert rc == 2, err
    assert took_s < 10, f"{command} took {took_s:.1f} s to say the run is not there"   # export waited 31 s
    assert list(tmp_path.iterdir()) == [], "nothing written"


@pytest.mark.timeout(60)
def test_export_from_a_redis_that_does_not_answer_is_one_line_naming_the_flag_and_exit_2(capsys, tmp_path):
    url = f"redis://:pw@127.0.0.1:{free_port()}/0"   # nothing listens there
    rc, err, _ = _main_timed(capsys, "export", "--redis-url", url, "--run-id", "r", "--out", str(tmp_path / "m.pt"))
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("ddloco export: --redis-url 'redis://:***@127.0.0.1:") and \
        "Redis does not answer there (" in err and "pw" not in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, line", [
    (["up", "--learners", "0"], "ddloco up: --learners must be >= 1"),
    (["up", "--syncers", "0"], "ddloco up: --syncers must be >= 1"),
    (["up", "--steps", "-1"], "ddloco up: --steps must be >= 0"),
    (["up", "--fragments", "0"], "ddloco up: --fragments must be >= 1"),
    (["up", "--quorum", "0"], "ddloco up: --quorum must be >= 1"),
    (["up", "--sync-every", "0"], "ddloco up: --sync-every must be >= 1"),
    (["up", "--tau", "0"], "ddloco up: --tau must be >= 1"),
    (["up", "--seed", "-1"], "ddloco up: --seed must be an int >= 0, got -1"),
    (["learner", "--steps", "-2"], "ddloco learner: --steps must be >= 0"),
    (["syncer", "--shards", "0"], "ddloco syncer: --shards must be >= 1"),
    (["learner", "--lr-schedule", "cosine", "--lr-warmup-tokens", "20", "--lr-decay-tokens", "10"],
     "ddloco learner: --lr-decay-tokens must exceed --lr-warmup-tokens for a cosine or linear schedule"),
])
def test_a_bad_flag_value_is_named_by_its_flag(argv, line, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = _main_error(capsys, *argv)
    assert rc == 2 and err == line + "\n", err
    assert list(tmp_path.iterdir()) == [], "nothing started"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("toml, argv, line", [
    ("[up]\nlearners = 0\n", ["--learners", "3"], "ddloco up: up.learners must be >= 1"),   # the file's value
    ('[algo]\nlr_schedule = "cosine"\nlr_decay_tokens = 100\n', ["--lr-warmup-tokens", "200"],
     "ddloco up: algo.lr_decay_tokens must exceed --lr-warmup-tokens for a cosine or linear schedule"),
    ("[algo]\ntau = 0\n", [], "ddloco up: algo.tau must be >= 1"),
])
def test_a_bad_value_from_the_toml_file_is_named_by_its_key_and_a_flag_by_its_flag(toml, argv, line, capsys,
                                                                                     tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(toml)
    rc, err = _main_error(capsys, "up", "--config", "c.toml", *argv)
    assert rc == 2 and err == line + "\n", err


def test_every_flag_named_in_errors_sets_the_field_it_names():
    """The flag <-> field table that names flags in errors: each field exists, and its flag is an
    option of some command whose dest is the one the table reads."""
    import dataclasses
    from common.config import AlgoConfig, Endpoints, LearnerOptions, SyncerOptions, TaskConfig, UpOptions
    from ddloco.cli import _FLAG_OF_FIELD, build_parser
    sections = {"algo": AlgoConfig, "task": TaskConfig, "endpoints": Endpoints, "up": UpOptions,
                "syncer": SyncerOptions, "learner": LearnerOptions}
    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    options = {(o, a.dest) for p in subparsers.values() for a in p._actions for o in a.option_strings}
    for field, (dest, flag) in _FLAG_OF_FIELD.items():
        section, name = field.split(".")
        assert name in {f.name for f in dataclasses.fields(sections[section])}, field
        assert (flag, dest) in options, (field, flag, dest)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, env", [
    (["broker", "--keys", "{missing}"], False),
    (["syncer", "--keys", "{missing}", "--redis-url", "redis://127.0.0.1:1/0"], False),
    (["learner", "--learner-id", "l0", "--redis-url", "redis://127.0.0.1:1/0"], True),   # DDLOCO_KEYS
    (["learner", "--standby", "--keys", "{missing}", "--redis-url", "redis://127.0.0.1:1/0"], False),
    (["export", "--keys", "{missing}", "--run-id", "real-run", "--out", "m.pt"], False),
])
def test_a_keys_folder_that_does_not_exist_is_named_as_such_exit_2(argv, env, capsys, tmp_path, monkeypatch,
                                                                   redis_with_a_run):
    missing = tmp_path / "no-such-keys"
    monkeypatch.chdir(tmp_path)
    if env:
        monkeypatch.setenv("DDLOCO_KEYS", str(missing))
    if argv[0] == "export":
        argv = [*argv, "--redis-url", redis_with_a_run.url]
    rc, err, _ = _main_timed(capsys, *(a.format(missing=missing) for a in argv))
    assert err == (f"ddloco {argv[0]}: keys folder {missing} does not exist (make one with `ddloco keys --dir "
                   f"{missing} ...`; see docs/SECURITY.md)\n"), err
    assert rc == 2


@pytest.mark.timeout(180)
def test_up_quiet_prints_nothing_and_up_prints_no_json_while_its_daemons_log_json(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    run = ("up", "--config", str(cfg), "--learners", "1", "--syncers", "1", "--steps", "4")
    quiet = ddloco(*run, "--quiet", cwd=tmp_path, timeout=150)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stdout == "" and quiet.stderr == "", quiet.stdout + quiet.stderr   # the embedded Redis's JSON was
    loud = ddloco(*run, cwd=tmp_path, timeout=150)
    assert loud.returncode == 0, loud.stdout[-2000:] + loud.stderr[-2000:]
    lines = (loud.stdout + loud.stderr).splitlines()
    assert [line for line in lines if line.lstrip().startswith("{")] == [], lines
    assert any(line.startswith("log        redis_started port=") for line in loud.stderr.splitlines()), loud.stderr
    for log in sorted(tmp_path.glob("runs/*/logs/syncer-0.log")):   # the daemons' own logs stay JSON lines
        assert all(json.loads(line)["event"] for line in log.read_text().splitlines()), log
