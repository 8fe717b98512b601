"""The pure parts of ``make gpu-quality`` (ddloco.bench.gpu_quality): sizes, FLOPs, the plan that
fits the budget, results collected from compare's runs, the table's ratios, the plot."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ddloco.bench import gpu_quality as gq
from ddloco.compare import systems
from ddloco.tasks.gpt import GPT
from common.task import load_task

pytestmark = pytest.mark.timeout(60)


def test_sizes_parse_by_name_or_shape_and_refuse_bad_ones() -> None:
    assert gq.parse_size("m") == gq.Size(6, 192, 4)
    assert gq.parse_size(" 8x512h8 ") == gq.Size(8, 512, 8) and gq.parse_size("8x512h8").name == "8x512h8"
    assert [s.name for s in gq.parse_sizes("l,s,6x64,m")] == ["6x64", "6x192", "6x384"]   # sorted, once
    for bad in ("big", "6x", "0x64", "6x66h4", "", "6x64h0"):
        with pytest.raises(gq.QualityError):
            gq.parse_sizes(bad)


@pytest.mark.parametrize("shape", ["s", "m", "1x16", "2x24h2"])
def test_param_count_is_the_models_own(shape: str) -> None:
    s = gq.parse_size(shape)
    model = GPT(seq_len=128, n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd)
    assert gq.param_count(s, 128) == sum(p.numel() for p in model.parameters())


def test_the_full_sweep_spans_30x_with_a_largest_over_10m() -> None:
    params = [gq.param_count(s, gq.FULL.seq_len) for s in gq.FULL.sizes]
    assert len(params) >= 3 and params[-1] / params[0] >= 30 and params[-1] >= 10e6
    assert gq.train_flops(10_000_000, 20) == 6 * 10_000_000 * 20


def test_plan_fits_both_lanes_and_keeps_tokens_whole_steps() -> None:
    plans, notes = gq.plan(gq.FULL, gq.GPU, 200.0)
    step = gq.FULL.tokens_per_step()
    assert [p.size for p in plans] == ["6x64", "6x192", "6x384"]
    for p in plans:
        assert p.tokens == p.steps * step and p.steps >= gq.FULL.min_steps
        assert 0 < p.tokens_per_param <= gq.MAX_TOKENS_PER_PARAM
        assert p.flops == 6 * p.params * p.tokens
    for lane in ("inproc", "cluster"):
        assert sum(p.est_s[lane] for p in plans) <= 200.0 + 1e-6
    assert plans[0].tokens_per_param > 19.9 and plans[-1].tokens_per_param < plans[0].tokens_per_param
    assert [p.seeds for p in plans] == [2, 2, 1] and [p.cluster_seeds for p in plans] == [2, 2, 1]
    assert any("tokens per parameter" in n for n in notes)
    # a smaller budget leaves the largest out (said), a tiny one keeps the smallest at its minimum
    plans, notes = gq.plan(gq.FULL, gq.GPU, 100.0)
    assert [p.size for p in plans] == ["6x64", "6x192"] and any("6x384 left out" in n for n in notes)
    plans, notes = gq.plan(gq.FULL, gq.CPU, 20.0)
    assert [(p.size, p.steps) for p in plans] == [("6x64", gq.FULL.min_steps)] and any("over budget" in n for n in notes)


def _run(d: Path, system: str, seed: int, loss: float, tokens: int, extra: dict | None = None) -> None:
    (d / "runs").mkdir(parents=True, exist_ok=True)
    (d / "runs" / f"{system}-s{seed}.json").write_text(json.dumps(
        {"system": system, "seed": seed, "eval_loss_final": loss, "tokens": tokens, "wall_s": 1.0, "curve": [],
         **({"extra": extra} if extra else {})}))


def test_collect_and_table_pair_ratios_by_seed(tmp_path: Path) -> None:
    a, b = tmp_path / "inproc-1x16", tmp_path / "cluster-1x16"
    for seed, (dp, sync) in enumerate([(2.0, 2.1), (4.0, 4.4)]):
        _run(a, "dp_emulated", seed, dp, 1000)
        _run(a, "diloco_sync", seed, sync, 1000)
    _run(b, "decoupled", 7, 9.9, 999)                      # another budget: not counted
    rep = b / "runs" / "decoupled-s1" / "report.json"      # compare failed after the cluster's report
    rep.parent.mkdir(parents=True)
    rep.write_text(json.dumps({"eval_loss_final": 4.2, "tokens_total": 1000, "timed_out": False,
                               "eval_curve": [{"tokens": 0, "loss": 5.5}, {"tokens": 1000, "loss": 4.2}]}))
    results = gq.collect([("1x16", a, 1000), ("1x16", b, 1000)])
    assert set(results["1x16"]["decoupled"]) == {"1"}
    assert results["1x16"]["decoupled"]["1"]["recovered_from"] == "report.json"
    plan = gq._size_plans(gq.replace(gq.DRY, sizes=(gq.parse_size("1x16"), gq.parse_size("1x32"))), gq.CPU, [10, 10])
    plan = [gq.replace(plan[0], tokens=1000), plan[1]]
    rows = gq.table_rows(results, plan)
    r = rows[0]
    assert r["dp_emulated"] == pytest.approx(3.0) and r["diloco_sync"] == pytest.approx(3.25)
    assert r["diloco_sync_ratio"] == pytest.approx((2.1 / 2.0 + 4.4 / 4.0) / 2)   # paired, not ratio of means
    assert r["decoupled_ratio"] == pytest.approx(4.2 / 4.0) and r["decoupled_ratio_seeds"] == 1
    assert rows[1]["dp_emulated"] is None and rows[1]["decoupled_ratio"] is None    # nothing ran: dashes
    md = gq.markdown(rows, {"device": "cpu", "notes": ["a note"]})
    assert "| 1x16 |" in md and "1.0750" in md and "| 1x32 |" in md and "- a note" in md
    short = gq.short_table(rows).splitlines()
    assert len(short) == 3 and "1.0500" in short[1]


def _shards(rep: Path, per_shard: list[dict], fragments: int) -> None:
    rep.parent.mkdir(parents=True, exist_ok=True)
    rep.write_text(json.dumps({"eval_loss_final": 4.2, "tokens_total": 1000, "timed_out": False,
                               "eval_curve": [{"tokens": 0, "loss": 5.5}, {"tokens": 1000, "loss": 4.2}],
                               "config": {"algo": {"fragments": fragments}},
                               "shard_stats": {str(k): {k2: str(v) for k2, v in h.items()}
                                               for k, h in enumerate(per_shard)}}))


def test_a_cluster_behind_schedule_is_measured_and_marked_stale(tmp_path: Path) -> None:
    """On an H200 the cluster's rounds fell behind its learners' steps at 10.8 M parameters (95 % of
    merges late to schedule) and its ratio (1.33) read like the algorithm's: now each cluster run
    carries its fractions of merges behind schedule and answers late, and the table marks a size
    whose cluster was more than 10 % behind."""
    a, b, c = tmp_path / "inproc-1x16", tmp_path / "cluster-1x16", tmp_path / "cluster-1x32"
    for size, d in (("1x16", a), ("1x32", tmp_path / "inproc-1x32")):
        _run(d, "dp_emulated", 0, 4.0, 1000)
    _run(b, "decoupled", 0, 4.1, 1000)                     # compare's record, and the cluster's report
    _shards(b / "runs" / "decoupled-s0" / "report.json",
            [{"merges": 100, "rounds_behind": 2, "answers": 390, "late_answers": 10},
             {"merges": 100, "rounds_behind": 0, "answers": 400, "late_answers": 0}], fragments=4)
    _shards(c / "runs" / "decoupled-s0" / "report.json",     # only the report (compare failed after it)
            [{"merges": 50, "rounds_behind": 45, "answers": 150, "late_answers": 50}], fragments=24)
    results = gq.collect([("1x16", a, 1000), ("1x16", b, 1000), ("1x32", tmp_path / "inproc-1x32", 1000),
                          ("1x32", c, 1000)])
    ok, stale = results["1x16"]["decoupled"]["0"], results["1x32"]["decoupled"]["0"]
    assert (ok["merges"], ok["behind_fraction"], ok["late_fraction"], ok["fragments"]) == (200, 0.01, 0.0125, 4)
    assert (stale["merges"], stale["behind_fraction"], stale["late_fraction"], stale["fragments"]) == (50, 0.9, 0.25, 24)
    plan = gq._size_plans(gq.replace(gq.DRY, sizes=(gq.parse_size("1x16"), gq.parse_size("1x32"))), gq.CPU, [10, 10])
    rows = gq.table_rows(results, [gq.replace(p, tokens=1000) for p in plan])
    assert rows[0]["decoupled_behind"] == 0.01 and rows[1]["decoupled_behind"] == 0.9
    md = gq.markdown(rows, {"device": "cpu"})
    line = {r.split("|")[1].strip(): r for r in md.splitlines() if r.startswith("| 1x")}
    assert "(stale)" in line["1x32"] and "90.0% / 25.0%" in line["1x32"]
    assert "(stale)" not in line["1x16"] and "1.0% / 1.2%" in line["1x16"]
    assert "- (stale) 1x32:" in md
    # a malformed report loses only what is malformed in it
    bad = tmp_path / "bad" / "report.json"
    _shards(bad, [{"merges": 10, "rounds_behind": 1, "answers": "nan", "late_answers": 0}], fragments=4)
    doc = json.loads(bad.read_text())
    doc["config"] = {"algo": None}
    bad.write_text(json.dumps(doc))
    assert gq.cluster_health(bad) == {"merges": 10, "behind_fraction": 0.1, "late_fraction": None}
    # too few merges to judge (a dry run's): the figures stay, no mark
    few = {"6x64": {"decoupled": {"0": {"eval_loss_final": 2.0, "merges": 4, "behind_fraction": 0.25}}}}
    row = gq.table_rows(few, [gq.replace(plan[0], size="6x64")])[0]
    assert row["decoupled_behind"] is None
    bad.write_text("[1, 2]")
    assert gq.cluster_health(bad) == {} and gq.cluster_health(tmp_path / "none.json") == {}


def test_the_cluster_lane_runs_with_the_profiles_fragments(tmp_path: Path) -> None:
    plan = gq._size_plans(gq.replace(gq.DRY, sizes=(gq.parse_size("1x16"),)), gq.CPU, [10])[0]
    prof = gq.replace(gq.DRY, cluster_fragments=3)
    kw = dict(device="cpu", config=tmp_path / "c.toml", report=tmp_path / "r", seed_start=0)
    assert "algo.fragments=3" in gq.compare_argv(plan, "cluster", prof, **kw)
    assert not any(a.startswith("algo.fragments") for a in gq.compare_argv(plan, "inproc", prof, **kw))
    args = gq.build_parser().parse_args([str(tmp_path), "--dry", "--cluster-fragments", "2"])
    assert gq._profile(args).cluster_fragments == 2
    with pytest.raises(gq.QualityError, match="cluster-fragments"):
        gq._profile(gq.build_parser().parse_args([str(tmp_path), "--dry", "--cluster-fragments", "0"]))


def test_a_cluster_whose_answers_came_late_is_marked_stale_with_its_merged_steps(tmp_path: Path) -> None:
    """An H200 run with 4 fragments: rounds mostly on schedule (13.5 % behind) but four learners on
    one GPU stepping unevenly, 39 % of answers late and 78 % of the steps merged; the table called
    that size's ratio (1.26) the algorithm's unless it was behind. Now late answers mark it too,
    and the steps merged are in the table."""
    d = tmp_path / "cluster-1x16"
    _run(d, "decoupled", 0, 4.1, 1000, extra={"merges": 200, "step_time_floor_ms": 60.0})
    rep = d / "runs" / "decoupled-s0" / "report.json"
    _shards(rep, [{"merges": 100, "rounds_behind": 5, "answers": 300, "late_answers": 100},
                  {"merges": 100, "rounds_behind": 5, "answers": 310, "late_answers": 90}], fragments=4)
    doc = json.loads(rep.read_text())
    doc["learner_stats"] = {"learner-0": {"steps": "496"}, "learner-1": {"steps": "496"}}
    doc["merged_steps"] = {"learner-0": 387.25, "learner-1": 386.5}
    rep.write_text(json.dumps(doc))
    results = gq.collect([("1x16", d, 1000)])
    r = results["1x16"]["decoupled"]["0"]
    assert (r["behind_fraction"], r["late_fraction"], r["merged_share"]) == (0.05, 0.2375, 0.78)
    assert r["step_time_floor_ms"] == 60.0
    plan = gq._size_plans(gq.replace(gq.DRY, sizes=(gq.parse_size("1x16"),)), gq.CPU, [10])
    rows = gq.table_rows(results, [gq.replace(p, tokens=1000) for p in plan])
    assert rows[0]["decoupled_merged_share"] == 0.78 and rows[0]["decoupled_floor_ms"] == [60.0]
    md = gq.markdown(rows, {"device": "cpu"})
    line = next(x for x in md.splitlines() if x.startswith("| 1x16"))
    assert "(stale)" in line and "5.0% / 23.8% / 78.0%" in line and "steps ≥ 60 ms" in line
    assert "- (stale) 1x16:" in md and "answers late" in md
    # unreadable step counts: no share, nothing else lost
    doc["merged_steps"] = {"learner-0": "x"}
    rep.write_text(json.dumps(doc))
    assert "merged_share" not in gq.cluster_health(rep) and gq.cluster_health(rep)["late_fraction"] == 0.2375
    del doc["merged_steps"]                      # a report of a version without it: no share, not 0 %
    rep.write_text(json.dumps(doc))
    assert "merged_share" not in gq.cluster_health(rep)


def test_equal_tokens_per_parameter_plans_one_training_length_for_every_size() -> None:
    plans, notes = gq.plan(gq.FULL, gq.GPU, 200.0, equal=True)
    assert [p.size for p in plans] == ["6x64", "6x192", "6x384"]
    rs = [p.tokens_per_param for p in plans]
    assert max(rs) - min(rs) < 0.15 * max(rs)               # whole steps apart (the smallest's are few)
    for lane in ("inproc", "cluster"):
        assert sum(p.est_s[lane] for p in plans) <= 200.0 + 1e-6
    shared = gq.plan(gq.FULL, gq.GPU, 200.0)[0]
    assert shared[0].tokens_per_param > 4 * rs[0]            # the default gives the smallest far more
    capped = gq.plan(gq.FULL, gq.GPU, 1e6, equal=True)[0]    # no more than the ceiling, at any budget
    assert all(abs(p.tokens_per_param - gq.MAX_TOKENS_PER_PARAM) < 0.2 for p in capped)


def test_each_cluster_seed_has_a_lane_of_its_own(tmp_path: Path) -> None:
    """The done-when asks for two seeds below the largest size; two clusters one after the other
    would halve every size's tokens, side by side they cost one cluster's time (the learners wait
    on the step floor, the GPU mostly idle)."""
    plan = gq._size_plans(gq.replace(gq.FULL, sizes=(gq.parse_size("6x64"),)), gq.GPU, [100])[0]
    assert gq.cluster_lanes(plan) == ["cluster", "cluster2"]
    # the largest of several sizes: one dp_emulated seed, so one cluster seed (another has no ratio)
    sweep = gq.plan(gq.FULL, gq.GPU, 200.0)[0]
    assert [p.cluster_seeds for p in sweep] == [2, 2, 1] and gq.cluster_lanes(sweep[-1]) == ["cluster"]
    kw = dict(device="cuda", config=tmp_path / "c.toml", report=tmp_path / "r", seed_start=3)
    seeds = {lane: gq.compare_argv(plan, lane, gq.FULL, **kw) for lane in ("inproc", "cluster", "cluster2")}
    seeds = {lane: argv[argv.index("--seed-list") + 1] for lane, argv in seeds.items()}
    assert seeds == {"inproc": "3,4", "cluster": "3", "cluster2": "4"}
    assert gq.lane_seeds(plan, "cluster2", 3) == (4,)
    # a lane's estimate is one cluster's: the plan with two cluster seeds gives the tokens of one
    one = gq.plan(gq.replace(gq.FULL, cluster_seeds=1), gq.GPU, 200.0)[0]
    two = gq.plan(gq.FULL, gq.GPU, 200.0)[0]
    assert [p.tokens for p in one] == [p.tokens for p in two]
    assert [p.est_s for p in one] == [p.est_s for p in two]


def test_the_cluster_lane_steps_no_faster_than_the_floor(tmp_path: Path) -> None:
    size = gq.parse_size("6x64")
    plan = gq._size_plans(gq.replace(gq.FULL, sizes=(size,)), gq.GPU, [100])[0]
    kw = dict(device="cuda", config=tmp_path / "c.toml", report=tmp_path / "r", seed_start=0)
    argv = gq.compare_argv(plan, "cluster", gq.FULL, **kw)
    assert float(argv[argv.index("--step-time-floor-ms") + 1]) == 60.0
    assert "--step-time-floor-ms" not in gq.compare_argv(plan, "inproc", gq.FULL, **kw)
    none = gq.replace(gq.FULL, cluster_step_floor_ms=None)
    assert "--step-time-floor-ms" not in gq.compare_argv(plan, "cluster", none, **kw)
    # the floor is the cluster's cost per token where it is slower than the learners' compute
    params = gq.param_count(size, gq.FULL.seq_len)
    fixed, per_token = gq.lane_cost(gq.GPU, "cluster", params, 0, 1, gq.FULL)
    assert per_token == pytest.approx(0.060 / gq.FULL.tokens_per_step())
    assert gq.lane_cost(gq.GPU, "cluster", params, 0, 1, none)[1] < per_token
    assert gq.lane_cost(gq.GPU, "cluster", params, 0, 2, gq.FULL)[1] == pytest.approx(2 * per_token)
    args = gq.build_parser().parse_args([str(tmp_path), "--cluster-step-floor-ms", "0"])
    assert gq._profile(args).cluster_step_floor_ms is None
    assert gq._profile(gq.build_parser().parse_args([str(tmp_path), "--cluster-step-floor-ms", "80"])
                       ).cluster_step_floor_ms == 80.0
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(gq.QualityError, match="cluster-step-floor-ms"):
            gq._profile(gq.build_parser().parse_args([str(tmp_path), "--cluster-step-floor-ms", bad]))


def test_plot_has_ours_and_the_published_points(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [{"params": p, "tokens_per_param": 20.0, "diloco_sync_ratio": 1.03, "decoupled_ratio": r}
            for p, r in ((3e5, 1.05), (3e6, None), (1e7, 1.03))]
    assert gq.plot(tmp_path / "q.png", rows, "t")
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {(x, y) for x, y, _ in gq.PUBLISHED} == {(35e6, 1.020), (90e6, 1.015), (35e6, 1.026), (100e6, 1.019)}


def test_in_process_systems_take_a_device_and_keep_the_cpu_result() -> None:
    """``device=cpu`` given explicitly is the same run as before the device path existed."""
    task = load_task("gpt", dict(n_layer=1, n_embd=16, n_head=2, seq_len=16, batch_size=4, eval_batches=2,
                                 corpus_max_bytes=300_000))
    from common.config import AlgoConfig
    algo = AlgoConfig(sync_every_steps=3, fragments=2)
    for run in (systems.run_dp_emulated, systems.run_diloco_sync):
        a = run(task, algo, learners=2, steps=4, seed=1, eval_points=2)
        b = run(task, algo, learners=2, steps=4, seed=1, eval_points=2, device=torch.device("cpu"))
        assert a.curve == b.curve and math.isfinite(a.eval_loss_final)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_process_systems_on_cuda_match_the_cpu() -> None:
    task = load_task("gpt", dict(n_layer=1, n_embd=16, n_head=2, seq_len=16, batch_size=4, eval_batches=2,
                                 corpus_max_bytes=300_000))
    from common.config import AlgoConfig
    algo = AlgoConfig(sync_every_steps=3, fragments=2)
    for run in (systems.run_dp_emulated, systems.run_diloco_sync):
        cpu = run(task, algo, learners=2, steps=6, seed=1, eval_points=2)
        gpu = run(task, algo, learners=2, steps=6, seed=1, eval_points=2, device=torch.device("cuda"))
        assert gpu.eval_loss_final == pytest.approx(cpu.eval_loss_final, rel=2e-3)


def test_merge_takes_the_earlier_plan_with_this_runs_seeds(tmp_path: Path) -> None:
    plans, _ = gq.plan(gq.FULL, gq.GPU, 150.0)
    old = tmp_path / "quality.json"
    old.write_text(json.dumps({"plan": [gq.asdict(p) for p in plans], "results": {"6x64": {"dp_emulated": {}}}}))
    again, results = gq.merged_plan(str(old), gq.replace(gq.FULL, seeds=3))
    assert [(p.size, p.tokens) for p in again] == [(p.size, p.tokens) for p in plans]
    assert [p.seeds for p in again] == [3, 3, 1] and results == {"6x64": {"dp_emulated": {}}}
    old.write_text("{}")
    with pytest.raises(gq.QualityError, match="not a quality.json"):
        gq.merged_plan(str(old), gq.FULL)
    # an earlier cluster of another shape (the 24-fragment pilot, fragments not recorded) stays out
    # and so does one at another step floor; a sweep that runs no cluster keeps them all
    earlier = {"6x64": {"dp_emulated": {"0": {"eval_loss_final": 2.0}},
                        "decoupled": {"0": {"eval_loss_final": 2.6},
                                      "1": {"eval_loss_final": 2.1, "fragments": 4, "step_time_floor_ms": 60.0},
                                      "2": {"eval_loss_final": 2.2, "fragments": 24, "step_time_floor_ms": 60.0},
                                      "3": {"eval_loss_final": 2.3, "fragments": 4}}}}
    meta = {"profile": {"cluster_fragments": 4, "cluster_step_floor_ms": 60.0}}
    sweep = gq.Sweep(tmp_path, tmp_path, plans, meta, earlier)
    sweep.stages.append(gq.Stage("cluster-6x64", "cluster", "6x64", [], 1.0, tmp_path / "none", seeds=(5,)))
    res = sweep.results()
    assert set(res["6x64"]["decoupled"]) == {"1"} and set(res["6x64"]["dp_emulated"]) == {"0"}
    sweep.stages[0] = gq.Stage("inproc-6x64", "inproc", "6x64", [], 1.0, tmp_path / "none", seeds=(5,))
    assert set(sweep.results()["6x64"]["decoupled"]) == {"0", "1", "2", "3"}
    # the estimates are this run's (its floor): a slower floor, longer cluster stages
    old.write_text(json.dumps({"plan": [gq.asdict(p) for p in plans], "results": {}}))
    slow, _ = gq.merged_plan(str(old), gq.replace(gq.FULL, cluster_step_floor_ms=300.0))
    assert all(a.est_s["cluster"] > b.est_s["cluster"] for a, b in zip(slow, plans))


def test_a_stage_past_its_timeout_is_stopped_and_recorded(tmp_path: Path) -> None:
    """The budget holds: a stage that overruns gets Ctrl-C at its timeout (here it ignores it:
    SIGKILL follows), its status says so and the caller goes on."""
    import sys
    import time
    code = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); signal.pause()"
    stage = gq.Stage("s", "inproc", "1x16", [sys.executable, "-c", code], timeout_s=1.0, report=tmp_path / "s")
    t0 = time.monotonic()
    gq.run_stage(stage, dict(__import__("os").environ), deadline=time.monotonic() + 100)
    assert stage.status == "timed out after 1 s" and time.monotonic() - t0 < 1 + gq.STOP_GRACE_S + 5
    assert (tmp_path / "s" / "stage.log").read_text() == "up\n"
    failing = gq.Stage("f", "inproc", "1x16", [sys.executable, "-c", "raise SystemExit(3)"], timeout_s=30,
                       report=tmp_path / "f")
    gq.run_stage(failing, dict(__import__("os").environ), deadline=time.monotonic() + 100)
    assert (failing.status, failing.rc) == ("failed (exit 3)", 3)
    late = gq.Stage("l", "inproc", "1x16", [sys.executable, "-c", "pass"], timeout_s=30, report=tmp_path / "l")
    gq.run_stage(late, {}, deadline=time.monotonic() + 2)
    assert late.status.startswith("skipped") and late.rc is None
