"""BatchNorm statistics of the final global model re-estimated (Task.recalibrate_bn_batches,
`ddloco export --recalibrate-bn N`), from the checkpoints of a real `ddloco up` run."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.task import evaluate
from common.running_stats import RECALIBRATION_STREAM

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
SEED = 3


ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
"""Runs in their own directory find the example (which the task module imports) on PYTHONPATH."""


def ddloco(*args: str, cwd: Path = REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddloco", *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV, **kw)


def _load(task, path: Path) -> torch.nn.Module:
    from ddloco.export import load_state
    model = task.model()
    model.load_state_dict(load_state(path), strict=True)
    return model


BN_CNN = """
import dataclasses
from examples.cnn import task as example

def task(**kw):
    return dataclasses.replace(example(**kw), recalibrate_bn_batches=50)
"""
"""The example CNN (two BatchNorm layers), with its final model's statistics re-estimated on 50 batches."""


def test_up_and_export_recalibrate_the_example_cnn_to_the_statistics_of_its_merged_weights(tmp_path, monkeypatch):
    (tmp_path / "bncnn.py").write_text(BN_CNN)
    monkeypatch.syspath_prepend(str(tmp_path))
    from bncnn import task
    t = task()
    res = ddloco("up", "--task", "bncnn:task", "--learners", "2", "--syncers", "2", "--steps", "40",
                 "--minutes", "3", "--seed", str(SEED), "--report", "r", "--run-id", "bn-e2e", cwd=tmp_path,
                 timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    ckpt = next((tmp_path / "runs").glob("bn-e2e-*/checkpoints"))

    plain, recal = tmp_path / "plain.safetensors", tmp_path / "recal.safetensors"
    out = ddloco("export", "--checkpoint-dir", str(ckpt), "--out", str(plain), "--recalibrate-bn", "0",
                 cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    assert "recalibrated" not in out.stdout
    out = ddloco("export", "--checkpoint-dir", str(ckpt), "--out", str(recal), "--recalibrate-bn", "50",
                 cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    assert (f"recalibrated the running statistics of 2 normalization layer(s) on 50 training batches "
            f"(stream {RECALIBRATION_STREAM}, from batch 0)") in out.stdout, out.stdout
    merged, fresh = _load(t, plain), _load(t, recal)   # both load strict into task.model()

    # only the statistics changed: every parameter bit-identical, every running statistic moved
    p0, p1 = dict(merged.named_parameters()), dict(fresh.named_parameters())
    assert all(torch.equal(p0[k], p1[k]) for k in p0), "a parameter changed"
    for name in ("features.1", "features.5"):
        s0, s1 = merged.get_submodule(name), fresh.get_submodule(name)
        assert not torch.equal(s0.running_mean, s1.running_mean) and not torch.equal(s0.running_var, s1.running_var)
        assert int(s1.num_batches_tracked) == 50

    # the first BatchNorm's statistics, computed by hand: the per-channel mean and unbiased variance
    # of the first convolution's output, averaged over batches 0-49 of the recalibration stream
    conv, means, variances = merged.features[0], [], []
    with torch.no_grad():
        for batch in itertools.islice(t.batches(RECALIBRATION_STREAM, SEED, 0), 50):
            h = conv(batch.images)                                  # (B, C, H, W)
            means.append(h.mean((0, 2, 3)))
            variances.append(h.var((0, 2, 3), unbiased=True))
    torch.testing.assert_close(fresh.features[1].running_mean, torch.stack(means).mean(0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fresh.features[1].running_var, torch.stack(variances).mean(0), rtol=1e-4, atol=1e-5)

    # up's final model is the same re-estimated model, and its report says both losses
    final = _load(t, tmp_path / "r" / "model.safetensors").state_dict()
    assert all(torch.equal(final[k], v) for k, v in fresh.state_dict().items()), "up and export differ"
    assert rep["bn_recalibrated_batches"] == 50
    assert rep["eval_loss_final"] == pytest.approx(evaluate(t, fresh), abs=1e-6)
    assert rep["eval_loss_final_before_bn_recalibration"] == pytest.approx(evaluate(t, merged), abs=1e-6)
    assert rep["eval_curve"][-1]["loss"] == rep["eval_loss_final_before_bn_recalibration"]   # the shards' model
    assert rep["eval_loss_final"] != rep["eval_loss_final_before_bn_recalibration"]

    # without the flag, export follows the task (50), like load_global_model
    from ddloco.export import load_global_model
    api = load_global_model(checkpoint_dir=ckpt).state_dict()
    assert all(torch.equal(api[k], v) for k, v in fresh.state_dict().items())

    # a negative count: one line, exit 2, nothing written
    bad = ddloco("export", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "bad.safetensors"),
                 "--recalibrate-bn", "-1", cwd=tmp_path, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "ddloco export: --recalibrate-bn must be >= 0, got -1"
    assert not (tmp_path / "bad.safetensors").exists()
