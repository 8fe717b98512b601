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

**Sharded groups (FSDP).** With ``--group-sharding fsdp`` (or ``auto`` on a GPU whose memory
the model's training state would not fit) the model is wrapped in PyTorch's ``fully_shard``
(FSDP2) instead: every layer of an ``nn.ModuleList`` is one unit, the rest the root's; each rank
holds 1/N of the parameters, gradients and AdamW moments. No rank has a whole fragment, so
the boundary has a second phase when rank 0 needs one (to answer a round, or to carry its
unmerged steps over a merge): the all-reduce also names the fragments it needs, every rank
contributes its part of them (``gather_fragments``: one reduce to rank 0 per fragment), rank 0
applies the merges that arrived and takes its answers' snapshots from those values, and the
fragments it changed reach every rank's shard (``share_changed``). After the last step the
group gathers the whole model once (``materialize``) so rank 0 can flush alone.

Ownership: a ``Group`` belongs to the training thread of its rank (every collective is called
there, at the same point of the loop on every rank).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

from common.fragments import Fragment, Piece, scatter

SHARDINGS = ("auto", "ddp", "fsdp")
FSDP_AUTO_FRACTION = 0.7
"""``auto`` shards (FSDP) when parameters, gradients and AdamW moments (16 B per parameter)
would take more than this fraction of one GPU's memory; on a CPU it replicates (DDP)."""

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


def fsdp_available() -> bool:
    """This torch has FSDP2 (``fully_shard``, torch >= 2.6) and DTensor."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_sharding(option: str, device: torch.device, n_params: int) -> str:
    """"ddp" or "fsdp" for ``--group-sharding option`` (``auto``: see FSDP_AUTO_FRACTION; it
    replicates where this torch has no FSDP2, which ``fsdp`` refuses)."""
    if option not in SHARDINGS:
        raise ValueError(f"group sharding must be one of {', '.join(SHARDINGS)}, got {option!r}")
    if option == "fsdp" and not fsdp_available():
        raise ValueError(f"--group-sharding fsdp needs torch >= 2.6 (fully_shard); this is torch {torch.__version__}")
    if option != "auto":
        return option
    if device.type != "cuda" or not fsdp_available():
        return "ddp"
    total = torch.cuda.get_device_properties(device).total_memory
    return "fsdp" if 16 * n_params > FSDP_AUTO_FRACTION * total else "ddp"


def _local_rows(full: torch.Size | tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of dim 0 that rank ``rank`` holds of a tensor FSDP shards over ``world``
    ranks (torch.chunk's split: ceil(rows / world) each, the last ones shorter or empty)."""
    rows = full[0] if len(full) else 1
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def _local_parts(piece: Piece, span_start: int, tensor: torch.Tensor, rank: int,
                 world: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """The part of ``piece`` this rank holds: (slice of the fragment's flat vector, the same
    values as a flat view of this rank's storage). A sharded parameter (DTensor) holds its rows;
    a replicated tensor (a buffer) is counted as rank 0's alone."""
    from torch.distributed.tensor import DTensor
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        lo_row, hi_row = _local_rows(tuple(tensor.shape), rank, world)
        row = piece.tensor.numel // max(tensor.shape[0], 1) if tensor.dim() else 1
        if tuple(local.shape[:1]) != ((hi_row - lo_row),) and tensor.dim():
            raise RuntimeError(f"{piece.name}: this rank holds rows of shape {tuple(local.shape)}, expected "
                               f"rows {lo_row}:{hi_row} of {tuple(tensor.shape)} (not FSDP's dim-0 sharding)")
        lo, hi = lo_row * row, hi_row * row
    else:
        if rank != 0:
            return
        local, lo, hi = tensor, 0, piece.tensor.numel
    a, b = max(lo, piece.start), min(hi, piece.stop)
    if a < b:
        if local.is_contiguous():
            flat = local.detach().view(-1)
        elif isinstance(tensor, DTensor):   # a copy would silently drop what is written into it
            raise RuntimeError(f"{piece.name}: this rank's part is not contiguous")
        else:                               # a buffer: only ever read here
            flat = local.detach().reshape(-1)
        yield slice(span_start + a - piece.start, span_start + b - piece.start), flat[a - lo:b - lo]


@dataclass
class Boundary:
    """What the whole group agreed on at one step boundary."""
    stop: bool
    done: bool
    skip: bool
    tokens: int
    run_tokens: float
    changed: list[int]
    gather: list[int]
    """Fragments rank 0 needs whole this boundary (a sharded group's second phase)."""


class Group:
    """This process's place in the group and the group's collectives (``torch.distributed``)."""

    def __init__(self, rank: int, world: int, local_rank: int) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.ctl: Any = None
        self.backend = ""
        self.sharded = False
        """The model is sharded over the ranks (FSDP); set by ``wrap``."""
        self.shared = 0
        """Fragment values this rank took part in sharing (join and merges; the same on every rank)."""

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

    def wrap(self, model: torch.nn.Module, device: torch.device, sharding: str = "ddp") -> torch.nn.Module:
        """The model as the ranks train it. ``ddp``: DistributedDataParallel (its construction
        makes every rank's parameters rank 0's). ``fsdp``: ``fully_shard`` in place, every layer of
        an ``nn.ModuleList`` a unit of its own, then the root; the parameters become DTensors
        (callers must re-read them). Every rank must hold rank 0's values already."""
        if sharding == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            # the mesh on the learner's device: fully_shard's default mesh is CUDA's wherever a GPU is
            # visible, which moved a gloo group's CPU parameters to cuda:0 (seen on a GPU machine)
            mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
            units = {id(layer) for m in model.modules() if isinstance(m, torch.nn.ModuleList) for layer in m
                     if any(True for _ in layer.parameters())}
            for m in reversed(list(model.modules())):   # inner units first (experts inside blocks)
                if id(m) in units:
                    fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.sharded = True
            return model
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index if device.index is not None else self.local_rank] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, model: torch.nn.Module) -> Any:
        """A context in which backward passes accumulate gradients without averaging them over
        the ranks (all micro-batches but a step's last)."""
        if not self.sharded:
            return model.no_sync()

        @contextlib.contextmanager
        def unsynced() -> Iterator[None]:
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return unsynced()

    def share(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (small things: the run config, positions)."""
        import torch.distributed as dist
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    def boundary(self, *, fragments: int, stop: bool, done: bool, skip: bool, tokens: int, run_tokens: float,
                 changed: Iterable[int], gather: Iterable[int] = ()) -> Boundary:
        """One all-reduce: every rank's stop / done flags and tokens, rank 0's skip, global token
        count, changed fragments and the fragments it needs whole (sharded groups)."""
        import torch.distributed as dist
        n = fragments
        v = torch.zeros(5 + 2 * n, dtype=torch.float64)
        v[0], v[1], v[3] = float(stop), float(done), float(tokens)
        if self.leader:
            v[2], v[4] = float(skip), float(run_tokens)
            for p in changed:
                v[5 + p] = 1.0
            for p in gather:
                v[5 + n + p] = 1.0
        dist.all_reduce(v, group=self.ctl)
        x = v.tolist()
        return Boundary(stop=x[0] > 0, done=x[1] > 0, skip=x[2] > 0, tokens=int(x[3]), run_tokens=x[4],
                        changed=[p for p in range(n) if x[5 + p] > 0],
                        gather=[p for p in range(n) if x[5 + n + p] > 0])

    def gather_fragments(self, plan: tuple[Fragment, ...], tensors: Mapping[str, torch.Tensor],
                         fragments: Iterable[int]) -> dict[int, torch.Tensor]:
        """A sharded group's fragments, whole, on rank 0 (``{p: flat float32 on the CPU}``;
        other ranks get ``{}``): every rank writes the part it holds into a zero vector and one
        reduce (sum) per fragment adds the disjoint parts on rank 0."""
        import torch.distributed as dist
        out: dict[int, torch.Tensor] = {}
        for p in fragments:
            frag = plan[p]
            buf: torch.Tensor | None = None
            for piece, (start, _stop, _) in zip(frag.pieces, frag.spans):
                for where, values in _local_parts(piece, start, tensors[piece.name], self.rank, self.world):
                    if buf is None:
                        buf = torch.zeros(frag.numel, dtype=torch.float32, device=values.device)
                    buf[where] = values.to(torch.float32)
            if buf is None:   # this rank holds none of it (fewer rows than ranks)
                buf = torch.zeros(frag.numel, dtype=torch.float32, device=next(iter(tensors.values())).device)
            dist.reduce(buf, dst=0)
            if self.leader:
                out[p] = buf.cpu()
        return out

    def share_changed(self, plan: tuple[Fragment, ...], tensors: Mapping[str, torch.Tensor],
                      values: Mapping[int, torch.Tensor]) -> list[int]:
        """Rank 0's changed fragments (``values``: p → flat value) into every rank's tensors: one
        broadcast of which fragments, then ``share_fragments``. Returns the fragments shared."""
        import torch.distributed as dist
        flags = torch.zeros(len(plan), dtype=torch.float64)
        if self.leader:
            for p in values:
                flags[p] = 1.0
        dist.broadcast(flags, src=0, group=self.ctl)
        changed = [p for p, f in enumerate(flags.tolist()) if f > 0]
        self.share_fragments(plan, tensors, values, changed)
        return changed

    def materialize(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A sharded model's tensors, whole, on every rank's CPU (by ``state_tensors`` name; a
        collective: every rank calls it at the same point). For after the last step."""
        from torch.distributed.tensor import DTensor

        from common.fragments import state_tensors
        return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu").clone()
                for name, t in state_tensors(model).items()}

    def share_fragments(self, plan: tuple[Fragment, ...], tensors: Mapping[str, torch.Tensor],
                        values: Mapping[int, torch.Tensor], changed: Iterable[int]) -> None:
        """Rank 0's value of each changed fragment (``values[p]``, the flat vector it scattered)
        into every other rank's tensors; in a sharded group into every rank's shard (rank 0's
        included: it scattered nothing itself)."""
        import torch.distributed as dist
        for p in changed:
            flat = values[p].contiguous() if self.leader else torch.empty(plan[p].numel, dtype=torch.float32)
            dist.broadcast(flat, src=0, group=self.ctl)
            self.shared += 1
            if self.sharded:
                self._scatter_local(plan[p], tensors, flat)
            elif not self.leader:
                scatter(tensors, plan[p], flat)

    def _scatter_local(self, frag: Fragment, tensors: Mapping[str, torch.Tensor], flat: torch.Tensor) -> None:
        """The parts of fragment ``frag``'s value ``flat`` that this rank holds, into its shard
        (a replicated buffer whole, on every rank)."""
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            for piece, (start, _stop, _) in zip(frag.pieces, frag.spans):
                t = tensors[piece.name]
                if not isinstance(t, DTensor):
                    single = Fragment(frag.index, (piece,))
                    scatter({piece.name: t}, single, flat[start:start + piece.numel])
                    continue
                for where, target in _local_parts(piece, start, t, self.rank, self.world):
                    target.copy_(flat[where].to(device=target.device, dtype=target.dtype))


def params_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """CRC-32 of every tensor's bytes, in order (equal on every rank of a healthy group)."""
    crc = 0
    for t in tensors.values():
        crc = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"
