"""The insider tool's own rules (ddloco/insider.py, ddloco/insider_report.py): the attack names,
the attacker's estimate of an honest update from the broadcasts, and the judging of outcomes."""
from __future__ import annotations

import pytest
import torch

from common import wire
from ddloco import insider as atk
from ddloco.insider_report import ATTACKS, state_problems, verdict

pytestmark = [pytest.mark.insider, pytest.mark.timeout(30)]


def test_attack_names_and_groups_expand_in_order_and_an_unknown_one_is_named():
    assert atk.parse_attacks("freerider,signflip") == ["signflip", "freerider"]
    assert atk.parse_attacks("all") == list(atk.ORDER)
    assert atk.parse_attacks("redis,spec")[-1] == "spec" and "lease" in atk.parse_attacks("redis")
    with pytest.raises(ValueError, match="unknown attack 'nope'"):
        atk.parse_attacks("signflip,nope")
    assert set(atk.ORDER) == set(ATTACKS)


def _frag(p: int, values: torch.Tensor, version: int, base: int) -> wire.Message:
    return wire.decode(wire.encode(kind=wire.FRAG, run="r", sender="shard0", fragment=p, values=values,
                                   codec="fp32", epoch=1, version=version, base=base))


def test_the_replica_takes_the_update_from_a_quantized_broadcast_or_two_full_values():
    rep = atk.Replica()
    rep.on_message(_frag(0, torch.ones(4), 5, -1))            # a full value alone: no update yet
    assert 0 not in rep.update and atk.signflip_delta(rep, 0, 4) is None
    rep.on_message(_frag(0, torch.full((4,), 3.0), 6, -1))    # a second one: the difference
    assert torch.equal(rep.update[0], torch.full((4,), 2.0))
    assert torch.equal(atk.signflip_delta(rep, 0, 4), torch.full((4,), -16.0))
    rep.on_message(_frag(1, torch.tensor([3.0, 4.0]), 2, 1))  # an update broadcast (base >= 0)
    assert rep.median_norm(1) == pytest.approx(5.0)
    flipped = atk.adaptive_delta(rep, 1, 2)
    assert flipped.norm() == pytest.approx(0.9 * atk.CLIP_FACTOR * 5.0)
    assert torch.dot(flipped, rep.update[1]) < 0
    assert atk.signflip_delta(rep, 1, 3) is None               # another size: no answer


def _state(**kw) -> dict:
    st = {"tokens": 100, "token_shares_sum": 100, "members": ["learner-0"], "immortal_members": [],
          "shards": ["0", "1"], "shards_configured": 2, "epochs": 3,
          "leases": {"0": {"holder": "h:1:1", "ttl_ms": 2000}, "1": {"holder": "h:2:2", "ttl_ms": 2000}}}
    st.update(kw)
    return st


def test_state_problems_name_the_attack_that_leaves_each():
    assert state_problems(_state()) == {}
    bad = state_problems(_state(tokens=10**15, immortal_members=["ghost-0"], shards=["0", "1", "2", "x"],
                                epochs=2**63 - 1, leases={"1": {"holder": "evil", "ttl_ms": -1}}))
    assert set(bad) == {"tokens", "ghosts", "fake-shard", "shards-x", "lease", "epochs"}


def _entry(**over) -> dict:
    e = {"attacker": {}, "merges": {"attacker_weight_max": 0.3},
         "cluster": {"crashes": [], "training_went_on": True, "eval_loss": [1.0, 1.05], "merge_rate_before": 10.0,
                     "merge_rate_during": 9.0, "rss_growth_mib": {"broker": 1.0}},
         "problems_after": {}}
    for k, v in over.items():
        e[k] = {**e[k], **v} if isinstance(e[k], dict) else v
    return e


def test_verdicts_name_what_an_attacker_achieved_and_pass_a_defended_outcome():
    assert verdict("signflip", _entry()) == []
    assert verdict("signflip", _entry(merges={"attacker_weight_max": 0.94}))[0].startswith("an attacker answer took 94%")
    assert verdict("freerider", _entry(cluster={"eval_loss": [1.0, float("nan")]})) == ["eval loss nan"]
    assert verdict("signflip", _entry(cluster={"crashes": ["learner-1"]}))[0] == "processes gone: ['learner-1']"
    assert verdict("tokens", _entry(attacker={"allowed": False})) == []
    assert verdict("tokens", _entry(attacker={"allowed": True}, problems_after={"tokens": "high"})) == \
        ["after the attack: high"]
    assert verdict("scan", _entry(attacker={"allowed": False, "scan_allowed": True, "foreign_keys": 3}))
    assert verdict("subscriptions", _entry(cluster={"rss_growth_mib": {"broker": 22.0}}))
    assert verdict("spec", _entry(attacker={"allowed": True, "marker_appeared": False})) == []
