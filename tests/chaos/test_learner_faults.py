"""Chaos: real daemon processes, real signals. Survivors never wait for a failed learner."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from common import control
from common.keys import Keys
from common.redis_server import free_port
from common.security import Security, create_keys
from tests.conftest import TINY_TOML, wait_until

pytestmark = pytest.mark.timeout(240)

TINY = TINY_TOML + """
[learner]
heartbeat_interval_s = 0.2
heartbeat_ttl_s = 1.0
step_time_floor_ms = 20.0
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


class Daemons:
    def __init__(self, tmp_path, redis_url: str) -> None:
        self.cfg = tmp_path / "tiny.toml"
        self.cfg.write_text(TINY)
        pub, sub = free_port(), free_port()
        self.xsub, self.xpub = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{sub}"
        self.net = ["--redis-url", redis_url, "--broker-pub", self.xsub, "--broker-sub", self.xpub,
                    "--run-id", "chaos", "--log-format", "json"]
        self.tmp = tmp_path
        self.redis_url = redis_url
        self.procs: dict[str, subprocess.Popen] = {}
        self.keys = tmp_path / "keys"    # secure by default: CURVE keys for every member
        create_keys(self.keys, shards=2)

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        if argv[0] == "broker":   # the run's shard count (the owner rule) from its config in Redis
            argv = (*argv, "--redis-url", self.redis_url, "--run-id", "chaos")
        if argv[0] == "learner" and "--learner-id" in argv:   # a listed key for every learner id
            create_keys(self.keys, learners=[argv[argv.index("--learner-id") + 1]], broker=False, monitors=())
        log = open(self.tmp / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "ddloco", *argv], stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "DDLOCO_KEYS": str(self.keys)})
        self.procs[name] = p
        return p

    def learner(self, name: str) -> subprocess.Popen:
        return self.start(name, "learner", *self.net, "--config", str(self.cfg), "--learner-id", name)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_merges_go_on_while_a_learner_is_frozen_or_killed_and_a_restarted_one_rejoins(tmp_path, redis_server):
    d = Daemons(tmp_path, redis_server.url)
    r = control.connect(redis_server.url)
    keys = Keys("chaos")

    def merges() -> int:
        return int(r.hget(keys.shard(0), "merges") or 0)

    def contributions(lid: str) -> int:
        return int(r.hget(keys.learner(lid), "merged_contributions") or 0)
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        d.start("syncer", "syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck"))
        for name in ("a", "b", "c"):
            d.learner(name)
        wait_until(lambda: all(contributions(n) >= 2 for n in "abc"), 120, interval_s=0.1,
                   what="all three learners contributing")

        # SIGSTOP: a frozen learner (still holding sockets) must not slow the others' merges
        a = d.procs["a"]
        os.kill(a.pid, signal.SIGSTOP)
        wait_until(lambda: _state(a.pid) == "T", 10, what="learner a stopped")
        m0, b0, c0 = merges(), contributions("b"), contributions("c")
        wait_until(lambda: merges() >= m0 + 12 and contributions("b") > b0 and contributions("c") > c0, 60,
                   interval_s=0.1, what="merges with b and c while a is frozen")
        assert _state(a.pid) == "T", "learner a must still be frozen while the others merge"
        a0 = contributions("a")
        os.kill(a.pid, signal.SIGCONT)
        wait_until(lambda: contributions("a") > a0, 60, interval_s=0.1, what="a contributing again after SIGCONT")

        # SIGKILL: the others go on; a restarted learner with the same id rejoins and contributes
        b = d.procs["b"]
        os.kill(b.pid, signal.SIGKILL)
        b.wait(timeout=10)
        m1 = merges()
        wait_until(lambda: merges() >= m1 + 12, 60, interval_s=0.1, what="merges after b was killed")
        b_before = contributions("b")  # a dozen merges later nothing of the killed b is in flight
        new_b = d.learner("b")
        wait_until(lambda: r.hget(keys.learner("b"), "pid") == str(new_b.pid), 120, interval_s=0.1,
                   what="restarted b registered")
        wait_until(lambda: contributions("b") > b_before, 120, interval_s=0.1, what="restarted b contributing")
        # the same-id restart reads as leave + join of two incarnations, whatever the heartbeat TTL
        b_events = [(e["kind"], e.get("incarnation")) for e in control.read_events(r, keys)
                    if e.get("learner") == "b" and e["kind"] in ("join", "leave")]
        assert [k for k, _ in b_events] == ["join", "leave", "join"], b_events
        assert b_events[0][1] == b_events[1][1] != b_events[2][1], b_events
        assert all(d.procs[n].poll() is None for n in ("broker", "syncer", "a", "c")), "a daemon died"
    finally:
        d.stop_all()
    assert d.procs["syncer"].returncode == 0


