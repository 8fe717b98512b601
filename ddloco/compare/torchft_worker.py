"""One replica group of the ``torchft`` system of ``ddloco compare --chaos/--hetero`` (needs the
optional ``torchft`` package, e.g. ``pip install torchft-nightly``)::

    python -m ddloco.compare.torchft_worker --spec spec.json --replica R

torchft's fault-tolerant data parallelism as its users run it: a ``Lighthouse`` (started by the
command) forms a quorum of the live replica groups every step; each group here is one process
(its own TCPStore, torchft's reconfigurable gloo group), the model wrapped in torchft's
``DistributedDataParallel``, AdamW in its ``OptimizerWrapper`` (a step is applied only when the
quorum's all-reduce succeeded: ``should_commit``). A killed group is started again by the command
and recovers live from a peer's state (``load_state_dict`` over torchft's HTTP transport); the
others train on meanwhile with the smaller quorum (``min_replica_size`` 1).

Replica r reads data stream r from where its previous lives stopped (its committed steps). Files
under ``workdir`` as ``elastic_worker`` writes them (pids/, progress/ with ``step LIFE STEP T``
lines, STEP being torchft's global step after a commit; snap/).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from common.config import run_config_from_dict
from common.files import write_atomic
from common.task import bind_task, build_model, count_tokens, scalar_loss
from ddloco.compare.elastic_worker import _Log, _save
from learner.inner import make_inner_optimizer


def _committed_before(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text(errors="replace").splitlines() if line.startswith("step "))


def _manager(r: int, lighthouse: str, load_state_dict: Any, state_dict: Any) -> Any:
    """Replica group r's torchft Manager: its own TCPStore, a reconfigurable gloo group, quorum
    of at least 1 (the others train on while one is down), 10 s collective timeouts."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    return Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=load_state_dict,
                   state_dict=state_dict, min_replica_size=1, replica_id=f"learner-{r}", store_addr="localhost",
                   store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse, port=0,
                   timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
                   connect_timeout=timedelta(seconds=10))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--life", type=int, default=0)
    args = ap.parse_args()
    from torchft import DistributedDataParallel, Optimizer
    spec = json.loads(Path(args.spec).read_text())
    work, r, life = Path(spec["workdir"]), args.replica, args.life
    (work / "pids").mkdir(parents=True, exist_ok=True)
    write_atomic(work / "pids" / f"rank{r}", f"{os.getpid()} {life}\n")
    progress = work / "progress" / f"rank{r}.log"
    position = _committed_before(progress)
    log = _Log(progress, life)
    log.line("start")
    torch.set_num_threads(1)
    task, run = bind_task(run_config_from_dict(spec["run"]))
    algo = run.algo
    steps, seed = int(spec["steps"]), int(spec["seed"])
    model = build_model(task, run.task.seed)
    seen = {"tokens": 0}
    inner, sched = make_inner_optimizer(model.parameters(), algo, tokens=lambda: seen["tokens"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict(), "sched": sched.state_dict(),
                "tokens": seen["tokens"]}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        sched.load_state_dict(sd["sched"])
        seen["tokens"] = int(sd["tokens"])

    manager = _manager(r, spec["lighthouse"], load_state_dict, state_dict)
    net = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    factor = float(spec["factors"][r % len(spec["factors"])])
    noise, floor_s = float(spec.get("noise", 0.0)), float(spec["floor_ms"]) / 1000.0
    gen = torch.Generator().manual_seed(hash((seed, r, life)) & 0x7FFFFFFF)
    snap_every = int(spec["snapshot_every"])
    data = iter(task.batches(r, seed, position))
    (work / "snap").mkdir(exist_ok=True)
    net.train()
    try:
        while manager.current_step() < steps:
            t0 = time.perf_counter()
            opt.zero_grad()                                   # starts the step's quorum
            batch = next(data)
            loss = scalar_loss(task, net, batch)
            loss.backward()
            if algo.inner_grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), algo.inner_grad_clip)
            before = manager.current_step()
            opt.step()                                        # applied only if the quorum's all-reduce held
            target = floor_s * factor * max(0.2, 1.0 + noise * float(torch.randn((), generator=gen)))
            wait = target - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)                              # the emulated accelerator
            if manager.current_step() > before:
                sched.step()
                seen["tokens"] += count_tokens(task, batch) * max(1, manager.num_participants())
                step = manager.current_step()
                log.line("step", step)
                if step % snap_every == 0 or step >= steps:   # every replica: one of them is alive
                    name = f"{r}-{life}-{step}.pt"
                    _save({k: v.detach().clone() for k, v in model.state_dict().items()}, work / "snap" / name)
                    with open(work / "snap" / "index.jsonl", "a") as fh:
                        fh.write(json.dumps({"step": step, "life": life, "t": time.time(), "tokens": seen["tokens"],
                                             "file": name, "replica": r}) + "\n")
            else:                                             # not committed: that batch again
                log.line("drop", before)
                data = iter(task.batches(r, seed, _committed_before(progress)))
        write_atomic(work / f"finished-{r}.json", json.dumps({"step": manager.current_step(), "t": time.time()}))
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
