"""Re-estimating normalization statistics of a merged model (common/running_stats.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from common.task import Task, TaskError, evaluate
from common.running_stats import RECALIBRATION_STREAM, recalibrate, recalibrate_running_stats, tracked_norm_layers

pytestmark = pytest.mark.timeout(60)


class TwoBN(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear -> BatchNorm: the second layer's inputs depend on the
    first one's batch statistics, as in any deep BatchNorm model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 5)
        self.bn1 = nn.BatchNorm1d(5)
        self.fc2 = nn.Linear(5, 4)
        self.bn2 = nn.BatchNorm1d(4, momentum=None)
        with torch.no_grad():
            self.bn1.weight.uniform_(0.5, 2.0)
            self.bn1.bias.uniform_(-1.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.fc2(torch.relu(self.bn1(self.fc1(x)))))


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 6, generator=g) * 3.0 + 2.0 for _ in range(n)]


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _garbage(model: nn.Module) -> None:
    for m in tracked_norm_layers(model).values():
        m.running_mean.fill_(float("nan"))
        m.running_var.fill_(1e6)
        m.num_batches_tracked.fill_(12345)


def _expected_stats(model: TwoBN, batches: list[torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Plain averages over the batches of each layer's batch mean and unbiased variance, computed
    with the training-mode forward written out by hand."""
    means = {"bn1": [], "bn2": []}
    vars_ = {"bn1": [], "bn2": []}
    with torch.no_grad():
        for x in batches:
            h1 = model.fc1(x)
            means["bn1"].append(h1.mean(0))
            vars_["bn1"].append(h1.var(0, unbiased=True))
            normed = (h1 - h1.mean(0)) / torch.sqrt(h1.var(0, unbiased=False) + model.bn1.eps)
            h2 = model.fc2(torch.relu(normed * model.bn1.weight + model.bn1.bias))
            means["bn2"].append(h2.mean(0))
            vars_["bn2"].append(h2.var(0, unbiased=True))
    return {k: (torch.stack(means[k]).mean(0), torch.stack(vars_[k]).mean(0)) for k in means}


def test_garbage_statistics_are_replaced_by_the_average_over_the_batches_and_nothing_else_changes() -> None:
    torch.manual_seed(0)
    model = TwoBN().eval()
    model.fc2.train()      # a mixed mode must come back as it was, module by module
    _garbage(model)
    params = {k: v.clone() for k, v in model.named_parameters()}
    batches = _batches(5)
    done = recalibrate_running_stats(model, batches, _forward)
    assert (done.layers, done.batches, done.unreached) == (2, 5, ())
    want = _expected_stats(model, batches)
    for name in ("bn1", "bn2"):
        layer = getattr(model, name)
        torch.testing.assert_close(layer.running_mean, want[name][0], rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(layer.running_var, want[name][1], rtol=1e-5, atol=1e-5, msg=name)
        assert int(layer.num_batches_tracked) == 5
    assert all(torch.equal(params[k], v) for k, v in model.named_parameters()), "a parameter changed"
    assert [m.training for m in model.modules()] == [False, False, False, True, False]
    assert (model.bn1.momentum, model.bn2.momentum) == (0.1, None)
    assert not any(m._forward_pre_hooks for m in model.modules()), "a hook was left behind"
    # the recalibrated model in eval() mode: its statistics now fit its weights
    assert torch.isfinite(model.eval()(batches[0])).all()


def test_instance_norm_with_running_statistics_is_recalibrated_too() -> None:
    # InstanceNorm ignores momentum=None (it would keep its statistics): the per-call momentum must not
    torch.manual_seed(0)
    layer = nn.InstanceNorm1d(3, track_running_stats=True)
    layer.running_mean.fill_(50.0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 3, 10, generator=g) * 2.0 + 5.0 for _ in range(3)]
    done = recalibrate_running_stats(layer, batches, lambda m, x: m(x))
    assert (done.layers, done.batches) == (1, 3)
    want_mean = torch.stack([x.mean(2).mean(0) for x in batches]).mean(0)
    want_var = torch.stack([x.var(2, unbiased=True).mean(0) for x in batches]).mean(0)
    torch.testing.assert_close(layer.running_mean, want_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.running_var, want_var, rtol=1e-5, atol=1e-5)
    assert layer.training and layer.momentum == 0.1