def test_broker_and_shard_killed_and_restarted_training_resumes(tmp_path, redis_server):
    d = Daemons(tmp_path, redis_server.url)
    r = control.connect(redis_server.url)
    keys = Keys("chaos")

    def versions() -> int:
        pipe = r.pipeline(transaction=False)
        for p in range(4):
            pipe.hget(keys.fragment(p), "version")
        return sum(int(v or 0) for v in pipe.execute())

    def merges(shard: int) -> int:
        return int(r.hget(keys.shard(shard), "merges") or 0)
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        syncer = ["syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck"),
                  "--shards", "2", "--checkpoint-every", "3"]
        d.start("syncer-0", *syncer, "--shard", "0")
        d.start("syncer-1", *syncer, "--shard", "1")
        for name in ("a", "b"):
            d.learner(name)
        wait_until(lambda: merges(0) >= 6 and merges(1) >= 6, 120, interval_s=0.1, what="merges on both shards")

        # the broker dies and comes back on the same endpoints: every socket reconnects on its own
        os.kill(d.procs["broker"].pid, signal.SIGKILL)
        d.procs["broker"].wait(timeout=10)
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        m0, m1 = merges(0), merges(1)
        wait_until(lambda: merges(0) >= m0 + 6 and merges(1) >= m1 + 6, 60, interval_s=0.1,
                   what="merges on both shards after the broker restart")

        # shard 1 is killed (no checkpoint on the way down), its checkpoint is deleted (a reschedule
        # on another host) and it is restarted: it waits out its old lease, recovers its fragments
        # from the learners' copies in a new epoch (versions never go back), merges go on
        os.kill(d.procs["syncer-1"].pid, signal.SIGKILL)
        d.procs["syncer-1"].wait(timeout=10)
        killed_at = {p: int(r.hget(keys.fragment(p), "version") or 0) for p in (1, 3)}
        for f in (tmp_path / "ck").glob("*shard1of2*"):
            f.unlink()
        m0 = merges(0)
        wait_until(lambda: merges(0) >= m0 + 6, 60, interval_s=0.1, what="shard 0 merging while shard 1 is down")
        d.start("syncer-1", *syncer, "--shard", "1")
        wait_until(lambda: r.hget(keys.shard(1), "pid") == str(d.procs["syncer-1"].pid), 60, interval_s=0.1,
                   what="restarted shard 1 registered")
        m1 = merges(1)
        wait_until(lambda: merges(1) >= m1 + 6, 60, interval_s=0.1, what="restarted shard 1 merging")
        recovered = {int(e["fragment"]): int(e["version"]) for e in control.read_events(r, keys, kind="recover")}
        assert all(recovered.get(p, -1) >= v for p, v in killed_at.items()), (recovered, killed_at)
        assert not control.read_events(r, keys, kind="recover_incomplete")
        assert all(int(h.get("versions_regressed", 0)) == 0 for h in control.all_learners(r, keys).values())
        assert all(p.poll() is None for p in d.procs.values()), "a daemon died"
        assert versions() > 0
    finally:
        d.stop_all()
    assert all(d.procs[n].returncode == 0 for n in ("syncer-0", "syncer-1", "a", "b"))


def _log_events(path, event: str) -> list[dict]:
    import json
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == event:
            out.append(e)
    return out


