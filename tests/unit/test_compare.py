"""`ddloco compare` pieces: statistics, settings, token budgets, in-process systems."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from common.config import AlgoConfig, ConfigError, RunConfig
from ddloco.compare import runner, systems

from common.task import load_task

TINY = dict(n_layer=1, n_embd=16, n_head=2, seq_len=16, batch_size=4, eval_batches=2, corpus_max_bytes=300_000)


def test_mean_ci_is_the_student_t_interval() -> None:
    m, lo, hi = runner.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0
    assert hi - m == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=2e-4)   # t tables' 3 decimals
    assert m - lo == pytest.approx(hi - m)
    assert runner.mean_ci([5.0]) == (5.0, 5.0, 5.0)
    # twelve seeds: t with 11 degrees of freedom (2.201), not the normal's 1.96
    twelve = [float(i) for i in range(12)]
    m, lo, hi = runner.mean_ci(twelve)
    assert hi - m == pytest.approx(2.201 * statistics.stdev(twelve) / math.sqrt(12), rel=2e-4)
    assert runner._t95(60) == pytest.approx(2.000, abs=0.002) and runner._t95(120) == pytest.approx(1.980, abs=0.002)


def test_set_overrides_parse_json_values_and_refuse_unknown_keys() -> None:
    sets = runner.parse_set(["algo.outer_lr=1.5", "algo.carry_local_steps=true", "task.seed=3", "task.n_layer=2"])
    run = runner.apply_sets(RunConfig(), sets)
    assert run.algo.outer_lr == 1.5 and run.algo.carry_local_steps is True and run.task.seed == 3
    assert run.task.args == {"n_layer": 2}
    with pytest.raises(ConfigError, match="unknown key"):
        runner.apply_sets(RunConfig(), runner.parse_set(["algo.outer_lrr=1"]))
    with pytest.raises(ConfigError, match="--set wants"):
        runner.parse_set(["outer_lr=1"])


def test_eval_steps_are_spread_and_end_at_the_budget() -> None:
    assert systems.eval_steps(400, 4) == [100, 200, 300, 400]
    assert systems.eval_steps(3, 8) == [1, 2, 3]


def test_summary_ratios_are_paired_by_seed() -> None:
    def run(system: str, seed: int, loss: float) -> dict:
        return {"system": system, "seed": seed, "tokens": 100, "wall_s": 1.0, "eval_loss_final": loss,
                "curve": [[0, 5.0], [100, loss]], "bytes_per_token": 0.0}
    out = runner.summarise({"dp": [run("dp", 0, 2.0), run("dp", 1, 3.0)],
                            "decoupled": [run("decoupled", 0, 2.2), run("decoupled", 1, 3.3)]}, 2)
    assert out["decoupled"]["ratio_to_dp"] == pytest.approx(1.1)
    assert out["decoupled"]["ratio_to_dp_ci"][0] == pytest.approx(1.1)   # identical ratios: zero width
    assert "ratio_to" not in out["decoupled"]
    assert out["dp"]["curve"]["tokens"] == [0, 50, 100]
    assert out["dp"]["curve"]["mean"][1] == pytest.approx((3.5 + 4.0) / 2)


def test_summary_pairs_the_defaults_with_their_fp32_and_lockstep_variants(tmp_path) -> None:
    def run(system: str, seed: int, loss: float) -> dict:
        return {"system": system, "seed": seed, "tokens": 100, "wall_s": 1.0, "eval_loss_final": loss,
                "curve": [[0, 5.0], [100, loss]], "bytes_per_token": 0.0}
    out = runner.summarise({"decoupled": [run("decoupled", 0, 2.0), run("decoupled", 1, 3.0)],
                            "decoupled_fp32": [run("decoupled_fp32", 0, 2.5), run("decoupled_fp32", 1, 2.0)],
                            "decoupled_lockstep": [run("decoupled_lockstep", 1, 2.0)]}, 2)
    m, lo, hi = out["decoupled"]["ratio_to"]["decoupled_fp32"]
    assert m == pytest.approx((0.8 + 1.5) / 2) and lo < 0.8 and hi > 1.5          # per seed, not of the means
    assert out["decoupled"]["ratio_to"]["decoupled_lockstep"] == pytest.approx([1.5, 1.5, 1.5])   # seed 1 only
    path = tmp_path / "compare.md"
    runner.write_markdown(path, out, {"task": "gpt", "learners": 2, "tokens": 100, "seeds": [0, 1],
                                      "command": "x", "algo": {}})
    assert "decoupled ÷ decoupled_lockstep, paired by seed: 1.5000 [1.5000, 1.5000]" in path.read_text()


def test_dp_emulated_is_one_model_on_the_concatenated_streams() -> None:
    task = load_task("gpt", TINY)
    algo = AlgoConfig(fragments=4, sync_every_steps=4, inner_warmup_steps=2)
    res = systems.run_dp_emulated(task, algo, learners=2, steps=3, seed=0, eval_points=3)
    assert res.tokens == 3 * 2 * 64 and [t for t, _ in res.curve] == [0, 128, 256, 384]


def test_emulated_single_learner_with_unit_outer_step_and_carry_is_plain_training() -> None:
    """M = 1, η = 1, μ = 0, fp32 both ways, carry: every step reaches the global model, whatever the delay."""
    task = load_task("gpt", TINY)
    algo = AlgoConfig(fragments=4, sync_every_steps=4, inner_warmup_steps=2, uplink_codec="fp32", downlink_codec="fp32",
                      outer_lr=1.0, outer_momentum=0.0, carry_local_steps=True)
    dec = systems.run_decoupled_emulated(task, algo, learners=1, steps=10, seed=0, eval_points=1, delay_steps=2)
    single = systems.run_single(task, algo, steps=10, seed=0, eval_points=1)
    assert dec.eval_loss_final == pytest.approx(single.eval_loss_final, abs=1e-4)
    over = systems.run_decoupled_emulated(task, AlgoConfig(**{**algo.__dict__, "carry_local_steps": False}),
                                          learners=1, steps=10, seed=0, eval_points=1, delay_steps=2)
    assert abs(over.eval_loss_final - single.eval_loss_final) > 1e-3   # overwrite loses the delayed steps


def test_compare_refuses_unknown_systems_and_tiny_budgets(tmp_path) -> None:
    assert runner.main(["--systems", "dp,bogus", "--report", str(tmp_path)]) == 2
    assert runner.main(["--tokens", "10", "--report", str(tmp_path), "--systems", "single"]) == 2
    for floor in ("0", "-5", "nan", "inf"):     # the cluster learners' floor must be a positive time
        assert runner.main(["--systems", "decoupled", "--step-time-floor-ms", floor, "--report", str(tmp_path)]) == 2


def test_compare_writes_its_report_and_resume_reuses_finished_runs(tmp_path, capsys) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[task]\nn_layer = 1\nn_embd = 16\nn_head = 2\nseq_len = 16\nbatch_size = 4\n"
                   "eval_batches = 2\ncorpus_max_bytes = 300000\n[algo]\nfragments = 4\nsync_every_steps = 4\n")
    args = ["--config", str(cfg), "--learners", "2", "--tokens", "1280", "--seeds", "2", "--eval-points", "2",
            "--systems", "single,diloco_sync", "--report", str(tmp_path / "r")]
    assert runner.main(args) == 0
    import json
    doc = json.loads((tmp_path / "r" / "compare.json").read_text())
    assert set(doc["systems"]) == {"single", "diloco_sync"}
    sync = doc["systems"]["diloco_sync"]
    assert sync["tokens"] == 1280 and len(sync["per_seed"]) == 2
    assert sync["eval_loss_ci"][0] <= sync["eval_loss_final"] <= sync["eval_loss_ci"][1]
    assert (tmp_path / "r" / "compare.md").exists() and (tmp_path / "r" / "compare.png").exists()
    capsys.readouterr()
    assert runner.main(args + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert out.count("reused") == 4, out
    again = json.loads((tmp_path / "r" / "compare.json").read_text())["systems"]["diloco_sync"]
    assert again["per_seed"] == sync["per_seed"]
    capsys.readouterr()
    assert runner.main(args + ["--resume", "--set", "algo.outer_lr=0.5"]) == 0   # another config: rerun
    assert "reused" not in capsys.readouterr().out
