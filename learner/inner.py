"""The inner optimizer (ALGORITHM §3), one definition for the learner and every baseline
(`ddloco compare` runs DDP, one learner alone and synchronous DiLoCo with this same AdamW)."""
from __future__ import annotations

from typing import Iterable

import torch

from common.config import AlgoConfig

ADAMW_BETAS = (0.9, 0.95)
"""AdamW betas of the inner loop (nanoGPT's)."""


def make_inner_optimizer(params: Iterable[torch.nn.Parameter], algo: AlgoConfig
                         ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW at ``algo.inner_lr`` with a linear warm-up over ``algo.inner_warmup_steps`` steps."""
    opt = torch.optim.AdamW(params, lr=algo.inner_lr, betas=ADAMW_BETAS,
                            weight_decay=algo.inner_weight_decay)
    warm = max(1, algo.inner_warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return opt, sched


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               loss: torch.Tensor) -> None:
    """θ ← AdamW(θ, ∇L): backward of ``loss``, one optimizer step, one schedule step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
