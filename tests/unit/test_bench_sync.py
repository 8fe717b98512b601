"""``ddloco bench sync``'s figures from two ``ddloco up`` reports."""
from __future__ import annotations

import pytest

from ddloco.bench.sync import summarise


def _learner(steps: int, span: float, up: int, down: int, fetched: int, rss: str = "900.5") -> dict:
    return {"steps": str(steps), "started_at": "100.0", "boot_s": "5.0", "stopped_at": str(105.0 + span),
            "bytes_up": str(up), "bytes_down": str(down), "bytes_fetched": str(fetched), "peak_rss_mb": rss}


def test_rates_bytes_and_merges_come_from_the_learners_training_window() -> None:
    with_sync = {"wall_s": 200.0,
                 "learner_stats": {"a": _learner(90, 100.0, 1000, 9000, 7000), "b": _learner(80, 100.0, 1000, 9000, 7000)},
                 "shard_stats": {"0": {"merges": "50", "answers": "95", "late_answers": "5", "merge_s_sum": "10",
                                       "rounds_behind": "1", "peak_rss_mb": "700"}}}
    without = {"wall_s": 200.0, "learner_stats": {"a": _learner(100, 100.0, 0, 0, 0, "610"),
                                                  "b": _learner(100, 100.0, 0, 0, 0, "640.25")},
               "shard_stats": {}}
    res = summarise(with_sync, without, params=1000, sync_every=10, fragments=4, syncers=1)
    assert res["ratio"] == pytest.approx(170 / 200)
    assert res["broadcast_down_over_up"] == pytest.approx(4000 / 2000)   # fetched values counted apart
    assert res["down_over_up"] == pytest.approx(18000 / 2000)
    assert res["merges_per_s_per_shard"] == {"0": 0.5}                     # over the 100 s window, not the wall
    assert res["merges_per_s_required"] == pytest.approx(4 * 0.85 / 10)     # 4 fragments, median 0.85 steps/s, H 10
    assert res["merges_over_required"] == pytest.approx(0.5 / (4 * 0.85 / 10), abs=1e-4)
    assert res["behind_fraction"] == pytest.approx(1 / 50)
    assert res["late_fraction"] == pytest.approx(5 / 100)
    assert res["peak_rss_mb"] == {"learner": 900.5, "shard": 700.0}
    assert res["peak_rss_mb_without_sync"] == {"learner": 640.25}            # training alone
    assert "cpu" not in res                                                  # reports without CPU times


def test_cpu_figures_bound_what_the_machine_can_give() -> None:
    """The cores the learners use while training, their CPU per step, the shards' per learner step,
    and the cores both would need to step with rounds as fast as without."""
    def learner(steps: int, cpu: float) -> dict:
        return {**_learner(steps, 100.0, 1, 1, 0), "cpu_s": str(cpu + 7.0), "cpu_s_at_joined": "7.0"}
    with_sync = {"wall_s": 200.0, "learner_stats": {"a": learner(90, 80.0), "b": learner(80, 90.0)},
                 "shard_stats": {"0": {"merges": "50", "answers": "95", "cpu_s": "34.0"}}}
    without = {"wall_s": 200.0, "learner_stats": {"a": learner(100, 60.0), "b": learner(100, 60.0)},
               "shard_stats": {}}
    cpu = summarise(with_sync, without, params=1000, sync_every=10, fragments=4, syncers=1)["cpu"]
    assert cpu["learner_cores_with"] == pytest.approx(1.7) and cpu["learner_cores_without"] == pytest.approx(1.2)
    assert cpu["learner_cpu_s_per_step_with"] == pytest.approx(1.0)          # 170 s over 170 steps
    assert cpu["learner_cpu_s_per_step_without"] == pytest.approx(0.6)
    assert cpu["shard_cpu_s_per_learner_step"] == pytest.approx(0.2)
    assert cpu["cores_needed_for_ratio_1"] == pytest.approx(2.0 * 1.2)       # 2 steps/s without, 1.2 s each
    assert cpu["learner_extra_cpu"] == pytest.approx(1.0 / 0.6 - 1, abs=1e-4)
    assert cpu["learner_sync_cpu_share"] is None                             # reports without the sync clocks


