"""``make gpu-check``'s verdicts and the CUDA learner's copy accounting (learner/staging.py)."""
from __future__ import annotations

import types

import pytest

from ddloco.bench import sync as bench_sync
from ddloco.bench.gpu_check import DRY, FULL, STAGE_ENV, verdicts


def test_verdicts_hold_each_target_of_the_issue_against_its_figure() -> None:
    good_gpu = {"ratio": 0.96, "late_fraction": 0.01, "behind_fraction": 0.0,
                "gpu": {"stream_waits": 0, "rss_within_bound": True}}
    good_cpu = {"ratio": 0.98, "late_fraction": 0.0, "behind_fraction": 0.0, "broadcast_down_over_up": 1.01}
    v = verdicts({"bench_gpu": {"figures": good_gpu}, "bench_cpu": {"figures": good_cpu}})
    assert all(v["gpu_1b"].values()) and all(v["cpu_1e8"].values())
    bad = verdicts({"bench_gpu": {"figures": {**good_gpu, "ratio": 0.94, "gpu": {"stream_waits": 2,
                                                                                 "rss_within_bound": False}}},
                    "bench_cpu": {"figures": {**good_cpu, "late_fraction": 0.03, "broadcast_down_over_up": 1.3}}})
    assert bad["gpu_1b"]["ratio>=0.95"] is False and bad["gpu_1b"]["no_stream_wait"] is False
    assert bad["gpu_1b"]["rss<=2.5x_fp32+400MB"] is False
    assert bad["cpu_1e8"]["late<=2%"] is False and bad["cpu_1e8"]["down<=1.2xup"] is False
    assert bad["cpu_1e8"]["ratio>=0.97"] is True
    # the lean variant (fewer training threads per learner) is judged apart, on its own figures
    lean = verdicts({"bench_cpu": {"figures": {**good_cpu, "ratio": 0.94}},
                     "bench_cpu_lean": {"figures": good_cpu}})
    assert lean["cpu_1e8"]["ratio>=0.97"] is False and all(lean["cpu_1e8_lean"].values())
    # so is the A/B of the split boundary passes: bench_cpu's command, the boundary on one thread
    serial = verdicts({"bench_cpu_serial": {"figures": {**good_cpu, "ratio": 0.93}}})
    assert set(serial) == {"cpu_1e8_serial"} and serial["cpu_1e8_serial"]["ratio>=0.97"] is False
    assert FULL["bench_cpu_serial"] == FULL["bench_cpu"] and STAGE_ENV["bench_cpu_serial"] == {"DDLOCO_BOUNDARY_THREADS": "1"}
    # a stage that failed measured nothing: no verdict, rather than a pass
    assert verdicts({"bench_gpu": {"rc": "timeout"}}) == {}
    assert verdicts({"bench_gpu": {"figures": {"ratio": 0.99}}})["gpu_1b"]["no_stream_wait"] is None


@pytest.mark.parametrize("sizes", [FULL, DRY], ids=["full", "dry"])
def test_every_bench_stage_command_parses_with_the_bench_s_own_parser(sizes) -> None:
    """A typo in a stage's flags would cost a GPU call: each bench stage's command (the GPU
    machine's and the dry run's) is parsed as `ddloco bench sync` parses it (the suite's dry run
    itself runs one bench stage: tests/integration/test_gpu_check_dry.py)."""
    for stage in ("bench_gpu", "bench_cpu", "bench_cpu_lean", "bench_cpu_serial"):
        timeout, tail = sizes[stage]
        assert timeout > 0 and tail[:4] == ["-m", "ddloco", "bench", "sync"], (stage, tail)
        args = bench_sync.build_parser().parse_args([*tail[4:], "--report", "/tmp/x"])   # SystemExit on a typo
        assert args.json and args.minutes > 0 and args.learners >= 1, (stage, args)


class _Event:
    """A CUDA event stand-in: done or not, at a time in ms."""

    def __init__(self, t: float, done: bool = True) -> None:
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: "_Event") -> float:
        return other.t - self.t


def _staging():
    from learner.staging import HostStaging
    s = HostStaging.__new__(HostStaging)      # no CUDA here: the accounting alone
    HostStaging._init_counters(s)
    return s


def test_copy_accounting_counts_completed_copies_and_training_stream_waits() -> None:
    s = _staging()
    s._pending.append(("d2h", _Event(0.0), _Event(2.5), None))
    s._pending.append(("h2d", _Event(10.0), _Event(11.0), _Event(12.0)))   # stream got there after the copy
    s._pending.append(("h2d", _Event(20.0), _Event(23.0), _Event(21.0)))   # got there 2 ms before it ended
    s._pending.append(("h2d", _Event(30.0), _Event(31.0, done=False), _Event(32.0)))
    s.poll()
    assert (s.d2h_copies, s.d2h_ms) == (1, 2.5)
    assert (s.h2d_copies, s.h2d_ms) == (2, 4.0)
    assert (s.stream_waits, s.stream_wait_ms) == (1, 2.0)
    assert len(s._pending) == 1               # not complete yet: read later, never waited on
    s._pending[0][2].done = True
    s.poll()
    assert s.h2d_copies == 3 and s.stream_waits == 1 and not s._pending


def test_copy_accounting_is_bounded_when_events_never_complete() -> None:
    from learner import staging
    s = _staging()
    for k in range(staging.PENDING_MAX + 10):
        s._track("d2h", _Event(0.0), _Event(1.0, done=False), None)
    assert len(s._pending) == staging.PENDING_MAX


pytestmark = pytest.mark.timeout(30)


def test_every_staging_reading_is_a_declared_learner_stat(monkeypatch) -> None:
    """The learner publishes ``HostStaging.readings()`` by name into its stats: a reading not
    declared in ``LearnerStats`` never reached the learner's hash (the first pinning times were
    lost that way on an H200)."""
    import dataclasses

    import torch
    from learner.stats import LearnerStats
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    s = _staging()
    s.device = torch.device("cuda", 0)
    declared = {f.name for f in dataclasses.fields(LearnerStats)}
    assert set(s.readings()) <= declared, set(s.readings()) - declared


def test_warm_takes_a_few_pinned_blocks_within_its_cap_and_survives_a_failure(monkeypatch) -> None:
    """A CUDA learner takes pinned blocks of its largest fragment at join (so its step boundaries
    reuse them): at most 4, no more than its fragments, 1 GiB in all as the allocator rounds a
    block up to a power of two; a failure to pin is returned, never raised (the join goes on)."""
    from learner import staging as st
    taken = []

    def empty(n, dtype=None, pin_memory=False):
        assert pin_memory
        taken.append(n)
        return object()
    monkeypatch.setattr(st.torch, "empty", empty)
    s = _staging()
    assert s.warm(42_000_000, blocks=24) is None and taken == [42_000_000] * 4      # 168 MB: 256 MiB blocks
    taken.clear()
    assert s.warm(42_000_000, blocks=2) is None and len(taken) == 2
    taken.clear()
    assert s.warm(100_000_000, blocks=24) is None and len(taken) == 2               # 400 MB: 512 MiB blocks
    taken.clear()
    assert s.warm(500_000_000, blocks=1) is None and taken == []                    # 2 GB: past the cap

    def fails(*a, **k):
        raise RuntimeError("CUDA error: out of memory")
    monkeypatch.setattr(st.torch, "empty", fails)
    assert "out of memory" in s.warm(1 << 20)
