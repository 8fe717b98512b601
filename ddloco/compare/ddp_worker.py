"""One rank of the data-parallel baseline, launched by torchrun (the real engine):

    python -m torch.distributed.run --standalone --nproc-per-node M \\
        -m ddloco.compare.ddp_worker --spec spec.json --out result.json

Rank r reads data stream r (the stream learner r reads in ``ddloco up``), the model is wrapped
in ``DistributedDataParallel`` (gloo on CPU, NCCL on CUDA), gradients are averaged over ranks
every step, and every rank takes the same inner AdamW step as a learner would. Rank 0
evaluates the model at exact step counts and writes the result.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.config import run_config_from_dict
from common.files import write_atomic
from common.task import batch_to, bind_task, build_model, count_tokens, evaluate, scalar_loss
from ddloco.compare.systems import SystemResult, eval_steps
from learner.inner import inner_step, make_inner_optimizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="JSON: run config, steps, seed, eval points, threads")
    ap.add_argument("--out", required=True, help="rank 0 writes the result JSON here")
    args = ap.parse_args()
    spec = json.loads(open(args.spec).read())
    run = run_config_from_dict(spec["run"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # NCCL wants one GPU per rank; with fewer GPUs than ranks the ranks run on the CPU with gloo
    cuda = (spec.get("device", "auto") != "cpu" and torch.cuda.is_available()
            and torch.cuda.device_count() >= world_size)
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    torch.set_num_threads(int(spec.get("threads", 1)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        task, run = bind_task(run)
        model = build_model(task, run.task.seed).to(device)
        ddp = DistributedDataParallel(model)
        done = {"tokens": 0}                               # the run's global token count (all ranks)
        opt, sched = make_inner_optimizer(ddp.parameters(), run.algo, tokens=lambda: done["tokens"])
        steps, seed = int(spec["steps"]), int(spec["seed"])
        data = iter(task.batches(rank, seed, 0))
        marks = set(eval_steps(steps, int(spec.get("eval_points", 8))))
        t0 = time.perf_counter()
        curve = [(0, evaluate(task, model))] if rank == 0 else []
        tokens_per_step = 0
        ddp.train()
        for t in range(1, steps + 1):
            batch = next(data)
            tokens_per_step = count_tokens(task, batch) * world
            inner_step(ddp, opt, sched, scalar_loss(task, ddp, batch_to(batch, device)), run.algo)
            done["tokens"] += tokens_per_step
            if rank == 0 and t in marks:
                curve.append((tokens_per_step * t, evaluate(task, model)))
        wall = time.perf_counter() - t0
        if rank == 0:
            n = sum(p.numel() for p in model.parameters())
            # ring all-reduce of fp32 gradients: each rank sends and receives 2·(M−1)/M·n·4 bytes a step
            per_step = world * 2 * (world - 1) / world * n * 4
            res = SystemResult("dp", seed, world, steps, tokens_per_step * steps, wall, curve[-1][1], curve,
                               per_step / max(1, tokens_per_step),
                               {"backend": dist.get_backend(), "device": str(device)})
            write_atomic(args.out, json.dumps(res.to_dict()))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