def test_an_error_in_the_forward_leaves_the_statistics_and_modes_as_they_were() -> None:
    torch.manual_seed(0)
    model = TwoBN().eval()
    _garbage(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def failing(m: nn.Module, x: torch.Tensor) -> None:
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("bad batch")
        m(x)

    with pytest.raises(RuntimeError, match="bad batch"):
        recalibrate_running_stats(model, _batches(5), failing)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert torch.isnan(model.bn1.running_mean).all() and int(model.bn1.num_batches_tracked) == 12345
    assert not any(m.training for m in model.modules())


def test_a_model_without_normalization_statistics_is_left_alone_with_a_note() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.BatchNorm1d(3, track_running_stats=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = recalibrate_running_stats(model, _batches(2), lambda m, x: m(x[:, :3]))
    assert (done.layers, done.batches) == (0, 0)
    assert done.describe() == "no normalization layer tracks running statistics: nothing to recalibrate"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_layer_the_loss_never_calls_keeps_its_statistics() -> None:
    torch.manual_seed(0)
    model = TwoBN()
    model.spare = nn.BatchNorm1d(2)
    model.spare.running_mean.fill_(7.0)
    done = recalibrate_running_stats(model, _batches(2), _forward)
    assert (done.layers, done.unreached) == (2, ("spare",))
    assert torch.equal(model.spare.running_mean, torch.full((2,), 7.0))
    assert "not reached by the loss, kept as merged: spare" in done.describe()


def _task(calls: list[tuple[int, int, int]], n_batches: int | None = None) -> Task:
    def batches(stream: int, seed: int, start: int):
        calls.append((stream, seed, start))
        return iter(_batches(n_batches if n_batches is not None else 100, seed=stream % 1000 + seed))
    return Task(name="two-bn", model=TwoBN, batches=batches, loss=_forward, recalibrate_bn_batches=4)


def test_recalibrate_reads_its_own_stream_of_the_run_seed_from_batch_0() -> None:
    calls: list[tuple[int, int, int]] = []
    torch.manual_seed(0)
    model = TwoBN()
    _garbage(model)
    done = recalibrate(_task(calls), model, seed=7, batches=4)
    assert calls == [(RECALIBRATION_STREAM, 7, 0)]
    assert (done.layers, done.batches) == (2, 4)
    want = _expected_stats(model, _batches(4, seed=RECALIBRATION_STREAM % 1000 + 7))
    torch.testing.assert_close(model.bn1.running_mean, want["bn1"][0], rtol=1e-5, atol=1e-5)


def test_recalibrate_refuses_no_batches_and_a_negative_count_with_one_line() -> None:
    model = TwoBN()
    _garbage(model)
    with pytest.raises(TaskError, match=r"recalibrating running statistics on batches\(2147483646, 0, 0\): "
                                        r"it yielded nothing"):
        recalibrate(_task([], n_batches=0), model, seed=0, batches=4)
    assert torch.isnan(model.bn1.running_mean).all()
    with pytest.raises(TaskError, match="must be an int >= 0, got -1"):
        recalibrate(_task([]), model, seed=0, batches=-1)
    with pytest.raises(TaskError, match=r"Task.recalibrate_bn_batches must be an int >= 0, got -2"):
        Task(name="x", model=TwoBN, batches=lambda *a: iter(()), loss=_forward, recalibrate_bn_batches=-2)
    with pytest.raises(TaskError, match=r"Task.recalibrate_bn_batches must be an int >= 0, got True"):
        Task(name="x", model=TwoBN, batches=lambda *a: iter(()), loss=_forward, recalibrate_bn_batches=True)


# ---------------------------------------------------------------------------- up's final model
def _monitor(task: Task, lines: list[str]):
    from common.config import ConfigFile
    from common.keys import Keys
    from ddloco.monitor import Monitor
    monitor = Monitor(ConfigFile(), None, Keys("t"), task, learner_ids=[], say=lines.append)  # no Redis needed here
    _garbage(monitor.model)
    monitor.final_versions = {0: 1}
    return monitor


def test_up_reports_the_final_loss_with_recalibrated_statistics_and_keeps_the_merged_one() -> None:
    held = _batches(2, seed=99)
    task = dataclasses.replace(_task([]), eval_batches=lambda: iter(held))
    lines: list[str] = []
    monitor = _monitor(task, lines)
    monitor.evals.append({"t": 1.0, "tokens": 10, "loss": 123.0, "versions_total": 1, "final": True})
    monitor.recalibrate_final()
    assert monitor.bn_recalibrated_batches == 4
    assert monitor.eval_loss_bn_recalibrated == evaluate(task, monitor.model)
    assert torch.isfinite(monitor.model.bn1.running_mean).all()
    assert lines == [f"final      global model eval loss {monitor.eval_loss_bn_recalibrated:.4f} with normalization "
                     f"statistics re-estimated on 4 training batches (merged statistics: 123.0000)"]
    assert monitor.evals[-1]["loss"] == 123.0   # the curve keeps the shards' model


def test_up_notes_a_model_without_statistics_and_a_failing_stream_in_one_line_each() -> None:
    lines: list[str] = []
    plain = Task(name="plain", model=lambda: nn.Linear(6, 30), batches=lambda *a: iter(_batches(9)),
                 loss=lambda m, x: m(x).mean(), recalibrate_bn_batches=5)
    monitor = _monitor(plain, lines)
    monitor.recalibrate_final()
    assert lines == ["final      note: no normalization layer tracks running statistics: nothing to recalibrate "
                     "(Task.recalibrate_bn_batches = 5 has no effect)"]
    assert monitor.bn_recalibrated_batches == 0 and monitor.eval_loss_bn_recalibrated is None
    lines.clear()
    monitor = _monitor(_task([], n_batches=0), lines)
    monitor.recalibrate_final()
    assert len(lines) == 1 and lines[0].endswith("it yielded nothing; the merged statistics are kept"), lines
    assert torch.isnan(monitor.model.bn1.running_mean).all()
    assert monitor.bn_recalibrated_batches == 0
