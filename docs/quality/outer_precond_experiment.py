"""Experiment of the sixth quality measurement (docs/ALGORITHM.md section 10), not part of the product.

Hypothesis: M AdamW learners on 1/M of the batch each normalise their steps by a second moment
that holds M x the gradient noise of the whole batch, so in noise-dominated coordinates their
averaged step is up to sqrt(M) x shorter than data-parallel AdamW's, while in signal-dominated
coordinates it is the same. RDA (and any outer lr) rescales a whole tensor, which cannot restore
that per-coordinate balance. Here the shard instead scales each coordinate of the merged outer
gradient by f = sqrt(A / (A - (1 - 1/M) N)), clamped to [1, sqrt(M)], where A is an EMA over merges
of the learners' mean squared outer gradient and N an EMA of their variance across learners
(each fragment keeps its own two EMAs, beta ``--beta``; beta 0: this merge's values alone).

Usage: python docs/quality/outer_precond_experiment.py SEED base|precond [BETA] [JSON algo overrides]
Prints one JSON line with the final eval loss and the curve (decoupled_emulated, gpt, M = 4, 400 steps).
"""
import json
import sys
from dataclasses import replace

import torch

from common import merge
from common.config import AlgoConfig
from ddloco.compare import systems
from common.task import load_task

STATE: dict[int, list] = {}


def coordinate_factor(outer_grads: torch.Tensor, key: int, beta: float) -> torch.Tensor:
    """f per coordinate for the M > 1 answers ``outer_grads`` [M, n] of the fragment ``key``
    (its EMAs live in STATE under that key)."""
    m = outer_grads.shape[0]
    sq = (outer_grads * outer_grads).mean(dim=0)
    var = outer_grads.var(dim=0, unbiased=True)
    st = STATE.setdefault(key, [torch.zeros_like(sq), torch.zeros_like(sq), 0])
    st[0].mul_(beta).add_(sq, alpha=1 - beta)
    st[1].mul_(beta).add_(var, alpha=1 - beta)
    st[2] += 1
    corr = 1 - beta ** st[2]
    a, n = st[0] / corr, st[1] / corr
    dp_like = (a - (1 - 1 / m) * n).clamp(min=0)
    f = (a / dp_like.clamp(min=1e-30)).sqrt().clamp(1.0, m ** 0.5)
    return torch.where(a > 0, f, torch.ones_like(f))


def make_update(beta: float):
    def update(theta, momentum, outer_grads, weights, spans, algo, *, merges_done=0, rule=None):
        mean = weights @ outer_grads                                    # [n]
        grad = merge.merge_outer_gradients(outer_grads, weights, spans, "mean")
        if outer_grads.shape[0] > 1:
            f = coordinate_factor(outer_grads, id(momentum), beta)
            for start, stop, kind in spans:
                if merge._span_kind(kind) == "param":
                    grad[start:stop] = mean[start:stop] * f[start:stop]
        return merge.outer_step(theta, momentum, grad, spans, algo, merges_done=merges_done)
    return update


if __name__ == "__main__":
    seed, mode = int(sys.argv[1]), sys.argv[2]
    beta = float(sys.argv[3]) if len(sys.argv) > 3 else 0.9
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    if mode == "precond":
        systems.outer_update = make_update(beta)
    torch.set_num_threads(1)
    task = load_task("gpt", {})
    algo = replace(AlgoConfig(), **extra)
    r = systems.run_decoupled_emulated(task, algo, learners=4, steps=400, seed=seed, eval_points=8)
    print(json.dumps({"seed": seed, "mode": mode, "beta": beta, "extra": extra, "loss": r.eval_loss_final,
                      "curve": r.curve, "wall": r.wall_s}), flush=True)