def test_a_joining_learner_takes_a_peers_adamw_state_and_versions(tmp_path, redis_server):
    """Peer bootstrap with real processes: the joiner's optimizer after loading equals the state
    the peer snapshotted (digest of every AdamW tensor, logged by both), its bases are the peer's
    merged fragments at their versions, and it goes on contributing."""
    d = Daemons(tmp_path, redis_server.url)
    r = control.connect(redis_server.url)
    keys = Keys("chaos")
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        d.start("syncer", "syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck"))
        d.learner("a")
        wait_until(lambda: int(r.hget(keys.learner("a"), "merged_contributions") or 0) >= 4, 120, interval_s=0.1,
                   what="learner a contributing")
        d.learner("b")
        wait_until(lambda: _log_events(tmp_path / "b.log", "learner.bootstrapped_optimizer"), 120, interval_s=0.1,
                   what="b bootstrapped from a")
        served = _log_events(tmp_path / "a.log", "learner.bootstrap_served")
        joined = _log_events(tmp_path / "b.log", "learner.bootstrapped")
        loaded = _log_events(tmp_path / "b.log", "learner.bootstrapped_optimizer")
        assert len(served) == 1 and served[0]["to"] == "b", served
        assert joined[0]["peer"] == "a"
        assert loaded[0]["optimizer_digest"] == served[0]["optimizer_digest"] == joined[0]["optimizer_digest"]
        assert loaded[0]["life_steps"] > 0  # the peer's place in the per-life ramp, not a fresh start
        assert joined[0]["versions_max"] >= served[0]["versions_max"] > 0
        wait_until(lambda: r.hget(keys.learner("b"), "bootstrap") == "peer a", 10, what="b's counters say so")
        b0 = int(r.hget(keys.learner("b"), "merged_contributions") or 0)
        wait_until(lambda: int(r.hget(keys.learner("b"), "merged_contributions") or 0) > b0 + 2, 60,
                   interval_s=0.1, what="b contributing")
        assert int(r.hget(keys.learner("b"), "versions_regressed") or 0) == 0
    finally:
        d.stop_all()


