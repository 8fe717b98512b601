"""Running statistics of normalization layers, re-estimated for the global model's weights.

The global model's weights are a merge of the learners' weights, and its BatchNorm running mean
and variance are the token-weighted average of the learners' own statistics: statistics of other
weights. In ``eval()`` mode the merged model can then score worse than its weights allow.
``recalibrate`` forwards training batches through the model in ``train()`` mode without
gradients, so that every layer that tracks running statistics (BatchNorm1d/2d/3d, SyncBatchNorm,
InstanceNorm with ``track_running_stats``: any ``torch.nn.modules.batchnorm._NormBase`` holding
them) ends with the plain average of its batch statistics over those batches, the same as
``torch.optim.swa_utils.update_bn`` does for averaged weights. Only those buffers change
(``running_mean``, ``running_var``, ``num_batches_tracked``); parameters, momentum and each
module's ``train``/``eval`` mode are as they were.

The plain average is momentum 1/k at a layer's k-th call, set per call by a forward pre-hook:
PyTorch's ``momentum=None`` gives that for BatchNorm but leaves InstanceNorm's statistics unchanged.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

if TYPE_CHECKING:
    from common.task import Task

RECALIBRATION_STREAM = 2**31 - 2
"""The statistics are re-estimated on ``task.batches(RECALIBRATION_STREAM, run seed, 0)``:
training data that no learner of ``ddloco up`` reads (learner r reads stream r), the highest stream
``indexed_batches`` accepts (2**31 - 1 stays for held-out data)."""


@dataclass(frozen=True)
class Recalibration:
    """What ``recalibrate`` did."""

    layers: int
    """Normalization layers whose statistics were re-estimated."""
    batches: int
    """Batches forwarded (fewer than asked when the batches ran out)."""
    unreached: tuple[str, ...] = ()
    """Layers that track statistics but that the forward never called: they keep theirs."""

    def describe(self) -> str:
        if self.layers == 0 and not self.unreached:
            return "no normalization layer tracks running statistics: nothing to recalibrate"
        text = (f"recalibrated the running statistics of {self.layers} normalization layer(s) on "
                f"{self.batches} training batches (stream {RECALIBRATION_STREAM}, from batch 0)")
        if self.unreached:
            text += f"; not reached by the loss, kept as merged: {', '.join(self.unreached)}"
        return text


def tracked_norm_layers(model: nn.Module) -> dict[str, _NormBase]:
    """The model's normalization layers that hold running statistics, by module name."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, _NormBase) and m.track_running_stats and m.running_mean is not None}


def recalibrate_running_stats(model: nn.Module, batches: Iterable[Any],
                              forward: Callable[[nn.Module, Any], Any]) -> Recalibration:
    """Re-estimate the running statistics of ``model``'s normalization layers as the plain average
    over ``forward(model, batch)`` of every batch, in ``train()`` mode without gradients. An error
    in ``forward`` leaves the statistics as they were (and propagates); so does an empty ``batches``."""
    layers = tracked_norm_layers(model)
    if not layers:
        return Recalibration(layers=0, batches=0)
    saved = {name: {k: v.clone() for k, v in _stats(m).items()} for name, m in layers.items()}
    momentum = {name: m.momentum for name, m in layers.items()}
    modes = {m: m.training for m in model.modules()}
    calls = dict.fromkeys(layers, 0)

    def cumulative(name: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, _inputs: Any) -> None:
            calls[name] += 1
            module.momentum = 1.0 / calls[name]   # k-th call: running = mean of the k batch statistics
        return hook

    hooks = [m.register_forward_pre_hook(cumulative(name)) for name, m in layers.items()]
    n = 0
    try:
        model.train()
        with torch.no_grad():
            for batch in batches:
                if n == 0:
                    for m in layers.values():
                        m.reset_running_stats()   # zeros and ones: garbage (NaN) must not survive x 0
                forward(model, batch)
                n += 1
    except BaseException:
        _restore(layers, saved, layers)
        raise
    finally:
        for h in hooks:
            h.remove()
        for name, m in layers.items():
            m.momentum = momentum[name]
        for m, training in modes.items():
            m.train(training)
    unreached = tuple(name for name, k in calls.items() if k == 0)
    _restore(layers, saved, unreached)
    return Recalibration(layers=len(layers) - len(unreached), batches=n, unreached=unreached)


def _stats(m: _NormBase) -> dict[str, torch.Tensor]:
    out = {"running_mean": m.running_mean, "running_var": m.running_var}
    if m.num_batches_tracked is not None:
        out["num_batches_tracked"] = m.num_batches_tracked
    return out


def _restore(layers: dict[str, _NormBase], saved: dict[str, dict[str, torch.Tensor]], names: Iterable[str]) -> None:
    with torch.no_grad():
        for name in names:
            for k, v in _stats(layers[name]).items():
                v.copy_(saved[name][k])


def recalibrate(task: "Task", model: nn.Module, *, seed: int, batches: int) -> Recalibration:
    """``recalibrate_running_stats`` on the first ``batches`` batches of
    ``task.batches(RECALIBRATION_STREAM, seed, 0)`` through ``task.loss``. TaskError (the
    statistics unchanged) when the batches or the loss fail, or no batch comes."""
    from common.task import TaskError, batch_to
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
        raise TaskError(f"batches to recalibrate on must be an int >= 0, got {batches!r}")
    if batches == 0 or not tracked_norm_layers(model):
        return Recalibration(layers=0, batches=0)
    device = next(itertools.chain(model.parameters(), model.buffers())).device
    where = f"task {task.name!r}: recalibrating running statistics on batches({RECALIBRATION_STREAM}, {seed}, 0)"
    try:
        stream = itertools.islice(task.batches(RECALIBRATION_STREAM, seed, 0), batches)
        done = recalibrate_running_stats(model, stream, lambda m, b: task.loss(m, batch_to(b, device)))
    except TaskError as e:
        raise TaskError(f"{where}: {e}") from None
    except Exception as e:  # the user's batches or forward
        raise TaskError(f"{where}: {type(e).__name__}: {e}") from None
    if done.batches == 0:
        raise TaskError(f"{where}: it yielded nothing")
    return done