def test_the_sync_path_s_own_cpu_is_read_off_the_learners_clocks_in_the_same_run() -> None:
    """The training thread's boundary CPU, the network thread's and libzmq's I/O threads' since
    joined (the join's fetches left out), over the rest of the learners' CPU since joined; and
    without libzmq's, as reports before it was recorded."""
    def learner(cpu: float, boundary: float, net: float, net_at_joined: float, io: float | None = None,
                io_at_joined: float = 0.0) -> dict:
        h = {**_learner(100, 100.0, 1, 1, 0), "cpu_s": str(cpu + 7.0), "cpu_s_at_joined": "7.0",
             "boundary_cpu_s": str(boundary), "net_cpu_s": str(net), "net_cpu_s_at_joined": str(net_at_joined)}
        return h if io is None else {**h, "io_cpu_s": str(io), "io_cpu_s_at_joined": str(io_at_joined)}
    without = {"wall_s": 200.0, "learner_stats": {"a": learner(50.0, 0.0, 3.1, 3.0), "b": learner(50.0, 0.0, 1.0, 1.0)},
               "shard_stats": {}}
    shards = {"0": {"merges": "50", "answers": "95", "cpu_s": "34.0"}}
    old = {"wall_s": 200.0, "learner_stats": {"a": learner(60.0, 2.0, 9.0, 3.0), "b": learner(60.0, 1.0, 5.0, 1.0)},
           "shard_stats": shards}
    cpu = summarise(old, without, params=1000, sync_every=10, fragments=4, syncers=1)["cpu"]
    assert cpu["learner_sync_cpu_share"] is None                              # no io_cpu_s: not the whole path
    assert cpu["learner_sync_cpu_share_own_threads"] == pytest.approx(13.0 / (120.0 - 13.0), abs=1e-4)   # (2+6) + (1+4)
    assert cpu["learner_extra_cpu"] == pytest.approx(0.2)
    new = {"wall_s": 200.0, "learner_stats": {"a": learner(60.0, 2.0, 9.0, 3.0, 2.5, 0.5),
                                              "b": learner(60.0, 1.0, 5.0, 1.0, 1.0, 0.0)}, "shard_stats": shards}
    cpu = summarise(new, without, params=1000, sync_every=10, fragments=4, syncers=1)["cpu"]
    assert cpu["learner_sync_cpu_share"] == pytest.approx(16.0 / (120.0 - 16.0), abs=1e-4)  # + (2.5-0.5) + 1
    assert cpu["learner_sync_cpu_share_own_threads"] == pytest.approx(13.0 / (120.0 - 13.0), abs=1e-4)


def test_gpu_figures_of_cuda_learners_and_the_rss_bound() -> None:
    """A CUDA learner's copies per copy and per step, its stream waits, peak GPU memory, and the
    host RSS bound of 2.5 x the model's fp32 bytes + 400 MB; nothing for CPU learners."""
    def learner(rss: str, waits: str) -> dict:
        return {**_learner(100, 100.0, 1, 1, 0, rss), "d2h_copies": "50", "d2h_ms": "25.0", "h2d_copies": "40",
                "h2d_ms": "80.0", "stream_waits": waits, "stream_wait_ms": "0.5", "gpu_peak_mb": "20000.0"}
    shards = {"0": {"merges": "1", "answers": "1"}}
    params = 10 * 2**20 // 4 * 100            # 1,000 MiB of fp32: bound 2,900 MiB
    res = summarise({"wall_s": 1.0, "learner_stats": {"a": learner("2800", "0"), "b": learner("2900", "0")},
                     "shard_stats": shards}, {"learner_stats": {}}, params=params, sync_every=10, fragments=4, syncers=1)
    g = res["gpu"]
    assert g["learners"]["a"]["d2h_ms_per_copy"] == 0.5 and g["learners"]["a"]["h2d_ms_per_copy"] == 2.0
    assert g["learners"]["a"]["h2d_ms_per_step"] == 0.8 and g["stream_waits"] == 0
    assert g["rss_bound_mb"] == 2900.0 and g["rss_within_bound"] is True and g["gpu_peak_mb"] == 20000.0
    worse = summarise({"wall_s": 1.0, "learner_stats": {"a": learner("2901", "3")}, "shard_stats": shards},
                      {"learner_stats": {}}, params=params, sync_every=10, fragments=4, syncers=1)["gpu"]
    assert worse["rss_within_bound"] is False and worse["stream_waits"] == 3
    cpu = summarise({"wall_s": 1.0, "learner_stats": {"a": _learner(1, 1.0, 1, 1, 0)}, "shard_stats": shards},
                    {"learner_stats": {}}, params=params, sync_every=10, fragments=4, syncers=1)
    assert "gpu" not in cpu


def test_a_bench_run_s_checkpoints_are_removed_and_its_logs_kept(tmp_path) -> None:
    from ddloco.bench.sync import drop_checkpoints
    runs = tmp_path / "runs"
    for name in ("bsync-sync-7-20261127-100000", "bsync-sync-7-20261127-100500", "bsync-sync-70-20261127-100000",
                 "demo-abc-20261127-100000"):
        (runs / name / "checkpoints").mkdir(parents=True)
        (runs / name / "checkpoints" / "shard0of2.pt").write_bytes(b"x" * 1000)
        (runs / name / "logs").mkdir()
    assert drop_checkpoints("bsync-sync-7", runs) == 2
    assert not (runs / "bsync-sync-7-20261127-100000" / "checkpoints").exists()
    assert not (runs / "bsync-sync-7-20261127-100500" / "checkpoints").exists()
    assert (runs / "bsync-sync-7-20261127-100000" / "logs").is_dir()                   # logs stay
    assert (runs / "bsync-sync-70-20261127-100000" / "checkpoints" / "shard0of2.pt").exists()   # another run's
    assert (runs / "demo-abc-20261127-100000" / "checkpoints" / "shard0of2.pt").exists()
