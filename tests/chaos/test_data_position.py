"""Chaos: the batches each data stream trained on, across a SIGTERM restart, a SIGKILL replaced by
a hot spare, and joins from a peer (real processes, real signals; the learners' ``--batch-log``).

The guarantee (docs/architecture.md, "Data position"): every batch index of a stream gets exactly
one inner step over all the lives of its learner id, a SIGKILL included (each step's position is
written before it takes its batches: ``--position-writes step``; ``auto``, the default, does so
while a write costs at most 2 % of a step, which this test's 20 ms steps on loaded cores miss). With ``--position-writes
heartbeat`` a SIGKILLed life's successor trains again the batches since its last heartbeat
(bounded; never a gap).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

from common import control
from common.keys import Keys
from common.security import create_keys
from learner.peer_link import PEER_SERVE_INTERVAL_S
from tests.chaos.test_learner_faults import Daemons, _log_events
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_S = 0.2           # TINY's heartbeat_interval_s
STEP_FLOOR_S = 0.02         # TINY's step_time_floor_ms
TOKENS_PER_BATCH = 4 * 16   # TINY_TOML: batch_size × seq_len
BATCHES_PER_STEP = 1        # TINY_TOML: inner_grad_accum (the default)


def _indices(path) -> list[tuple[int, int]]:
    """(stream, index) lines of a batch log, in order."""
    out = []
    for line in path.read_text().splitlines():
        stream, index = line.split()
        out.append((int(stream), int(index)))
    return out


def _stream_of(path, stream: int) -> list[int]:
    lines = _indices(path)
    assert {s for s, _ in lines} <= {stream}, f"{path.name} logged another stream than {stream}: {set(lines)}"
    return [i for _, i in lines]


def _consecutive(indices: list[int], start: int, what: str) -> None:
    assert indices, f"{what}: no batch trained"
    assert indices == list(range(start, start + len(indices))), \
        f"{what}: expected {start}..{start + len(indices) - 1} once each in order, got {indices[:5]}...{indices[-5:]}"


def test_streams_continue_at_their_exact_position_across_restarts_kills_and_peer_joins(tmp_path, redis_server):
    """Learners a (stream 0) and b (stream 1) train. b is stopped with SIGTERM, Redis restarts
    empty while b is down, and b is started again (it joins from peer a): its stream goes on at
    the very next batch. The restarted b is SIGKILLed and a hot spare, prepared beforehand,
    becomes b (from a peer): it goes on at the batch after the last one the killed life took,
    none again, none skipped (the killed life trained on after its last heartbeat: the run's
    token count stops at that heartbeat). a's stream has no repeat and no gap. Another spare joins mid-run as
    a new learner c: its own stream, from batch 0."""
    d = Daemons(tmp_path, redis_server.url)
    r = control.connect(redis_server.url)
    keys = Keys("chaos")
    logs = {n: tmp_path / f"{n}.batches" for n in ("a", "b1", "b2", "b3", "c")}

    def hash_of(lid: str) -> dict:
        return r.hgetall(keys.learner(lid))

    def trained(name: str) -> int:
        return len(logs[name].read_text().splitlines()) if logs[name].exists() else 0

    def promote(name: str, lid: str, shard: int) -> None:
        spares[name].stdin.write(json.dumps({"learner_id": lid, "data_shard": shard}).encode() + b"\n")
        spares[name].stdin.flush()
    try:
        d.start("broker", "broker", "--xsub", d.xsub, "--xpub", d.xpub)
        d.start("syncer", "syncer", *d.net, "--config", str(d.cfg), "--checkpoint-dir", str(tmp_path / "ck"))
        for name, lid, shard in (("a", "a", 0), ("b1", "b", 1)):
            d.start(name, "learner", *d.net, "--config", str(d.cfg), "--learner-id", lid, "--data-shard", str(shard),
                    "--batch-log", str(logs[name]), "--position-writes", "step")
        spares = {name: _standby(d, name, logs[name]) for name in ("b3", "c")}
        wait_until(lambda: trained("a") >= 12 and trained("b1") >= 12, 60, interval_s=0.05, what="a and b training")

        # SIGTERM: b leaves with its final position; the shard reads it; Redis restarts empty
        d.procs["b1"].send_signal(signal.SIGTERM)
        assert d.procs["b1"].wait(timeout=20) == 0
        left_at = int(hash_of("b")["data_position"])
        _two_shard_refreshes(r, keys, after=time.time())
        redis_server.restart_empty()
        d.start("b2", "learner", *d.net, "--config", str(d.cfg), "--learner-id", "b", "--data-shard", "1",
                "--batch-log", str(logs["b2"]), "--position-writes", "step")
        wait_until(lambda: trained("b2") >= 12, 60, interval_s=0.05, what="the restarted b training")
        # a peer serves one joiner per PEER_SERVE_INTERVAL_S: b's spare must not ask while a's
        # serve of b2 still counts (12 steps can take less than that)
        served = _log_events(tmp_path / "a.log", "learner.bootstrap_served")
        assert served, "b2 joined from a: a logged its serve"
        served_at = datetime.fromisoformat(served[-1]["timestamp"].replace("Z", "+00:00")).timestamp()
        wait_until(lambda: time.time() - served_at > PEER_SERVE_INTERVAL_S, 10, interval_s=0.05,
                   what="a's serve interval since it served b2")

        # SIGKILL: the position the killed life wrote before its last step is where its successor starts
        d.procs["b2"].kill()
        d.procs["b2"].wait(timeout=10)
        recorded = hash_of("b")
        recorded_at = max(int(recorded["data_position"]), int(recorded.get("position_ahead", 0)))
        heartbeat_at = int(recorded["data_position"])
        promote("b3", "b", 1)
        wait_until(lambda: _log_events(tmp_path / "b3.log", "learner.joined"), 30, interval_s=0.05,
                   what="the spare joined as b")    # before c asks: a peer serves one joiner a second
        promote("c", "c", 2)     # a new learner mid-run, its own stream
        wait_until(lambda: trained("b3") >= 12 and trained("c") >= 12, 60, interval_s=0.05,
                   what="the spares (now b and c) training")
    finally:
        d.stop_all()
    for name in ("a", "b3", "c"):
        assert d.procs[name].returncode == 0, f"{name} exited {d.procs[name].returncode}"

    a, c = _stream_of(logs["a"], 0), _stream_of(logs["c"], 2)
    b1, b2, b3 = (_stream_of(logs[n], 1) for n in ("b1", "b2", "b3"))
    _consecutive(a, 0, "a, never restarted")
    _consecutive(c, 0, "c, a new learner with a stream of its own")
    _consecutive(b1, 0, "b's first life")
    assert left_at == b1[-1] + 1, f"b left at {left_at}, its last batch was {b1[-1]}"
    _consecutive(b2, left_at, "b after a SIGTERM and Redis restarted empty: the next batch, none again, none skipped")
    # the killed life's id records the batch after its last one; or, when the SIGKILL landed
    # between the write of a step's position (before the step takes its batches) and the log line
    # of its batch (the write's Redis round trip), after that step's batch too: a step killed
    # half-way counts as taken (docs/architecture.md, "Data position"), never trained twice
    assert recorded_at - (b2[-1] + 1) in (0, BATCHES_PER_STEP), \
        f"the killed b took batches up to {b2[-1]}, its id records {recorded_at}"
    _consecutive(b3, recorded_at, "b's spare after the SIGKILL: at the recorded batch, none again, none skipped")
    # the run counts the killed life's tokens up to its last heartbeat (its life hash, the source
    # of its token share): what it trained after that is lost with it, and counted by no one
    killed = control.learner_lives(r, keys)[("b", recorded["incarnation"])]
    assert int(killed["tokens"]) == (heartbeat_at - left_at) * TOKENS_PER_BATCH, (killed["tokens"], heartbeat_at)
    assert heartbeat_at <= recorded_at
    for name in ("b2", "b3"):     # each restart of b joined from a training peer (c may be refused: a
        # peer serves one joiner per interval; where c's parameters come from is not its data position)
        joined = _log_events(tmp_path / f"{name}.log", "learner.bootstrapped")
        assert joined and joined[0]["peer"] != "b", (name, joined)
    for name in ("a", "b3"):      # a started learner and a promoted spare: their imports ran with the
        # collector paused (common/lean.py); it is on again once they join, their imports frozen out of it
        joined = _log_events(tmp_path / f"{name}.log", "learner.joined")
        assert joined and joined[0]["gc_on"] is True and joined[0]["gc_frozen"] > 10_000, (name, joined[:1])


def _two_shard_refreshes(r, keys: Keys, *, after: float) -> None:
    """Wait until the shard has read the learners twice since ``after`` (its second read began
    after its first one had written: after ``after``)."""
    def refreshed_since(t: float) -> float | None:
        at = float(r.hget(keys.shard(0), "heartbeat_at") or 0)
        return at if at > t else None
    first = wait_until(lambda: refreshed_since(after), 10, what="a shard refresh")
    wait_until(lambda: refreshed_since(first), 10, what="a second shard refresh")


def _standby(d: Daemons, name: str, batch_log) -> subprocess.Popen:
    """A hot spare (``learner --standby``, how `ddloco up` replaces a failed learner), prepared
    now; it becomes a learner when told which on its stdin. Logs to NAME.log; stopped by ``stop_all``."""
    create_keys(d.keys, learners=[name[0]], broker=False, monitors=())   # its id once promoted: b or c
    log = open(d.tmp / f"{name}.log", "ab")
    p = subprocess.Popen([sys.executable, "-m", "ddloco", "learner", "--standby", *d.net, "--config", str(d.cfg),
                          "--batch-log", str(batch_log), "--position-writes", "step"], stdin=subprocess.PIPE, stdout=log,
                         stderr=subprocess.STDOUT,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", "DDLOCO_KEYS": str(d.keys)})
    d.procs[name] = p
    return p
