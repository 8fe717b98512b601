"""A learner that is a torchrun job (learner/group.py): 2 gloo ranks, one learner of the run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddloco.bench.group import log_events
from common import control
from common.keys import Keys
from tests.conftest import start_hand_daemons, stop_processes

pytestmark = pytest.mark.timeout(300)


def _train_solo_and_pair(net: list[str], env: dict, procs: list, *extra: str) -> str:
    """A 1-process learner "solo" and a 2-rank torchrun learner "pair", 60 steps each, side by
    side in one run; both must end well. Returns the pair's output (both ranks' logs)."""
    solo = subprocess.Popen([sys.executable, "-m", "learner", *net, "--learner-id", "solo", "--steps", "60",
                             "--step-time-floor-ms", "30"],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    group = subprocess.Popen([sys.executable, "-m", "ddloco", "learner", "--nproc", "2", *net, *extra,
                              "--learner-id", "pair", "--steps", "60", "--step-time-floor-ms", "30"],
                             env=env, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True)
    procs += [solo, group]
    out, _ = group.communicate(timeout=240)
    assert group.returncode == 0, out[-3000:]
    _, err = solo.communicate(timeout=120)
    assert solo.returncode == 0, err[-2000:]
    return out


def test_a_two_rank_torchrun_learner_contributes_and_every_rank_receives_the_merges(tmp_path, redis_server):
    d = start_hand_daemons(tmp_path, redis_server.url, "grp")
    net, env, procs = d.net, d.env, d.procs
    try:
        out = _train_solo_and_pair(net, env, procs)

        # both ranks trained 60 steps and ended with the same parameters: rank 1 received every
        # merged fragment rank 0 applied (without the boundary broadcast they drift apart)
        trained = {e["rank"]: e for e in log_events(out, "learner.group_trained")}
        assert set(trained) == {0, 1}, out[-3000:]
        assert trained[0]["steps"] == trained[1]["steps"] == 60
        assert trained[0]["params_digest"] == trained[1]["params_digest"]
        assert log_events(out, "learner.group")[0]["backend"] == "gloo"

        # the run saw one learner "pair" (no rank 1 member) with twice the tokens per step of "solo"
        r = control.connect(redis_server.url)
        keys = Keys("grp")
        members = {e["learner"] for e in control.read_events(r, keys, kind="join")}
        assert members == {"solo", "pair"}
        pair, alone = r.hgetall(keys.learner("pair")), r.hgetall(keys.learner("solo"))
        assert int(pair["steps"]) == int(alone["steps"]) == 60
        assert int(pair["tokens"]) == 2 * int(alone["tokens"]) > 0
        assert int(pair["answers"]) >= 1 and int(pair["merges_applied"]) >= 1
        res = subprocess.run([sys.executable, "-m", "ddloco", "status", "--json", *net[:-2]], capture_output=True,
                             text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["learners"]["pair"]["merged_contributions"] >= 1

        # a group whose rank 0 the run refuses ends at once, even when a refusal exits 0 (compose's
        # setting): rank 1 is told, it does not wait 30 min in a collective for a rank 0 that is gone
        refused = subprocess.run([sys.executable, "-m", "ddloco", "learner", "--nproc", "2", *net, "--quorum", "2",
                                  "--learner-id", "odd", "--steps", "5"], env={**env, "DDLOCO_REFUSED_EXIT_CODE": "0"},
                                 capture_output=True, text=True, timeout=180)
        text = refused.stdout + refused.stderr
        assert refused.returncode == 0 and "algo.quorum=2 (run has 1)" in text, text[-3000:]
        assert [e["rank"] for e in log_events(text, "learner.group_aborted")] == [1], text[-3000:]
    finally:
        stop_processes(procs)


def test_a_sharded_two_rank_learner_answers_and_applies_merges_at_step_boundaries(tmp_path, redis_server):
    """``--group-sharding fsdp``: each rank holds part of the model; rank 0 answers rounds and
    carries its steps over merges with fragments the group gathers at step boundaries."""
    d = start_hand_daemons(tmp_path, redis_server.url, "fsdp")
    net, env, procs = d.net, d.env, d.procs
    try:
        out = _train_solo_and_pair(net, env, procs, "--group-sharding", "fsdp")

        assert log_events(out, "learner.group")[0]["sharding"] == "fsdp"
        held = {e["rank"]: e for e in log_events(out, "learner.group_sharded")}
        assert set(held) == {0, 1}, out[-3000:]
        total = held[0]["of"]
        assert 0 < held[0]["holds"] < total and 0 < held[1]["holds"] < total    # neither rank has it all
        assert held[0]["holds"] + held[1]["holds"] >= total
        trained = {e["rank"]: e for e in log_events(out, "learner.group_trained")}
        assert trained[0]["steps"] == trained[1]["steps"] == 60
        assert trained[0]["params_digest"] == trained[1]["params_digest"]   # (gathered alike: by construction)
        # merges rank 0 applied while training reached both ranks' shards: beyond the join's 4
        # fragments, every rank wrote the values of the merges shared at step boundaries
        assert trained[0]["fragments_shared"] == trained[1]["fragments_shared"] >= 4 + 3, trained

        r = control.connect(redis_server.url)
        keys = Keys("fsdp")
        pair, alone = r.hgetall(keys.learner("pair")), r.hgetall(keys.learner("solo"))
        assert int(pair["tokens"]) == 2 * int(alone["tokens"]) > 0
        assert int(pair["answers"]) >= 3 and int(pair["merges_applied"]) >= 3
        # it learnt: the training loss of the pair is well below a byte model's start (ln 256 = 5.55)
        assert 0 < float(pair["loss_ema"]) < 5.0, pair
        assert pair["peer"] == "" and alone["peer"]   # no joiner asks it for AdamW state it holds 1/N of
        res = subprocess.run([sys.executable, "-m", "ddloco", "status", "--json", *net[:-2]], capture_output=True,
                             text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["learners"]["pair"]["merged_contributions"] >= 3
    finally:
        stop_processes(procs)
