"""The figures of an `up` run from the monitor's counters (ddloco/run_figures.py), at a fixed `now`."""
import pytest

from ddloco.run_figures import global_downtime, learner_processes, learner_time, problems

pytestmark = pytest.mark.timeout(30)


def test_a_slot_is_provisioned_from_its_first_join_to_its_last_process_end_gaps_included():
    killed = {"started_at": "100", "boot_s": "5", "updated_at": "140", "train_s": "30", "flush_s": "0"}
    replacement = {"started_at": "150", "boot_s": "2", "stopped_at": "200", "train_s": "40", "flush_s": "4"}
    running = {"started_at": "100", "boot_s": "10", "train_s": "50"}          # no heartbeat yet: `now`
    provisioned, useful, flushing = learner_time([[killed, replacement], [running], []], t0=90.0, now=170.0)
    assert provisioned == (200 - 105) + (170 - 110)
    assert useful == 30 + 40 + 50 and flushing == 4


def test_downtime_counts_only_gaps_between_merges_longer_than_the_limit():
    learners = [{"started_at": "0", "boot_s": "10", "stopped_at": "100"},
                {"started_at": "5", "boot_s": "0", "stopped_at": "90"}]   # boot 0: not counted as joined
    downtime, span = global_downtime([12.0, 20.0, 50.0, 55.0, 150.0], learners, t0=0.0, gap_s=10.0)
    assert span == 90.0                       # 10 (first join) .. 100 (last stop)
    assert downtime == pytest.approx(30.0 + 45.0)   # 20 -> 50 and 55 -> 100; 10 -> 12 and 12 -> 20 are short


def test_learner_processes_are_counted_once_from_counters_events_and_the_table():
    lives = {("a", "1"): {"incarnation": "1"}, ("a", "2"): {"incarnation": "2"}}
    events = [{"kind": "join", "learner": "b", "incarnation": "7"}, {"kind": "leave", "learner": "c", "incarnation": "9"}]
    assert learner_processes(lives, events, {"a": {"incarnation": "2"}, "b": {"incarnation": "7"}}) == 3


def test_a_run_whose_model_did_not_improve_or_whose_fragment_never_merged_has_problems():
    assert problems({"eval_loss_initial": 3.0, "eval_loss_final": 2.0}) == []
    assert problems({"eval_loss_initial": 3.0, "eval_loss_final": 3.0, "fragments_never_merged": [2]}) == [
        "fragment(s) 2 never merged (their values are the initial model's)",
        "the final model's eval loss 3.0000 is not below the initial 3.0000"]
