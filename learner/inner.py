"""The inner optimizer (ALGORITHM §3), one definition for the learner and every baseline
(`ddloco compare` runs DDP, one learner alone and synchronous DiLoCo with this same AdamW).

Learning rate of an inner step (``lr_at``)::

    lr = inner_lr · schedule(T) · min(1, (s + 1) / inner_warmup_steps)

``T`` is the *run's* global token count (Redis counter, all learners together) and ``s`` the
step within this learner's life. ``schedule`` warms up linearly over ``lr_warmup_tokens``, then
stays constant or decays (cosine or linear) to ``lr_min_ratio`` at ``lr_decay_tokens``. A learner
that joins late or restarts therefore lands at the run's point of the schedule; the short
per-life ramp ``inner_warmup_steps`` only protects its freshly zeroed AdamW moments.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from common.config import AlgoConfig
from learner.compiler_deferral import defer_compiler_import


def schedule_factor(algo: AlgoConfig, tokens: float) -> float:
    """The run schedule's multiplier of ``inner_lr`` at global token count ``tokens``."""
    warm = algo.lr_warmup_tokens
    if warm > 0 and tokens < warm:
        return max(tokens, 0.0) / warm
    if algo.lr_schedule == "constant":
        return 1.0
    span = algo.lr_decay_tokens - warm
    progress = min(1.0, max(0.0, (tokens - warm) / span)) if span > 0 else 1.0
    low = algo.lr_min_ratio
    if algo.lr_schedule == "cosine":
        return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - low) * progress                                     # linear


def lr_at(algo: AlgoConfig, tokens: float, life_step: int) -> float:
    """Learning rate of the inner step number ``life_step`` (0-based, this life) at global
    token count ``tokens``."""
    local = min(1.0, (life_step + 1) / max(1, algo.inner_warmup_steps))
    return algo.inner_lr * schedule_factor(algo, tokens) * local


FUSED_DEVICES = ("cpu", "cuda")


def fused_supported(params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether PyTorch's fused AdamW kernel can update these parameters: plain floating-point
    tensors on a CPU or CUDA device (not DTensors: a sharded group keeps PyTorch's default).

    The fused kernel reads and writes each parameter, gradient and moment once per step: on this
    project's CPU it took 11.3-12.3 ms at 16.8 M parameters against 44.8-112 ms for PyTorch's
    default CPU loop and 60.4-67.4 ms for ``foreach`` (which allocates a temporary the size of the
    second moments), 72.7 ms against 515 ms at 10^8 (``ddloco bench adamw``), and it allocates
    nothing the size of the model. Its results equal the default's to
    float rounding (a few ulps), not bit for bit."""
    params = list(params)
    return bool(params) and all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point()
                                and p.device.type in FUSED_DEVICES for p in params)


def make_inner_optimizer(params: Iterable[torch.nn.Parameter], algo: AlgoConfig,
                         tokens: Callable[[], float] | None = None
                         ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (``inner_beta1``, ``inner_beta2``, ``inner_weight_decay``) whose learning rate
    follows ``lr_at`` with ``tokens()`` as the global token count (None: 0, i.e. the schedule's
    start; only the per-life ramp then moves the learning rate). The fused kernel where the
    parameters allow it (``fused_supported``), else PyTorch's default. Torch's compiler stack is
    not imported for it (``defer_compiler_import``: seconds off a cold learner)."""
    defer_compiler_import()
    params = list(params)
    opt = torch.optim.AdamW(params, lr=algo.inner_lr, betas=(algo.inner_beta1, algo.inner_beta2),
                            weight_decay=algo.inner_weight_decay, fused=fused_supported(params) or None)
    count = tokens or (lambda: 0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(algo, count(), s) / algo.inner_lr)
    return opt, sched


KERNEL_FLAGS = ("fused", "foreach", "capturable", "differentiable")
"""Per-group AdamW settings that say how this process runs the step, not what it computes."""


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """Load another optimizer's state (a peer's AdamW, ALGORITHM §8) keeping this optimizer's own
    kernel: ``load_state_dict`` would otherwise take the sender's ``fused``/``foreach`` flags
    with its param groups (a fused learner loading a peer's default-loop state would run the slow
    loop for the rest of its life)."""
    ours = opt.param_groups
    groups = [{**g, **{k: mine[k] for k in KERNEL_FLAGS if k in mine}}
              for g, mine in zip(state["param_groups"], ours)]
    opt.load_state_dict({**state, "param_groups": groups})


def apply_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               algo: AlgoConfig | None = None) -> float:
    """After the (accumulated) backward passes: clip the gradient norm to ``inner_grad_clip``
    (when > 0), step, advance the schedule. Returns the learning rate used."""
    if algo is not None and algo.inner_grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), algo.inner_grad_clip)
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    return lr


def inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
               loss: torch.Tensor, algo: AlgoConfig | None = None) -> float:
    """θ ← AdamW(θ, ∇L): backward of ``loss``, one optimizer step, one schedule step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return apply_step(model, opt, sched, algo)
