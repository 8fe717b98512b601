"""The dashboard's pure parts: action requests checked before anything happens, the merge
event's alignment read off the RDA accumulator, merge events as the page's rows."""
from __future__ import annotations

import math

import pytest
import torch

from common.merge import OuterAccumulator
from ddloco.dashboard.actions import ActionError, parse_action
from ddloco.dashboard.collect import merge_row


@pytest.mark.parametrize("body, problem", [
    ({"action": "reboot"}, "action must be one of"),
    ({"action": "kill"}, "kill needs a learner"),
    ({"action": "stall", "learner": "a", "seconds": 0}, "stall needs"),
    ({"action": "stall", "learner": "a", "seconds": 1e9}, "stall needs"),
    ({"action": "add", "n": 0, "seconds": 10}, "add needs"),
    ({"action": "add", "n": "x", "seconds": 10}, "integer"),
])
def test_a_bad_action_is_refused_naming_what_is_wrong(body, problem):
    with pytest.raises(ActionError, match=problem):
        parse_action(body)


def test_good_actions_parse():
    assert parse_action({"action": "stall", "learner": "l1", "seconds": 5}).seconds == 5.0
    assert parse_action({"action": "add", "n": 2, "seconds": 30}).n == 2
    assert parse_action({"action": "checkpoint"}).kind == "checkpoint"


def _alignment(deltas: list[torch.Tensor], weights: list[float]) -> float | None:
    n = deltas[0].numel()
    acc = OuterAccumulator(n, [(0, n, "param")], "rda", robust_radius=True)
    theta, base = torch.zeros(n), torch.zeros(n)
    for d, w in zip(deltas, weights):
        acc.add_answer(theta, base, d, w)
    acc.result()
    return acc.alignment


def test_alignment_is_the_weighted_mean_pairwise_cosine():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(1000, generator=g) for _ in range(3))
    assert _alignment([a, 2 * a], [0.5, 0.5]) == pytest.approx(1.0, abs=1e-5)
    assert _alignment([a, -a], [0.5, 0.5]) == pytest.approx(-1.0, abs=1e-5)
    cos = lambda x, y: float(x @ y / (x.norm() * y.norm()))  # noqa: E731
    w = [0.5, 0.3, 0.2]
    pairs = [(i, j) for i in range(3) for j in range(3) if i != j]
    vs = [a, b, a + c]
    want = sum(w[i] * w[j] * cos(vs[i], vs[j]) for i, j in pairs) / sum(w[i] * w[j] for i, j in pairs)
    assert _alignment(vs, w) == pytest.approx(want, abs=1e-4)
    assert _alignment([a], [1.0]) is None


def test_a_merge_event_becomes_a_row_and_a_malformed_one_does_not_break_it():
    row = merge_row({"kind": "merge", "t": "12.5", "fragment": "3", "version": "7", "shard": "0",
                     "contributors": '["l0", "l1"]', "weights": "[0.6, 0.4]", "staleness": "[0, 1]",
                     "norms": "[1.5, 2.0]", "grace_waited_s": "0.2", "grace_s": "0.5", "alignment": "0.8"})
    assert row["quorum"] == 2 and row["staleness"] == [0, 1] and row["alignment"] == 0.8
    bad = merge_row({"kind": "merge", "contributors": "not json", "weights": "{", "alignment": ""})
    assert bad["quorum"] == 0 and bad["alignment"] is None and math.isfinite(bad["t"])


def test_the_view_marks_chaos_faults_bootstraps_and_leaves_on_their_learners(redis_server):
    import redis as redis_lib
    from common import control
    from common.config import RunConfig
    from common.keys import Keys
    from ddloco.dashboard.collect import RunView
    r = redis_lib.Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys("dash")
    control.publish_run_config(r, keys, RunConfig())
    view = RunView(r, keys)
    r.hset(keys.learner("l0"), mapping={"incarnation": "a", "status": "training", "bootstrap": "peer l1", "tokens": 10})
    control.add_event(r, keys, "chaos", action="learner_kill", target="l0", reason="injected by the chaos harness")
    control.add_event(r, keys, "merge", fragment=0, version=1, shard=0, contributors=["l0"], weights=[1.0])
    control.add_learner_event(r, keys, "l0", "leave", incarnation="a")
    snap = view.poll(now=100.0)
    kinds = {(m["kind"], m["learner"]) for m in snap["marks"]}
    assert {("chaos", "l0"), ("bootstrap", "l0"), ("leave", "l0")} <= kinds, snap["marks"]
    assert snap["merges_seen"] == 1 and snap["heat"][0][1] == 0
    assert any(state == "gone" for _, _, state in snap["lanes"]["l0"])
    again = view.poll(now=101.0)   # the streams are read from where the last poll stopped
    assert again["merges_seen"] == 1 and len(again["marks"]) == len(snap["marks"])
    r.hset(keys.learner("l0"), mapping={"incarnation": "b", "bootstrap": "shards"})
    assert [m["text"] for m in view.poll(now=102.0)["marks"] if m["kind"] == "bootstrap"] == ["peer l1", "shards"]
