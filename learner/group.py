"""A learner that is itself a data-parallel job (torchrun, ``ddloco learner --nproc N``).

    torchrun --nproc-per-node N -m learner --run-id ... --redis-url ... --broker-pub ... --broker-sub ...

The N ranks form one learner of the run: one id, one membership, N× the tokens of a rank per
inner step. Inside the group the model is wrapped in ``DistributedDataParallel`` (gloo on CPU,
NCCL on CUDA: gradients are averaged every step, every rank takes the same AdamW step). Rank 0
is the learner the run sees: it alone talks to Redis, the broker and the shards. The other
ranks never touch the network; what they need crosses the group at step boundaries, on a gloo
group of its own (``Group.boundary``):

- one all-reduce of a small vector: stop (any rank's signal), done (step budget or data of any
  rank), skip (rank 0 waits at the lock-step barrier), the step's tokens summed over ranks,
  rank 0's global token count (the learning-rate schedule must be the same on every rank) and
  which fragments rank 0 changed since the last boundary (merged fragments it applied);
- one broadcast from rank 0 per changed fragment: its flat value, scattered by every rank.

So every rank holds the same parameters before each step; rank 0 answers rounds with them.
"""
from __future__ import annotations

import datetime
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from common.fragments import Fragment, scatter

GROUP_TIMEOUT_S = 1800.0
"""Collective timeout of the group: rank 0's join (fetching every fragment) and flush happen
while the others wait in a collective."""


def group_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process is one rank of a multi-process torchrun
    job (WORLD_SIZE > 1), else None."""
    env = os.environ if env is None else env
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1 or "RANK" not in env:
        return None
    return int(env.get("RANK", "0")), world, int(env.get("LOCAL_RANK", "0"))


def rank_stream(stream: int, rank: int) -> int:
    """Data stream of rank ``rank`` in a group whose rank 0 reads ``stream`` (rank 0 reads the
    stream a single-process learner with that id would read)."""
    if rank == 0:
        return stream
    return zlib.crc32(f"{stream}/{rank}".encode()) % (2**31 - 1)


@dataclass
class Boundary:
    """What the whole group agreed on at one step boundary."""
    stop: bool
    done: bool
    skip: bool
    tokens: int
    run_tokens: float
    changed: list[int]


class Group:
    """This process's place in the group and the group's collectives (``torch.distributed``)."""

    def __init__(self, rank: int, world: int, local_rank: int) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.ctl: Any = None
        self.backend = ""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def start(self, device: torch.device) -> None:
        """Join the process group (NCCL for CUDA models, gloo on the CPU) and make the gloo
        group the boundary collectives run on."""
        import torch.distributed as dist
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=timeout)
        self.ctl = dist.new_group(backend="gloo", timeout=timeout) if self.backend != "gloo" else dist.group.WORLD

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The model as the ranks train it: DistributedDataParallel (its construction makes
        every rank's parameters rank 0's)."""
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index if device.index is not None else self.local_rank] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def share(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (small things: the run config, positions)."""
        import torch.distributed as dist
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    def boundary(self, *, fragments: int, stop: bool, done: bool, skip: bool, tokens: int, run_tokens: float,
                 changed: Iterable[int]) -> Boundary:
        """One all-reduce: every rank's stop / done flags and tokens, rank 0's skip, global token
        count and changed fragments."""
        import torch.distributed as dist
        v = torch.zeros(5 + fragments, dtype=torch.float64)
        v[0], v[1], v[3] = float(stop), float(done), float(tokens)
        if self.leader:
            v[2], v[4] = float(skip), float(run_tokens)
            for p in changed:
                v[5 + p] = 1.0
        dist.all_reduce(v, group=self.ctl)
        x = v.tolist()
        return Boundary(stop=x[0] > 0, done=x[1] > 0, skip=x[2] > 0, tokens=int(x[3]), run_tokens=x[4],
                        changed=[p for p in range(fragments) if x[5 + p] > 0])

    def share_fragments(self, plan: tuple[Fragment, ...], tensors: Mapping[str, torch.Tensor],
                        values: Mapping[int, torch.Tensor], changed: Iterable[int]) -> None:
        """Rank 0's value of each changed fragment (``values[p]``, the flat vector it scattered)
        into every other rank's tensors."""
        import torch.distributed as dist
        for p in changed:
            flat = values[p].contiguous() if self.leader else torch.empty(plan[p].numel, dtype=torch.float32)
            dist.broadcast(flat, src=0, group=self.ctl)
            if not self.leader:
                scatter(tensors, plan[p], flat)


def params_digest(model: torch.nn.Module) -> str:
    """CRC-32 of every parameter's bytes, in order (equal on every rank of a healthy group)."""
    crc = 0
    for t in model.state_dict().values():
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"