def test_up_chaos_injects_every_kind_restarts_it_and_nothing_goes_back(tmp_path):
    """`ddloco up --chaos` end to end (a short run; the 4-minute one is in the README): every
    kind of failure injected and restarted, a frozen learner replaced, versions never go back,
    no merge lost, every killed learner measured back, nothing left running."""
    import json
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    report = tmp_path / "report"
    spec = ("seed=3,learner_mtbf_s=25,stalls=1,stall_s=12,shard_kills=1,shard_wipes=1,broker_restarts=1,"
            "redis_restarts=1")
    res = subprocess.run([sys.executable, "-m", "ddloco", "up", "--config", str(cfg), "--learners", "3",
                          "--syncers", "2", "--minutes", "0.75", "--step-time-floor-ms", "20", "--run-id", "chaos-up",
                          "--chaos", spec, "--report", str(report), "--quiet",
                          "--extra-learners", "1", "--extra-at", "4", "--extra-for", "38"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads((report / "report.json").read_text())
    injected = rep["failures_injected"]
    for kind in ("stall", "shard_kill", "shard_wipe", "broker_restart", "redis_restart"):
        assert injected.get(kind) == 1, injected
    assert injected.get("learner_kill", 0) >= 1, injected
    assert not rep["chaos_error"], rep["chaos_error"]
    assert rep["versions_regressed"] == 0 and rep["merges_lost"] == 0
    # every killed learner that had time to come back was measured back (the schedule depends on
    # how long start-up took, so a kill can land in the last seconds of the run)
    events = rep["chaos_events"]
    kills = [e for e in events if e["kind"] == "learner_kill"]
    assert all(e.get("rejoin_s") is not None for e in kills if e["t"] < rep["wall_s"] - 20), events
    assert len(rep["rejoin_s"]) >= 1, events
    assert len(rep["detect_s"]) == injected["learner_kill"] + 1
    assert all(s is not None for s in rep["shard_back_s"]), rep["shard_back_s"]  # both shards merging again
    assert rep["eval_loss_final"] < rep["eval_loss_initial"]
    assert rep["processes_left"] == []
    # hot spares (secure run: a standby learns its id, and so its key, only when it is promoted)
    assert rep["spares_failed"] == [], rep["spares_failed"]
    if any(e["t"] > 25 for e in kills):      # spares are ready ~10-20 s after start on 2 cores
        assert rep["spares_used"] >= 1, events
    stall = next(e for e in events if e["kind"] == "stall")
    # the frozen process was a training learner (not one restarted just before), the schedule did not
    # SIGKILL it first, and the run lasted long enough for the 5 s watchdog
    touched = any(e["target"] == stall["target"] and stall["t"] - 15 < e["t"] < stall["t"] + 8 for e in kills)
    if not touched and stall["t"] < rep["wall_s"] - 10:
        assert rep["hung_replaced"] == 1, events  # the frozen learner was replaced before its 12 s were up
    extra = rep["extra_learners"]         # a temporary learner: it joined, contributed, left
    assert extra["learners"] == 1 and extra["merged_contributions"]["extra-0"] > 0, extra
    assert extra["tokens_per_s_during"] is not None and extra["eval_loss_at_end"] is not None, extra
    started = 3 + injected["learner_kill"] + rep["hung_replaced"] + 1   # + the temporary learner
    assert 3 + len(rep["rejoin_s"]) + 1 <= rep["learner_processes"] <= started, \
        (rep["learner_processes"], events)   # a replacement started in the last seconds may not have registered


def test_lockstep_from_a_toml_file_waits_for_every_live_learner_across_processes(tmp_path, redis_server):
    """`lockstep = true` in the TOML given to plain daemons (not `ddloco up`): every round waits
    for every live learner, so a learner 4x slower is in every merge and the fast one blocks."""
    import json
    d = Daemons(tmp_path, redis_server.url)
    d.cfg.write_text(TINY.replace("[algo]\n", "[algo]\nlockstep = true\n"))
    r = control.connect(redis_server.url)
    keys = Keys("chaos")
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        d.start("syncer", "syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck"))
        d.start("fast", "learner", *d.net, "--config", str(d.cfg), "--learner-id", "fast", "--data-shard", "0")
        d.start("slow", "learner", *d.net, "--config", str(d.cfg), "--learner-id", "slow", "--data-shard", "1",
                "--slowdown", "4")
        both = lambda: all(r.hget(keys.learner(n), "status") in ("training", "blocked") for n in ("fast", "slow"))  # noqa: E731
        wait_until(both, 120, interval_s=0.1, what="both learners training")
        start = len(control.read_events(r, keys, kind="merge"))
        wait_until(lambda: len(control.read_events(r, keys, kind="merge")) >= start + 10, 120, interval_s=0.1,
                   what="ten merges with both learners live")
        merges = control.read_events(r, keys, kind="merge")[start + 2:]   # rounds opened before may close first
        assert all(sorted(json.loads(e["contributors"])) == ["fast", "slow"] for e in merges), \
            [e["contributors"] for e in merges]
        assert float(r.hget(keys.learner("fast"), "blocked_s") or 0) > 0   # the fast one waited
    finally:
        d.stop_all()


def test_ddloco_chaos_against_a_cluster_started_by_hand(tmp_path, redis_server):
    """`ddloco chaos SPEC` finds the processes of a running cluster (Redis, the broker's port),
    kills them on its schedule and starts them again as they were; training goes on."""
    import json
    d = Daemons(tmp_path, redis_server.url)
    r = control.connect(redis_server.url)
    keys = Keys("chaos")
    restarted: list[int] = []
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        d.start("syncer", "syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck"))
        for name in ("a", "b"):
            d.learner(name)
        merged = lambda n: int(r.hget(keys.learner(n), "merged_contributions") or 0)  # noqa: E731
        wait_until(lambda: merged("a") >= 2 and merged("b") >= 2, 120, interval_s=0.1, what="a and b contributing")
        pids = {n: r.hget(keys.learner(n), "pid") for n in "ab"}
        out = tmp_path / "chaos.json"
        res = subprocess.run([sys.executable, "-m", "ddloco", "chaos", "seed=5,learner_mtbf_s=8,broker_restarts=1",
                              "--redis-url", redis_server.url, "--run-id", "chaos", "--broker-pub", d.xsub,
                              "--minutes", "0.3", "--log-dir", str(tmp_path / "restarted"), "--json", str(out)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        rep = json.loads(out.read_text())
        restarted = rep["restarted_processes"]
        assert rep["failures_injected"].get("broker_restart") == 1, rep["failures_injected"]
        assert rep["failures_injected"].get("learner_kill", 0) >= 1, rep["failures_injected"]
        assert not rep["chaos_error"] and rep["merges_lost"] == 0
        killed = {e["target"] for e in rep["chaos_events"] if e["kind"] == "learner_kill"}
        for n in killed:   # started again as they were: a new process under the same id, contributing
            wait_until(lambda: r.hget(keys.learner(n), "pid") != pids[n], 60, interval_s=0.1, what=f"{n} restarted")
            m = merged(n)
            wait_until(lambda: merged(n) > m, 120, interval_s=0.1, what=f"restarted {n} contributing")
    finally:
        for pid in restarted:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        d.stop_all()


def test_fetch_fragments_follows_a_shard_that_comes_back_on_another_endpoint(tmp_path, redis_server):
    """The request path with a real shard process: the shard dies while a fetch is under way and
    comes back on another port; the fetch follows the new endpoint and completes."""
    import threading
    from common.rpc import fetch_fragments
    d = Daemons(tmp_path, redis_server.url)
    r = control.connect(redis_server.url)
    keys = Keys("chaos")
    syncer = ["syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck")]
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        d.start("syncer", *syncer, "--rpc-bind", f"tcp://127.0.0.1:{free_port()}")
        wait_until(lambda: control.shard_endpoints(r, keys)[0] == 1, 60, interval_s=0.1, what="shard registered")
        before = control.shard_endpoints(r, keys)[1][0]
        assert len(fetch_fragments(r, keys, 4, timeout_s=20, security=Security(d.keys, "monitor"))) == 4
        os.kill(d.procs["syncer"].pid, signal.SIGKILL)
        d.procs["syncer"].wait(timeout=10)
        result: dict = {}

        def fetch() -> None:
            try:
                result["frags"] = fetch_fragments(r, keys, 4, timeout_s=90, security=Security(d.keys, "monitor"))
            except Exception as e:   # noqa: BLE001 - the test reports it
                result["error"] = e
        t = threading.Thread(target=fetch)
        t.start()
        d.start("syncer", *syncer, "--rpc-bind", f"tcp://127.0.0.1:{free_port()}")
        t.join(timeout=120)
        assert "error" not in result, repr(result.get("error"))
        assert len(result["frags"]) == 4
        assert control.shard_endpoints(r, keys)[1][0] != before
    finally:
        d.stop_all()


def test_a_20s_broker_stall_cuts_no_honest_answer(tmp_path, redis_server):
    """The broker is frozen (SIGSTOP) for 20 s while two learners train on: every learner's next
    answers claim the ~1,000 steps it took on one base. They are neither clamped nor clipped:
    the claims bound follows the time since the base was merged at the learner's step time, and
    the norm bound stretches with those steps. (Before: 40 answers rejected as steps_claim and
    clipped after such a stall.)"""
    import time
    d = Daemons(tmp_path, redis_server.url)
    r = control.connect(redis_server.url)
    keys = Keys("chaos")

    def merges(shard: int) -> int:
        return int(r.hget(keys.shard(shard), "merges") or 0)

    def steps() -> int:
        return sum(int(float(h.get("steps", 0))) for h in control.all_learners(r, keys).values())

    def cuts() -> dict[str, int]:
        return {f"{k}@{s}": int(v) for s in (0, 1) for k, v in r.hgetall(keys.shard(s)).items()
                if (k.startswith("rejected_") or k == "claims_clamped") and int(v)}
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        syncer = ["syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck"), "--shards", "2"]
        d.start("syncer-0", *syncer, "--shard", "0")
        d.start("syncer-1", *syncer, "--shard", "1")
        for name in ("a", "b"):
            d.learner(name)
        wait_until(lambda: merges(0) >= 12 and merges(1) >= 12, 120, interval_s=0.1, what="merges on both shards")
        assert cuts() == {}, cuts()
        os.kill(d.procs["broker"].pid, signal.SIGSTOP)
        stopped_at, s0 = time.monotonic(), steps()
        # the learners train on: 20 s at their 20 ms step floor, ~1,000 steps each on one base
        wait_until(lambda: time.monotonic() - stopped_at >= 20 and steps() >= s0 + 800, 60, interval_s=0.2,
                   what="20 s of training while the broker is frozen")
        os.kill(d.procs["broker"].pid, signal.SIGCONT)
        m0, m1 = merges(0), merges(1)
        wait_until(lambda: merges(0) >= m0 + 8 and merges(1) >= m1 + 8, 60, interval_s=0.1,
                   what="merges on both shards after the stall")
        assert cuts() == {}, f"honest answers were cut after the stall: {cuts()}"
        assert all(p.poll() is None for p in d.procs.values()), "a daemon died"
    finally:
        d.stop_all()
