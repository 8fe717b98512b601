"""A learner's receipt of a merged fragment (ALGORITHM §6): the merged value overwrites its
copy, or its steps not yet merged are carried on top of it (θ ← Θ_new + (θ − reference)), or it
mixes the two; and the counters of what it contributed. Split from ``common.merge`` (the shard's
side); the names are re-exported there."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common import quant
from common.boundary import split_run


def carry_local_steps(merged: torch.Tensor, local: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A learner's new value of a fragment when it keeps its uncontributed steps:
    Θ_new + (θ_local − reference), where ``reference`` is the value it last answered with (or
    its previous base). With one learner, η = 1 and μ = 0 this is exactly plain training."""
    return merged + (local - reference)


def carry_local_steps_(local: torch.Tensor, merged: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``carry_local_steps`` written into ``local`` (a view of the learner's tensor; all three 1-D
    float32 of one length): local ← merged + (local − reference), the same values, with no
    temporary vector: one pass with the C kernels (split over the boundary's threads where large:
    ``common.boundary.split_run``), else two in-place torch passes. Returns ``local``."""
    kernel = getattr(quant._kernels, "carry", None) if quant._kernels is not None else None
    with torch.no_grad():
        if kernel is not None and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                                      for t in (local, merged, reference)):
            split_run(kernel, local.detach().numpy(), merged.detach().numpy(), reference.detach().numpy())
            return local
        return local.sub_(reference).add_(merged)   # (θ − ref) + Θ_new: the sum of the same two terms


@dataclass(frozen=True)
class Contribution:
    """What a learner last answered fragment p with since its base: the snapshot and its counters."""

    snapshot: torch.Tensor
    steps: int
    tokens: int


def carried(base: torch.Tensor, contributed: Contribution | None, c_steps: int, c_tokens: int
            ) -> tuple[torch.Tensor, int, int]:
    """What a carry keeps (ALGORITHM §6): (the reference the local steps are counted from: the
    answered snapshot, else the old base; the counters less the answered steps and tokens)."""
    if contributed is None:
        return base, c_steps, c_tokens
    return contributed.snapshot, c_steps - contributed.steps, c_tokens - contributed.tokens


def receive_merged(merged: torch.Tensor, local: torch.Tensor | None, base: torch.Tensor,
                   contributed: Contribution | None, c_steps: int, c_tokens: int, *, carry: bool,
                   mix_alpha: float = 0.0) -> tuple[torch.Tensor, int, int]:
    """A learner's fragment value and counters after the merged value arrives (ALGORITHM §6).

    carry: Θ_new + (θ − the answered snapshot, else the old base); the answered steps and tokens
    leave the counters. Otherwise the paper's overwrite (α-mixed when ``mix_alpha`` > 0) and the
    counters restart at 0. ``local`` (the learner's current value) is only read by carry and
    α-mix; a plain overwrite may pass None. Returns (new value, c_steps, c_tokens)."""
    if (carry or mix_alpha > 0) and local is None:
        raise ValueError("carry and alpha-mixing need the learner's current value")
    if carry:
        ref, steps, tokens = carried(base, contributed, c_steps, c_tokens)
        return carry_local_steps(merged, local, ref), steps, tokens
    if mix_alpha > 0:
        return mix_alpha * local + (1 - mix_alpha) * merged, 0, 0
    return merged, 0, 0
