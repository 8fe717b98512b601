"""Experiment of the third quality sweep (docs/quality/sweep-emulated-3.txt), not part of the product:
AdamW whose denominator is the one a batch M x larger would have seen,
sqrt(m^2 + (v - m^2)/M) instead of sqrt(v). Usage: python docs/quality/madam_experiment.py SEED M dec|dp|single [JSON algo overrides]
Measured at H = 24 (now: add '{"sync_every_steps": 24}') worse than plain AdamW (seeds 0, 1: 2.411 / 2.478
against 2.283 / 2.281)."""
import sys, json, torch
from ddloco.compare import systems
from common.config import AlgoConfig
from dataclasses import replace
from learner import inner
from common.task import load_task

class MAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr, betas, weight_decay, m_learners):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=1e-8))
        self.M = m_learners
    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None: continue
                st = self.state[p]
                if not st:
                    st["step"] = 0; st["exp_avg"] = torch.zeros_like(p); st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1; t = st["step"]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.lerp_(p.grad, 1 - b1); v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                mh = m / (1 - b1 ** t); vh = v / (1 - b2 ** t)
                m2 = mh * mh
                denom = (m2 + (vh - m2).clamp_(min=0) / self.M).sqrt_().add_(g["eps"])
                if g["weight_decay"]: p.mul_(1 - g["lr"] * g["weight_decay"])
                p.addcdiv_(mh, denom, value=-g["lr"])

def make(M):
    def mk(params, algo, tokens=None):
        opt = MAdamW(params, algo.inner_lr, (algo.inner_beta1, algo.inner_beta2), algo.inner_weight_decay, M)
        count = tokens or (lambda: 0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: inner.lr_at(algo, count(), s) / algo.inner_lr)
        return opt, sched
    return mk

if __name__ == "__main__":
    seed, M, system = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    systems.make_inner_optimizer = make(M)
    torch.set_num_threads(1)
    task = load_task("gpt", {})
    algo = replace(AlgoConfig(), **extra)
    if system == "dec":
        r = systems.run_decoupled_emulated(task, algo, learners=4, steps=400, seed=seed, eval_points=8)
    elif system == "dp":
        r = systems.run_dp_emulated(task, algo, learners=4, steps=400, seed=seed, eval_points=8)
    else:
        r = systems.run_single(task, algo, steps=400, seed=seed, eval_points=8)
    print(json.dumps({"seed": seed, "M": M, "system": system, "extra": extra, "loss": r.eval_loss_final,
                      "curve": r.curve, "wall": r.wall_s}), flush=True)
