"""The pure parts of `ddloco compare --chaos/--hetero`: the shared schedule, the mixed-hardware
spec, the figures from a wall-time curve, and the schedule replay of the simulator."""
from __future__ import annotations

import pytest

from common.config import ConfigError
from ddloco.chaos_plan import ChaosSpec
from ddloco.compare.failures import parse_hetero, plan_schedule, with_targets
from ddloco.sim.replay import predict


def test_the_schedule_is_seeded_per_rank_poisson_and_shared() -> None:
    spec = ChaosSpec(seed=3, learner_mtbf_s=60.0)
    a, b = plan_schedule(spec, 4, 300.0), plan_schedule(spec, 4, 300.0)
    assert a == b and a == sorted(a, key=lambda f: f.at_s)
    assert {f.target for f in a} == {f"learner-{i}" for i in range(4)}
    assert all(15.0 <= f.at_s < 1200.0 for f in a)
    # about one kill per learner-minute over 4 x 300 s x 4 learners (80 expected)
    assert 50 <= len(a) <= 115
    assert plan_schedule(ChaosSpec(seed=4, learner_mtbf_s=60.0), 4, 300.0) != a
    assert plan_schedule(ChaosSpec(seed=3), 4, 300.0) == []


def test_hetero_spec_makes_the_last_learners_slower_and_refuses_nonsense() -> None:
    h = parse_hetero("slow=1,factor=1.25,noise=0.05")
    assert h.factors(4) == [1.0, 1.0, 1.0, 1.25] and h.noise == 0.05
    assert parse_hetero("factor=1.2").factors(4) == [1.0, 1.0, 1.2, 1.2]
    for bad in ("factor=0.5", "speed=2", "noise=x", "noise=2"):
        with pytest.raises(ConfigError):
            parse_hetero(bad)


def test_targets_and_equal_wall_read_each_runs_curve() -> None:
    runs = [{"span_s": 10.0, "wall_curve": [[0.0, 5.0], [4.0, 3.0], [9.0, 2.0]]},
            {"span_s": 20.0, "wall_curve": [[0.0, 5.0], [8.0, 4.0], [15.0, 2.5], [20.0, 1.9]]}]
    with_targets(runs, 2.6)
    assert [r["wall_s_to_target"] for r in runs] == [9.0, 15.0]
    assert [r["eval_loss_at_wall"] for r in runs] == [2.0, 4.0]      # both at 10 s
    with_targets(runs, 1.0)
    assert [r["wall_s_to_target"] for r in runs] == [None, None]


def test_replay_charges_the_elastic_group_for_every_kill_and_ours_for_one_learner() -> None:
    kills = [{"kind": "learner_kill", "target": "learner-0", "at_s": 30.0}]
    kw = dict(learners=4, steps=1000, step_s=0.2, factors=[1.0] * 4, checkpoint_every=50, sync_every=12,
              restart_s=5.0, rejoin_s=1.0)
    assert predict("dp_elastic", [], **kw)["goodput"] == pytest.approx(1.0)
    dp = predict("dp_elastic", kills, **kw)
    # 150 steps done at 30 s, back to 150 (a checkpoint): nothing lost but the restart
    assert dp["span_s"] == pytest.approx(205.0) and dp["lost_steps"] == 0
    late = predict("dp_elastic", [{**kills[0], "at_s": 39.0}], **kw)   # 195 steps: 45 lost on each rank
    assert late["lost_steps"] == 45 * 4 and late["span_s"] == pytest.approx(39.0 + 5.0 + (1000 - 150) * 0.2)
    ours = predict("decoupled", kills, **kw)
    assert ours["span_s"] == pytest.approx(201.0) and ours["goodput"] > dp["goodput"]
    # lock-step: a kill (H - 1) / 2 steps into a block, on average, stops everyone for the rejoin and
    # those steps (the replacement's whole block less the others' rest of theirs); kills in time
    # order, each pushing the end (one past the end hits nothing), the cap where it binds
    lockstep = predict("decoupled_lockstep", kills, **kw)
    assert lockstep["span_s"] == pytest.approx(200.0 + 1.0 + 5.5 * 0.2) and lockstep["lost_steps"] == 5.5
    after = [*kills, {**kills[0], "at_s": 202.0}, {**kills[0], "at_s": 204.0}]   # 202 < 202.1, then 204 < 204.2
    assert predict("decoupled_lockstep", after, **kw)["lost_steps"] == 5.5 * 3
    past = [*kills, {**kills[0], "at_s": 210.0}]                                  # after the pushed end: missed
    assert predict("decoupled_lockstep", past, **kw)["span_s"] == pytest.approx(202.1)
    lcap = predict("decoupled_lockstep", kills, **kw, cap_s=100.0)
    assert lcap["span_s"] == 100.0 and lcap["goodput"] == pytest.approx(((100 - 2.1) / 0.2 - 5.5 / 4) / 500, abs=1e-6)
    capped = predict("dp_elastic", kills, **kw, cap_s=100.0)
    assert capped["span_s"] == 100.0 and capped["goodput"] == pytest.approx(((100 - 35) / 0.2 + 150) * 0.2 / 100)


