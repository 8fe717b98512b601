"""Experiments of the seventh quality measurement (docs/ALGORITHM.md section 10), not part of the product.

The group diagnostic (group_sync_experiment.py) found that training the embeddings (wte, tied to
the output head, and wpe; 6.5 % of the parameters) data-parallel closes about half of the gap to
data-parallel, as much as the attention matrices do: the cheapest group to synchronise. These
variants change only how the embedding spans are merged or synced, everything else at the defaults:

- ``none``: the defaults;
- ``rda``: embedding spans merged with RDA like the other parameters (the paper leaves them to the
  weighted mean);
- ``eta=X``: the embedding spans' merged outer gradient is scaled by X (an outer step of X);
- ``avg``: the embedding tensors are averaged across the learners after every step (parameters,
  not gradients; outside the rounds);
- ``precond``: the per-coordinate scaling of outer_precond_experiment.py on the embedding spans;
- ``lr=X``: the learners' inner steps on the embedding tensors are X times AdamW's (an inner
  learning rate of X · lr for wte and wpe; their weight decay is 0);
- ``share=D`` (group_sync_experiment.patch("emb", delay=D)): every learner's embedding gradients are shared with the others, D steps late:
  learner m steps its embeddings with (g_m(t) + sum over the others of g_j(t - D)) / M, its own
  AdamW moments (D = 0 is data-parallel for the embeddings, as group_sync_experiment.py's ``emb``);
- ``b1=X``: the learners' AdamW on the embedding tensors uses beta1 = X (its momentum averages the
  gradient noise over more steps);
- ``damp=C`` / ``dampemb=C``: when a learner applies a merged fragment, its AdamW first moment of
  that fragment's values (of its embedding values only, with ``dampemb``) is multiplied by C: the
  momentum it built on its own trajectory is not carried on past the merge at full strength (a
  change only a merging system can make; data-parallel has no merge);
- ``rows``: each row of the token embedding (wte) is merged with weights proportional to how
  often each learner saw that byte as input since its previous answer of the fragment (a row no
  learner saw: the plain weights). A byte that one learner saw moves its row by that learner's
  delta, not a quarter of it.

Usage: python docs/quality/embedding_experiment.py SEED MODE [JSON algo overrides]
(MODE ``dp:lr=X``: data-parallel, dp_emulated, with the same inner change.)
"""
import json
import os
import sys

import numpy as np
from dataclasses import replace

import torch

from common import merge
from common.config import AlgoConfig
from ddloco.compare import systems
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import group_sync_experiment  # noqa: E402  (the seventh measurement's gradient sharing)
from outer_precond_experiment import coordinate_factor  # noqa: E402  (the sixth measurement's scaling)
from common.task import load_task

CURRENT: list = [None]          # the fragment open_round gathered last
COUNTS: list = []               # per learner: cumulative input-byte counts
SEEN: dict[int, list] = {}      # per fragment (id of its momentum): COUNTS at its previous merge


is_emb_name = group_sync_experiment.GROUPS["emb"]       # wte (tied to the head) and wpe


def is_emb(kind) -> bool:
    return merge._span_kind(kind) == "embedding"


