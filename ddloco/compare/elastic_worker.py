"""One rank of the elastic baselines of ``ddloco compare --chaos/--hetero``, under torchrun's
elastic agent (the real engine a PyTorch user restarts a failed job with)::

    python -m torch.distributed.run --nnodes 1 --nproc-per-node M --max-restarts R \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT -m ddloco.compare.elastic_worker --spec spec.json

Modes (``spec["mode"]``):
- ``dp``: ``DistributedDataParallel`` (gloo on the CPU, NCCL with one GPU per rank): gradients
  averaged every step, every rank the same AdamW step. Rank r reads data stream r.
- ``diloco_sync``: synchronous DiLoCo as a distributed job: every rank trains its own replica;
  every H steps the outer gradients (Θ − θ_r) are all-reduced (mean, fp32), every rank takes the
  same outer Nesterov step (``common.merge.outer_update``) and restarts from Θ.

When a rank dies the agent stops the others and restarts the whole group; every rank then
resumes from the last checkpoint (every ``checkpoint_every`` steps; a sync boundary in
``diloco_sync``), so the steps after it are trained again: what a DDP user does today.

The emulated accelerator (``floor_ms`` × the rank's factor × (1 + noise·N(0, 1))): a step, its
collective included, never takes less, as in ``ddloco learner --step-time-floor-ms``; a fast
rank's wait in the next all-reduce for a slow one counts towards its own step, so the group
steps at the slowest rank's pace as on real hardware. Files under ``workdir`` (read by ``ddloco.compare.chaos``):
- ``pids/rank<r>``: the rank's process id (the failure injector's target);
- ``progress/rank<r>.log``: ``start LIFE T``, ``resume LIFE STEP T``, ``step LIFE STEP T`` and
  (diloco_sync) ``sync LIFE STEP T`` lines, wall-clock seconds;
- ``ckpt/``: ``manifest.json`` (the step the checkpoint holds) and its tensors, written
  atomically after every rank has written its part;
- ``snap/``: the global model every ``snapshot_every`` steps with its time, evaluated after the
  run (off the clock) for the loss-vs-wall-time curve.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.config import run_config_from_dict
from common.files import write_atomic
from common.task import batch_to, bind_task, build_model, count_tokens, scalar_loss
from learner.inner import apply_step, make_inner_optimizer


def _save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class _Log:
    """The rank's progress lines (appended, flushed per line: a SIGKILL loses at most the line
    being written)."""

    def __init__(self, path: Path, life: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a", buffering=1)
        self.life = life

    def line(self, kind: str, *values: Any) -> None:
        self.fh.write(" ".join([kind, str(self.life), *map(str, values), f"{time.time():.4f}"]) + "\n")


def _read_manifest(ckpt: Path) -> dict[str, Any] | None:
    try:
        return json.loads((ckpt / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="JSON: mode, run config, steps, seed, floors, checkpoint interval")
    spec = json.loads(Path(ap.parse_args().spec).read_text())
    work = Path(spec["workdir"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    (work / "pids").mkdir(parents=True, exist_ok=True)
    write_atomic(work / "pids" / f"rank{rank}", f"{os.getpid()} {life}\n")
    log = _Log(work / "progress" / f"rank{rank}.log", life)
    log.line("start")
    torch.set_num_threads(int(spec.get("threads", 1)))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = spec.get("device", "cpu") != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        _train(spec, work, rank, world, life, log, device)
    finally:
        dist.destroy_process_group()
    return 0


def _train(spec: dict[str, Any], work: Path, rank: int, world: int, life: int, log: _Log,
           device: torch.device) -> None:
    from common.fragments import gather, model_plan, scatter, state_tensors
    from common.merge import outer_update
    mode = spec["mode"]
    task, run = bind_task(run_config_from_dict(spec["run"]))
    algo = run.algo
    steps, seed = int(spec["steps"]), int(spec["seed"])
    every, snap_every = int(spec["checkpoint_every"]), int(spec["snapshot_every"])
    H = algo.sync_every_steps
    if mode == "diloco_sync" and every % H:
        every = max(H, every // H * H)             # checkpoints at sync boundaries
    model = build_model(task, run.task.seed).to(device)
    done = {"tokens": 0}
    net: torch.nn.Module = model
    if mode == "dp":
        from torch.nn.parallel import DistributedDataParallel
        net = DistributedDataParallel(model)
    opt, sched = make_inner_optimizer(net.parameters(), algo, tokens=lambda: done["tokens"])
    params = state_tensors(model)
    whole = model_plan(model, task.embedding_names, 1)[0]
    theta = gather(params, whole).cpu()
    momentum = torch.zeros_like(theta)
    syncs = 0
    ckpt, snaps = work / "ckpt", work / "snap"
    ckpt.mkdir(exist_ok=True)
    snaps.mkdir(exist_ok=True)
    start = 0
    manifest = _read_manifest(ckpt)
    if manifest is not None:
        start, done["tokens"], syncs = int(manifest["step"]), int(manifest["tokens"]), int(manifest["syncs"])
        g = torch.load(ckpt / f"global-{start}.pt", weights_only=True)
        mine = torch.load(ckpt / f"rank{rank if mode == 'diloco_sync' else 0}-{start}.pt", weights_only=True)
        model.load_state_dict(g["model"])
        opt.load_state_dict(mine["opt"])
        sched.load_state_dict(mine["sched"])
        if mode == "diloco_sync":
            theta, momentum = g["theta"], g["momentum"]
        log.line("resume", start)
    factor = float(spec["factors"][rank % len(spec["factors"])])
    noise = float(spec.get("noise", 0.0))
    gen = torch.Generator().manual_seed(hash((seed, rank, life)) & 0x7FFFFFFF)
    floor_s = float(spec["floor_ms"]) / 1000.0
    data = iter(task.batches(rank, seed, start))
    net.train()
    for t in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        batch = next(data)
        n_tok = count_tokens(task, batch)
        loss = scalar_loss(task, net, batch_to(batch, device))
        opt.zero_grad(set_to_none=True)
        loss.backward()                             # DDP: the all-reduce, waiting for the slowest rank
        apply_step(net, opt, sched, algo)
        target = floor_s * factor * max(0.2, 1.0 + noise * float(torch.randn((), generator=gen)))
        wait = target - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)                        # the emulated accelerator: a step never takes less
        done["tokens"] += n_tok * world
        log.line("step", t)
        if mode == "diloco_sync" and (t % H == 0 or t == steps):
            outer = theta - gather(params, whole).cpu()
            dist.all_reduce(outer)                  # fp32 ring all-reduce of the whole model's outer gradient
            outer /= world
            theta, momentum = outer_update(theta, momentum, outer.unsqueeze(0), torch.ones(1), whole.spans, algo,
                                           merges_done=syncs, rule="mean")
            syncs += 1
            scatter(params, whole, theta.to(device))
            log.line("sync", t)
        if t % every == 0 and t < steps:
            _checkpoint(ckpt, mode, rank, t, done["tokens"], syncs, model, opt, sched, theta, momentum)
        if rank == 0 and (t % snap_every == 0 or t == steps):
            name = f"{life}-{t}.pt"
            _save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, snaps / name)
            with open(snaps / "index.jsonl", "a") as fh:
                fh.write(json.dumps({"step": t, "life": life, "t": time.time(), "tokens": done["tokens"],
                                     "file": name}) + "\n")
    if rank == 0:
        write_atomic(work / "finished.json", json.dumps({"steps": steps, "tokens": done["tokens"], "syncs": syncs,
                                                         "t": time.time(), "life": life}))
    dist.barrier()


def _checkpoint(ckpt: Path, mode: str, rank: int, t: int, tokens: int, syncs: int, model: torch.nn.Module,
                opt: torch.optim.Optimizer, sched: Any, theta: torch.Tensor, momentum: torch.Tensor) -> None:
    """Every rank its part (diloco_sync: its own inner optimizer; dp: rank 0's, the same on every
    rank), a barrier, then rank 0 the manifest: a rank killed midway leaves the older one."""
    if mode == "diloco_sync" or rank == 0:
        _save({"opt": opt.state_dict(), "sched": sched.state_dict()}, ckpt / f"rank{rank}-{t}.pt")
    if rank == 0:
        g: dict[str, Any] = {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}
        if mode == "diloco_sync":
            g.update(theta=theta, momentum=momentum)
        _save(g, ckpt / f"global-{t}.pt")
    dist.barrier()
    if rank == 0:
        old = _read_manifest(ckpt)
        write_atomic(ckpt / "manifest.json", json.dumps({"step": t, "tokens": tokens, "syncs": syncs}))
        if old is not None:
            for f in ckpt.glob(f"*-{old['step']}.pt"):
                f.unlink(missing_ok=True)


if __name__ == "__main__":
    raise SystemExit(main())