def test_goodput_counts_useful_steps_over_each_ranks_own_provisioned_time() -> None:
    from ddloco.compare.failures import Setting, goodput_of
    st = Setting(learners=2, steps=100, per_batch=10, floor_ms=100.0, factors=[1.0, 1.5], noise=0.0, chaos=None,
                 checkpoint_every=10, syncers=1, insecure=True, device="cpu", eval_every_s=5.0)
    # our learners: each done at its own pace, the slow one with 10 of its steps never merged
    ours = {"system": "decoupled", "timeline": {"learner-0": [[0.0, 10.0]], "learner-1": [[0.0, 15.0]]},
            "extra": {"merged_steps": {"learner-0": 100.0, "learner-1": 90.0}}}
    assert goodput_of(ours, st) == pytest.approx((10.0 + 90 * 0.15) / 25.0, abs=1e-4)
    # DP: both ranks at the slow pace (the fast one waits in the all-reduce)
    dp = {"system": "dp_elastic", "tokens": 100 * 2 * 10,
          "timeline": {"learner-0": [[0.1, 15.0]], "learner-1": [[0.15, 15.0]]}}
    assert goodput_of(dp, st) == pytest.approx((10.0 + 15.0) / 30.0, abs=1e-4)


def test_a_group_that_waits_for_noisy_ranks_is_paced_by_the_slowest_draw() -> None:
    from ddloco.sim.replay import paced_step
    assert paced_step([0.2, 0.24], 0.0) == 0.24
    per_step = paced_step([0.2, 0.2, 0.24, 0.24], 0.1)
    per_block = paced_step([0.2, 0.2, 0.24, 0.24], 0.1, block=12)
    assert per_step > per_block > 0.24          # the max of noisy draws; averaged over a block, less so
    assert per_step == paced_step([0.2, 0.2, 0.24, 0.24], 0.1)   # seeded


def test_downtime_counts_gaps_beyond_the_runs_own_rhythm() -> None:
    from ddloco.compare.side_setting import _advances_downtime
    steady = [0.2 * k for k in range(1, 100)]                       # DP: a step every 0.2 s, one 5 s hole
    holed = [t for t in steady if not 8.0 < t < 13.0]
    assert _advances_downtime(steady, 0.0, 20.0, 1.0) == 0.0
    assert 5.0 <= _advances_downtime(holed, 0.0, 20.0, 1.0) <= 5.4
    bursts = [2.4 * k + 0.001 * i for k in range(1, 9) for i in range(24)]   # lock-step: 24 merges per 2.4 s
    assert _advances_downtime(bursts, 0.0, 20.0, 1.0) == 0.0
