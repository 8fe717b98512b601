"""Diagnostic of the seventh quality measurement (docs/ALGORITHM.md section 10), not part of the product.

Question: which parameters carry the remaining gap to data-parallel? The emulated rounds run with
the defaults, except that one group of tensors is trained data-parallel: at every step the
learners' gradients of that group are averaged before each learner's AdamW step (a gradient
all-reduce for the group), so the group's values and AdamW moments stay identical on every learner
and follow data-parallel's mathematics, while the rest is merged by the rounds. If the gap is in
that group, training it data-parallel closes it.

Groups: ``emb`` (wte, wpe), ``ln`` (LayerNorm weights and biases), ``attn`` (q, k, v, proj),
``mlp`` (fc, proj), ``all``, ``none`` (no extra averaging: the defaults).

Usage: python docs/quality/group_sync_experiment.py SEED GROUP [JSON algo overrides]
Prints one JSON line with the final eval loss and the curve (decoupled_emulated, gpt, M = 4, 400 steps).
"""
import json
import sys
from dataclasses import replace

import torch

from common.config import AlgoConfig
from ddloco.compare import systems
from learner.inner import apply_step
from common.task import load_task

GROUPS = {
    "emb": lambda n: n.startswith(("wte", "wpe")),
    "ln": lambda n: ".ln" in n or n.startswith("ln_f"),
    "attn": lambda n: ".attn." in n,
    "mlp": lambda n: ".mlp." in n,
    "all": lambda n: True,
    "none": lambda n: False,
}


def patch(group: str, delay: int = 0) -> None:
    """Train ``group`` on every learner with the learners' gradients averaged at each step. With
    ``delay`` D > 0 the others' gradients arrive D steps late: learner m steps the group with
    (g_m(t) + sum over the others of g_j(t - D)) / M (its own gradient alone before step D)."""
    chosen = GROUPS[group]
    reps_seen: list = []
    make_replicas = systems._replicas
    waiting: list = []
    past: list = []            # per step, per learner: {name: gradient} (kept only when delay > 0)

    def replicas(*a, **k):
        reps = make_replicas(*a, **k)
        reps_seen[:] = reps
        return reps

    def inner(model, opt, sched, loss, algo=None):
        opt.zero_grad(set_to_none=True)
        loss.backward()
        waiting.append((model, opt, sched, algo))
        if len(waiting) < len(reps_seen):       # the step waits until every learner has its gradient
            return opt.param_groups[0]["lr"]
        named = [dict(m.named_parameters()) for m, *_ in waiting]
        with torch.no_grad():
            if delay == 0:
                for name in named[0]:
                    if chosen(name):
                        mean = torch.stack([p[name].grad for p in named]).mean(dim=0)
                        for p in named:
                            p[name].grad.copy_(mean)
            else:
                now = [{n: p.grad.detach().clone() for n, p in d.items() if chosen(n)} for d in named]
                past.append(now)
                old = past[0] if len(past) > delay else None
                del past[:-delay]
                if old is not None:
                    for i, d in enumerate(named):
                        for n in now[i]:
                            g = now[i][n].clone()
                            for j in range(len(named)):
                                if j != i:
                                    g += old[j][n]
                            d[n].grad.copy_(g / len(named))
        for m, o, s, a in waiting:
            lr = apply_step(m, o, s, a)
        waiting.clear()
        return lr

    systems._replicas, systems.inner_step = replicas, inner


if __name__ == "__main__":
    seed, group = int(sys.argv[1]), sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    patch(group)
    torch.set_num_threads(1)
    task = load_task("gpt", {})
    algo = replace(AlgoConfig(), **extra)
    r = systems.run_decoupled_emulated(task, algo, learners=4, steps=400, seed=seed, eval_points=8)
    print(json.dumps({"seed": seed, "mode": "base", "group": group, "extra": extra, "loss": r.eval_loss_final,
                      "curve": r.curve, "wall": r.wall_s}), flush=True)
