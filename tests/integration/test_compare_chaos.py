"""`ddloco compare --chaos`: two systems on their real engines (DDP under torchrun's elastic agent,
our cluster under `ddloco up`) through the same seeded schedule of one kill; every figure of
compare.json is there and the kill hit both (a real SIGKILL of a real process each)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddloco.chaos_plan import ChaosSpec
from ddloco.compare.failures import KEYS, plan_schedule

pytestmark = pytest.mark.timeout(240)

LEARNERS, STEPS, FLOOR_MS, PER_BATCH, CAP = 2, 40, 100.0, 1024, 4.0
NOMINAL_S = STEPS * FLOOR_MS / 1000


def _one_kill_seed() -> int:
    """A chaos seed whose schedule holds exactly one kill within the cap, early in the run."""
    for seed in range(1000):
        faults = plan_schedule(ChaosSpec(seed=seed, learner_mtbf_s=20.0), LEARNERS, NOMINAL_S)
        within = [f for f in faults if f.at_s < CAP * NOMINAL_S]
        if len(within) == 1 and 0.25 * NOMINAL_S <= within[0].at_s <= 0.5 * NOMINAL_S:
            return seed
    raise AssertionError("no seed gives one early kill")


def _redone_steps(progress) -> tuple[int, list[int]]:
    """Steps trained in one life past the step the next life that trained started after, over every
    rank (a life that died before its first step, or before its start line, counts for nothing);
    and those resume points."""
    redone, resumes = 0, []
    for log in sorted(progress.glob("rank*.log")):
        steps: dict[int, list[int]] = {}
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "step" and parts[1].isdigit() and parts[2].isdigit():
                steps.setdefault(int(parts[1]), []).append(int(parts[2]))
        lives = [steps[life] for life in sorted(steps)]
        for before, after in zip(lives, lives[1:]):
            at = min(after) - 1                    # the checkpoint the later life resumed from
            redone += sum(1 for x in before if x > at)
            resumes.append(at)
    return redone, resumes


def test_compare_chaos_puts_dp_elastic_and_ours_through_the_same_kill(tmp_path) -> None:
    seed = _one_kill_seed()
    out = tmp_path / "side"
    proc = subprocess.run(
        [sys.executable, "-m", "ddloco", "compare", "--chaos", f"seed={seed},learner_mtbf_s=20",
         "--systems", "dp_elastic,decoupled", "--learners", str(LEARNERS), "--tokens", str(LEARNERS * STEPS * PER_BATCH),
         "--step-time-floor-ms", str(FLOOR_MS), "--checkpoint-every", "10", "--wall-cap", str(CAP), "--seeds", "1",
         "--insecure", "--report", str(out)], capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "compare.json").read_text())
    assert set(doc["systems"]) == {"dp_elastic", "decoupled"}
    for name, entry in doc["systems"].items():
        for key in (*KEYS, "goodput_predicted"):
            assert key in entry and len(entry[key]["values"]) == 1, (name, key)
        run = json.loads((out / "runs" / f"{name}-s0.json").read_text())
        hits = [f for f in run["faults"] if f["hit"]]
        assert len(hits) == 1 and hits[0]["kind"] == "learner_kill", (name, run["faults"])
        assert run["restarts"] >= 1, name                    # the killed process was replaced
        assert 0.0 < run["goodput"] <= 1.0, (name, run["goodput"])
        assert run["wall_curve"][-1][1] < run["wall_curve"][0][1], name   # it trained
    dp = json.loads((out / "runs" / "dp_elastic-s0.json").read_text())
    # the steps after its checkpoint, trained again: read from each rank's own log (a life's steps past
    # the step the next life resumed from), not from the count the report derives it by; a kill that
    # lands just after a checkpoint (a loaded runner's slow steps) loses nothing, rightly
    redone, resumes = _redone_steps(out / "runs" / "dp_elastic-s0" / "progress")
    assert resumes and all(s % 10 == 0 for s in resumes), resumes   # a new life starts at a checkpoint
    if dp["capped"]:   # stopped at the cap (a loaded runner): the report keeps rank 0's last step instead
        assert dp["tokens_lost"] >= 0
    else:
        assert dp["tokens_lost"] == redone * PER_BATCH, (dp["tokens_lost"], redone)
    assert dp["global_downtime_s"] > 0                        # the group stopped while torchrun restarted it
    for png in ("loss_vs_wall.png", "goodput.png", "timeline.png"):
        assert (out / png).stat().st_size > 1000
