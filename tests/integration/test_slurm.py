"""`ddloco slurm` through a live one-node Slurm (Debian's slurm-wlm and munge; root): the check of
`make slurm-check` (ddloco/slurm/check.py), 25-50 s. Skipped with the reason where Slurm is absent."""
from __future__ import annotations

import pytest

from ddloco.slurm import check
from ddloco.slurm.local import missing


@pytest.mark.skipif(bool(missing()), reason=missing() or "-")
def test_a_run_survives_scancel_requeue_and_preemption_through_live_slurm(tmp_path, capsys):
    rc = check.main(["--work", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "all checks hold" in out
    for step in ("every learner's answers are merged", "learner-2 cancelled", "learner-1 requeued",
                 "scav-0 contributes", "preempted scav-0", "merges go on after the scancel and the requeue",
                 "merges go on after the preemption",
                 "shard 1 SIGKILLed inside the services job: started again",
                 "Redis SIGKILLed inside the services job: started again"):
        assert step in out, out
