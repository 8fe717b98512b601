"""The outer optimizer of a shard's merge (ALGORITHM §5) and the quantized-update downlink (§7):
one outer SGD step with (Nesterov) momentum, its learning-rate warm-up, and the broadcast of
q(master − replica). Split from ``common.merge`` (the merge of outer gradients); the names are
re-exported there."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from common import quant
from common.config import AlgoConfig


def _span_kind(kind: str | bool) -> str:
    if isinstance(kind, bool):  # (start, stop, embedding) spans of whole-tensor plans
        return "embedding" if kind else "param"
    return kind


def outer_nesterov_step(
    theta: torch.Tensor,
    momentum: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    momentum_coef: float,
    nesterov: bool = True,
    check_only: bool = False,
) -> None:
    """One outer SGD step with (Nesterov) momentum, in place on ``theta`` and ``momentum``.

    Bit-identical to ``torch.optim.SGD([theta], lr=lr, momentum=momentum_coef,
    nesterov=nesterov)`` when ``momentum`` starts at zeros: same op sequence as torch's
    single-tensor SGD.
    """
    if theta.shape != grad.shape or theta.shape != momentum.shape:
        raise ValueError(
            f"shape mismatch: theta {tuple(theta.shape)}, momentum {tuple(momentum.shape)}, "
            f"grad {tuple(grad.shape)}"
        )
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be finite and > 0, got {lr}")
    if not 0.0 <= momentum_coef < 1.0:
        raise ValueError(f"momentum_coef must be in [0, 1), got {momentum_coef}")
    if check_only:   # the arguments' checks only (outer_step takes the μ = 0 step itself)
        return
    with torch.no_grad():
        if momentum_coef == 0:
            theta.add_(grad, alpha=-lr)
            return
        momentum.mul_(momentum_coef).add_(grad)                         # b ← μ·b + Δ
        if not nesterov:
            theta.add_(momentum, alpha=-lr)                             # Θ ← Θ − η·b
            return
        step = grad.add(momentum, alpha=momentum_coef)                  # Δ + μ·b
        theta.add_(step, alpha=-lr)                                     # Θ ← Θ − η·(Δ + μ·b)


def outer_lr_at(lr: float, merges_done: int, warmup_merges: int) -> float:
    """Outer learning rate of a fragment's next merge: linear warm-up over its first
    ``warmup_merges`` merges ((k+1)/N · η for merge k), then η."""
    if warmup_merges <= 0:
        return lr
    return lr * min(1.0, (merges_done + 1) / warmup_merges)


def quantized_update(replica: torch.Tensor, master: torch.Tensor, codec: str) -> tuple[torch.Tensor, list[Any]]:
    """The quantized-update downlink (ALGORITHM §7): (the new replica, the broadcast's codec
    frames). The frames carry q(master − replica); the new replica is replica + deq(frames), the
    same fp32 addition every learner holding ``replica`` makes, so all copies stay bit-identical."""
    fused = quant.encode_update(master, replica, codec)
    if fused is not None:   # one pass: the same bytes and values as the two lines below
        return fused
    frames = quant.encode(master - replica, codec)
    return replica + quant.decode(frames, codec, master.numel()), frames


def outer_step(theta: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor,
               spans: Sequence[tuple[int, int, str | bool]], algo: AlgoConfig, *, merges_done: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's outer step with the merged outer gradient ``grad``, on copies (see
    ``outer_update``); buffers take the learners' merged value, without the outer optimizer.
    With μ = 0 the momentum is returned as given (unchanged, not copied)."""
    moving = algo.outer_momentum != 0
    lr = outer_lr_at(algo.outer_lr, merges_done, algo.outer_warmup_merges)
    if moving:   # with μ = 0 the momentum is never read nor written: no copy of it per merge
        new_theta, momentum = theta.clone(), momentum.clone()
        outer_nesterov_step(new_theta, momentum, grad, lr=lr, momentum_coef=algo.outer_momentum,
                            nesterov=algo.outer_nesterov)
    else:        # Θ − η·Δ into a new tensor in one pass (the same kernel and values as clone + add_)
        outer_nesterov_step(theta, momentum, grad, lr=lr, momentum_coef=0.0, check_only=True)
        new_theta = torch.add(theta, grad, alpha=-lr)
    for start, stop, kind in spans:  # buffers: the learners' merged value, no outer optimizer
        if _span_kind(kind) in ("buffer", "int_buffer"):
            new_theta[start:stop] = theta[start:stop] - grad[start:stop]
            if moving:
                momentum[start:stop] = 0.0
    return new_theta, momentum