def patch(mode: str) -> None:
    if mode == "none":
        return
    if mode == "avg":
        reps_seen: list = []
        make_replicas, step = systems._replicas, systems.inner_step
        calls = [0]

        def replicas(*a, **k):
            reps_seen[:] = make_replicas(*a, **k)
            return reps_seen[:]

        def inner(model, *a, **k):
            out = step(model, *a, **k)
            calls[0] += 1
            if calls[0] % len(reps_seen) == 0:
                with torch.no_grad():
                    named = [dict(r.model.named_parameters()) for r in reps_seen]
                    for name in named[0]:
                        if is_emb_name(name):
                            mean = torch.stack([p[name] for p in named]).mean(dim=0)
                            for p in named:
                                p[name].copy_(mean)
            return out

        systems._replicas, systems.inner_step = replicas, inner
        return

    if mode.startswith("lr="):
        x, step = float(mode[3:]), systems.inner_step

        def inner(model, *a, **k):
            emb = [p for n, p in model.named_parameters() if is_emb_name(n)]
            before = [p.detach().clone() for p in emb]
            out = step(model, *a, **k)
            with torch.no_grad():
                for p, b in zip(emb, before):
                    p.copy_(b + x * (p - b))
            return out

        systems.inner_step = inner
        return
    if mode.startswith("b1="):
        beta1, build, make_opt = float(mode[3:]), systems.build_model, systems.make_inner_optimizer
        built: list = []

        def build_model(*a, **k):
            built[:] = [build(*a, **k)]
            return built[0]

        def make_inner_optimizer(params, algo, tokens=None):   # the model built last is the one
            opt, sched = make_opt(params, algo, tokens=tokens)
            emb = [p for n, p in built[0].named_parameters() if is_emb_name(n)]
            ids = {id(p) for p in emb}
            group = opt.param_groups[0]
            group["params"] = [p for p in group["params"] if id(p) not in ids]
            opt.add_param_group({"params": emb, "betas": (beta1, group["betas"][1])})
            opt.param_groups[1]["lr"] = group["lr"]
            sched.lr_lambdas.append(sched.lr_lambdas[0])
            sched.base_lrs.append(sched.base_lrs[0])
            return opt, sched

        systems.build_model, systems.make_inner_optimizer = build_model, make_inner_optimizer
        return
    if mode.startswith(("damp=", "dampemb=")):
        only_emb = mode.startswith("dampemb=")
        factor, make_replicas, scatter = float(mode.split("=")[1]), systems._replicas, systems.scatter
        owners: dict = {}

        def replicas(*a, **k):
            reps = make_replicas(*a, **k)
            owners.clear()
            owners.update({id(r.params): r for r in reps})
            return reps

        def scattering(params, fragment, value, *a, **k):
            out = scatter(params, fragment, value, *a, **k)
            r = owners.get(id(params))
            if r is not None:                          # a learner applying a merged fragment
                named = dict(r.model.named_parameters())
                with torch.no_grad():
                    for piece in fragment.pieces:
                        if only_emb and not is_emb_name(piece.name):
                            continue
                        st = r.opt.state.get(named.get(piece.name))
                        if st and "exp_avg" in st:
                            st["exp_avg"].view(-1)[piece.start:piece.stop] *= factor
            return out

        systems._replicas, systems.scatter = replicas, scattering
        return
    if mode.startswith("share="):
        group_sync_experiment.patch("emb", delay=int(mode[6:]))
        return
    if mode == "rows":
        make_replicas, gather = systems._replicas, systems.gather

        def counting(m, it):
            for batch in it:
                COUNTS[m] += np.bincount(np.asarray(batch.inputs).ravel(), minlength=256)
                yield batch

        def replicas(*a, **k):
            reps = make_replicas(*a, **k)
            COUNTS[:] = [np.zeros(256) for _ in reps]
            for m, r in enumerate(reps):
                r.data = counting(m, r.data)
            return reps

        def gathering(params, fragment, *a, **k):
            CURRENT[0] = fragment
            return gather(params, fragment, *a, **k)

        systems._replicas, systems.gather = replicas, gathering

    def update(theta, momentum, outer_grads, weights, spans, algo, *, merges_done=0, rule=None):
        if mode == "rows":
            grad = merge.merge_outer_gradients(outer_grads, weights, spans, algo.merge_rule)
            last = SEEN.setdefault(id(momentum), [np.zeros(256) for _ in COUNTS])
            window = torch.tensor(np.stack([c - l for c, l in zip(COUNTS, last)]), dtype=torch.float32)  # [M, 256]
            SEEN[id(momentum)] = [c.copy() for c in COUNTS]
            for (a, b, k), piece in zip(spans, CURRENT[0].pieces):
                if piece.name != "wte.weight":
                    continue
                width = piece.tensor.shape[1]
                assert piece.start % width == 0 and piece.stop % width == 0
                rows = slice(piece.start // width, piece.stop // width)
                w = window[:, rows]                                            # [M, R]
                tot = w.sum(dim=0, keepdim=True)
                w = torch.where(tot > 0, w / tot.clamp(min=1), weights[:, None].expand_as(w))
                block = outer_grads[:, a:b].reshape(outer_grads.shape[0], -1, width)   # [M, R, width]
                grad[a:b] = (w[:, :, None] * block).sum(dim=0).reshape(-1)
            return merge.outer_step(theta, momentum, grad, spans, algo, merges_done=merges_done)
        if mode == "rda":
            spans2 = [(a, b, "param" if is_emb(k) else k) for a, b, k in spans]
            grad = merge.merge_outer_gradients(outer_grads, weights, spans2, algo.merge_rule)
            return merge.outer_step(theta, momentum, grad, spans, algo, merges_done=merges_done)
        grad = merge.merge_outer_gradients(outer_grads, weights, spans, algo.merge_rule)
        if mode.startswith("eta="):
            x = float(mode[4:])
            for a, b, k in spans:
                if is_emb(k):
                    grad[a:b] *= x
        elif mode == "precond" and outer_grads.shape[0] > 1:
            f = coordinate_factor(outer_grads, id(momentum), 0.9)
            for a, b, k in spans:
                if is_emb(k):
                    grad[a:b] *= f[a:b]
        return merge.outer_step(theta, momentum, grad, spans, algo, merges_done=merges_done)

    systems.outer_update = update


if __name__ == "__main__":
    seed, mode = int(sys.argv[1]), sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    dp = mode.startswith("dp:")      # "dp:MODE": data-parallel (dp_emulated) with the same change
    patch(mode[3:] if dp else mode)
    torch.set_num_threads(1)
    task = load_task("gpt", {})
    algo = replace(AlgoConfig(), **extra)
    run = systems.run_dp_emulated if dp else systems.run_decoupled_emulated
    r = run(task, algo, learners=4, steps=400, seed=seed, eval_points=8)
    print(json.dumps({"seed": seed, "mode": mode, "extra": extra, "loss": r.eval_loss_final,
                      "curve": r.curve, "wall": r.wall_s}), flush=True)
