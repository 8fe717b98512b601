"""ddloco/slurm: the batch scripts `ddloco slurm submit` writes, and the report from plain events."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

from ddloco.slurm.plan import SlurmPlan, learners_script, scavengers_script, services_script
from ddloco.slurm.report import summarize


def _directives(script: str) -> list[str]:
    return [line[len("#SBATCH "):] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_learner_array_is_requeued_with_stable_ids_and_gpu_groups(tmp_path):
    plan = SlurmPlan(run_dir=str(tmp_path), run_id="r1", learners=4, learner_partition="gpu", gpus_per_learner=8,
                     time_limit="2:00:00", setup="module load cuda")
    s = learners_script(plan)
    d = _directives(s)
    assert "--array=0-3" in d and "--requeue" in d and "--gres=gpu:8" in d and "--partition=gpu" in d
    assert "--time=2:00:00" in d
    assert "LID=learner-$IDX" in s and "--data-shard $(( 0 + IDX ))" in s
    assert "--nproc 8 --device cuda" in s           # a torchrun group of 8 ranks per learner
    assert "module load cuda" in s and "umask 077" in s
    assert s.index("module load cuda") < s.index("set -uo pipefail")      # setup runs before `set -u`
    assert "--threads $(( ${SLURM_CPUS_PER_TASK:-8} / 8" in s            # the task's CPUs over its ranks
    assert 'if [ "$RC" = 1 ] && [ $SIGNALLED = 0 ]' in s and "scontrol requeue" in s   # a failure requeues
    one_gpu = learners_script(SlurmPlan(run_dir=str(tmp_path), run_id="r1", gpus_per_learner=1))
    assert "--nproc" not in one_gpu and "--device cuda" in one_gpu
    assert "--gres" not in _directives(learners_script(SlurmPlan(run_dir=str(tmp_path), run_id="r1")))


def test_scavengers_take_their_own_ids_streams_ports_and_qos(tmp_path):
    plan = SlurmPlan(run_dir=str(tmp_path), run_id="r1", scavengers=2, scavenge_partition="scavenge",
                     scavenge_qos="scavenger", peer_port=7100)
    s = scavengers_script(plan)
    d = _directives(s)
    assert "--array=0-1" in d and "--partition=scavenge" in d and "--qos=scavenger" in d and "--requeue" in d
    assert "LID=scav-$IDX" in s and "--data-shard $(( 1000 + IDX ))" in s and "$(( 7600 + IDX ))" in s
    added = _directives(scavengers_script(plan, count=3, start=2))
    assert "--array=2-4" in added


def test_services_job_is_one_requeueable_job_and_scripts_parse(tmp_path):
    plan = SlurmPlan(run_dir=str(tmp_path), run_id="r1", services_partition="cpu", services_cpus=4,
                     services_nodelist="cpu-01")
    s = services_script(plan)
    assert {"--partition=cpu", "--cpus-per-task=4", "--requeue", "--nodelist=cpu-01"} <= set(_directives(s))
    assert "-m ddloco.slurm.services" in s
    for text in (s, learners_script(plan), scavengers_script(plan, count=1)):
        p = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr


def test_submit_dry_run_keeps_keys_private_and_names_every_job(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "ddloco", "slurm", "submit", "--run-dir", str(run), "--learners", "2",
                        "--scavengers", "1", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(run / "keys" / "secret" / "redis.password").st_mode) == 0o600
    assert sorted(x.name for x in (run / "jobs").iterdir()) == ["learners.sbatch", "scavengers.sbatch",
                                                                 "services.sbatch"]
    assert {f.stem for f in (run / "keys" / "public" / "learner").iterdir()} == {"learner-0", "learner-1", "scav-0"}
    def submit_again() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ddloco", "slurm", "submit", "--run-dir", str(run), "--dry-run"],
                              capture_output=True, text=True, timeout=120)
    assert submit_again().returncode == 0          # a dry run submitted nothing: DIR may be used
    plan = SlurmPlan.load(run)
    plan.job_ids = {"services": ["7"]}
    plan.save()
    again = submit_again()
    assert again.returncode == 2 and "holds a run already" in again.stderr
    odd = subprocess.run([sys.executable, "-m", "ddloco", "slurm", "submit", "--run-dir", str(tmp_path / "a b"),
                          "--dry-run"], capture_output=True, text=True, timeout=120)
    assert odd.returncode == 2 and "without spaces" in odd.stderr


def test_submit_without_slurm_says_so(tmp_path):
    env = {**os.environ, "PATH": "/nonexistent"}
    p = subprocess.run([sys.executable, "-m", "ddloco", "slurm", "submit", "--run-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1 and "sbatch not found" in p.stderr


def test_report_pairs_slurm_lives_with_the_runs_joins_leaves_and_merges():
    slurm = [{"t": 1.0, "event": "start", "learner": "a", "job": "7_0", "restart": 0},
             {"t": 5.0, "event": "signalled", "learner": "a", "job": "7_0", "restart": 0},
             {"t": 5.5, "event": "end", "learner": "a", "job": "7_0", "restart": 0, "rc": 0},
             {"t": 9.0, "event": "start", "learner": "a", "job": "7_0", "restart": 1}]
    run = [{"kind": "join", "learner": "a", "t": "2.0"}, {"kind": "leave", "learner": "a", "t": "5.2"},
           {"kind": "join", "learner": "a", "t": "10.0"}] + \
          [{"kind": "merge", "t": str(t)} for t in (3.0, 4.0, 6.0, 7.0, 8.5, 11.0)]
    rep = summarize(slurm, run)
    assert rep["merges"] == 6 and rep["longest_merge_pause_s"] == 2.5
    a = rep["learners"]["a"]
    assert a["requeued"] == 1
    assert a["absences"] == [{"left": 5.2, "back": 10.0, "merges_meanwhile": 3}]
