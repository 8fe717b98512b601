"""Balanced fragmentation of a model's state (ALGORITHM.md §2).

The model's state is its parameters and its persistent buffers (BatchNorm running statistics,
counters). Tensors larger than the ideal fragment size (total elements / P) are cut into
contiguous slices of at most that size, so P fragments of near-equal size exist for any model
with at least P elements; the pieces are then assigned with the LPT greedy rule: sort by size
descending (ties by name, then slice start) and put each into the currently smallest fragment
(ties: lowest index). The plan depends only on tensor names, shapes and kinds, so every process
computes the same plan; ``plan_digest`` lets processes check that.

A fragment's flat float32 vector is the concatenation of its pieces, in (name, start) order,
each starting at a multiple of ``align`` (the quantisation block, so a block never mixes two
tensors: a counter or a BatchNorm variance never sets the scale of a weight's block); the gaps
are zeros. ``Fragment.spans`` gives each piece's ``(start, stop, kind)`` in the flat vector.
Fragment p is owned by syncer shard ``p % shards``.

Kinds: ``param`` (merged with the run's rule, outer optimizer), ``embedding`` (weighted average,
outer optimizer), ``buffer`` (floating-point buffer: token-weighted average of the learners'
values, no outer step) and ``int_buffer`` (integer or bool buffer, e.g. ``num_batches_tracked``:
the largest learner value).
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import torch

from common import hostmem, quant

KINDS = ("param", "embedding", "buffer", "int_buffer")
"""Kinds of tensors in a fragment (see the module docstring)."""
BUFFER_KINDS = ("buffer", "int_buffer")
"""Kinds that are not parameters: no outer optimizer."""


class FragmentationError(ValueError):
    """Impossible fragment plan, or tensors / vectors that do not match a plan."""


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor of the model's state, as far as fragmentation cares."""

    name: str
    """Name, as in ``model.state_dict()``."""
    shape: tuple[int, ...]
    """Tensor shape."""
    kind: str = "param"
    """param, embedding, buffer or int_buffer."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FragmentationError(f"tensor {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def embedding(self) -> bool:
        """Merged by plain weighted averaging, not RDA."""
        return self.kind == "embedding"


@dataclass(frozen=True)
class Piece:
    """A contiguous slice ``[start, stop)`` of a tensor, flattened in row-major order."""

    tensor: TensorSpec
    start: int
    stop: int

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def kind(self) -> str:
        return self.tensor.kind

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.tensor.numel


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class Fragment:
    """One fragment: pieces of tensors, merged and versioned together."""

    index: int
    """Fragment number p in [0, P)."""
    pieces: tuple[Piece, ...]
    """Member pieces, sorted by (name, start): the order of their slices in the flat vector."""
    align: int = 1
    """Every piece starts at a multiple of this in the flat vector."""

    @property
    def spans(self) -> tuple[tuple[int, int, str], ...]:
        """``(start, stop, kind)`` of each piece in the flat vector, in piece order."""
        out: list[tuple[int, int, str]] = []
        offset = 0
        for piece in self.pieces:
            out.append((offset, offset + piece.numel, piece.kind))
            offset = _aligned(offset + piece.numel, self.align)
        return tuple(out)

    @property
    def numel(self) -> int:
        """Length of the fragment's flat vector (alignment gaps included)."""
        spans = self.spans
        return spans[-1][1] if spans else 0

    @property
    def values_numel(self) -> int:
        """Elements of the model's state in this fragment (gaps excluded)."""
        return sum(p.numel for p in self.pieces)

    def describe(self, limit: int = 4) -> str:
        """Its pieces for a person: ``name`` (whole) or ``name[start:stop]`` (a slice), with the
        kind of buffers, the first ``limit`` of them and how many more."""
        names = [(q.name if q.whole else f"{q.name}[{q.start}:{q.stop}]")
                 + (f" ({q.kind})" if q.kind in BUFFER_KINDS else "") for q in self.pieces]
        more = len(names) - limit
        return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """The distinct tensors with a piece in this fragment, in piece order."""
        seen: dict[str, TensorSpec] = {}
        for piece in self.pieces:
            seen.setdefault(piece.name, piece.tensor)
        return tuple(seen.values())


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What fragments carry: every parameter (a tied one once, under its first name) and every
    persistent buffer (those in ``state_dict``), by name."""
    persistent = set(model.state_dict().keys())
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    seen = {id(t) for t in out.values()}
    for name, buf in model.named_buffers():
        if name in persistent and id(buf) not in seen:
            out[name] = buf
            seen.add(id(buf))
    return out


def tensor_specs(model: torch.nn.Module, embedding_names: Collection[str] = ()) -> list[TensorSpec]:
    """Specs of ``state_tensors(model)``; parameters named in ``embedding_names`` are tagged
    embedding, floating-point buffers ``buffer``, other buffers ``int_buffer``."""
    tensors = state_tensors(model)
    params = {name for name, _ in model.named_parameters()}
    unknown = sorted(set(embedding_names) - params)
    if unknown:
        first = {id(p): n for n, p in model.named_parameters()}
        aliases = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if n in unknown}
        if aliases:
            raise FragmentationError("embedding names " + ", ".join(f"{a} (tied to {b}: name {b})"
                                                                    for a, b in aliases.items())
                                     + " are second names of tied parameters")
        raise FragmentationError(f"embedding names not among the model's parameters: {unknown} "
                                 f"(parameters: {sorted(params)[:8]}{' ...' if len(params) > 8 else ''})")
    embedding = set(embedding_names)
    specs = []
    for name, t in tensors.items():
        if name in params:
            kind = "embedding" if name in embedding else "param"
        elif t.is_complex():
            raise FragmentationError(f"buffer {name!r} is complex ({t.dtype}); fragments carry real tensors")
        else:
            kind = "buffer" if t.is_floating_point() else "int_buffer"
        specs.append(TensorSpec(name, tuple(t.shape), kind))
    return specs


def _slices(spec: TensorSpec, limit: float, align: int) -> list[Piece]:
    """``spec`` whole, or cut into contiguous slices of at most ``limit`` elements (multiples of
    ``align`` when ``limit`` allows)."""
    n = spec.numel
    if n <= limit:
        return [Piece(spec, 0, n)]
    size = math.ceil(n / math.ceil(n / limit))
    if size >= align:
        size = size // align * align
    size = max(1, min(size, int(limit)))
    return [Piece(spec, a, min(a + size, n)) for a in range(0, n, size)]


def plan_fragments(specs: Sequence[TensorSpec], n_fragments: int, *, align: int = 1) -> tuple[Fragment, ...]:
    """Split tensors into ``n_fragments`` balanced fragments (slices + LPT greedy, deterministic).

    The result does not depend on the order of ``specs``. Every element lands in exactly one
    fragment; no fragment is empty. Raises ``FragmentationError`` when the model has fewer
    elements than ``n_fragments`` (the message says what P would work).
    """
    if isinstance(n_fragments, bool) or not isinstance(n_fragments, int) or n_fragments < 1:
        raise FragmentationError(f"n_fragments must be an int >= 1, got {n_fragments!r}")
    if align < 1:
        raise FragmentationError(f"align must be >= 1, got {align}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise FragmentationError(f"duplicate tensor names: {duplicates}")
    total = sum(s.numel for s in specs)
    if total < n_fragments:
        raise FragmentationError(
            f"cannot split a model of {total} elements ({len(specs)} tensors) into {n_fragments} fragments; "
            f"use --fragments {max(1, total)} or fewer")
    ideal = total / n_fragments
    pieces = [piece for s in specs if s.numel > 0 for piece in _slices(s, ideal, align)]
    order = sorted(pieces, key=lambda q: (-q.numel, q.name, q.start))
    members: list[list[Piece]] = [[] for _ in range(n_fragments)]
    heap = [(0, p) for p in range(n_fragments)]        # (load, index): smallest load, lowest p
    for piece in order:
        load, p = heapq.heappop(heap)
        members[p].append(piece)
        heapq.heappush(heap, (load + piece.numel, p))
    return tuple(Fragment(index=p, pieces=tuple(sorted(m, key=lambda q: (q.name, q.start))), align=align)
                 for p, m in enumerate(members))


def model_plan(model: torch.nn.Module, embedding_names: Collection[str], n_fragments: int) -> tuple[Fragment, ...]:
    """The run's plan for ``model``: its state split into ``n_fragments``, pieces aligned to the
    quantisation block. Every process of a run (learner, shard, monitor, export) uses this."""
    from common.quant import BLOCK
    return plan_fragments(tensor_specs(model, embedding_names), n_fragments, align=BLOCK)


def plan_digest(fragments: Sequence[Fragment]) -> str:
    """Short stable hash of a plan: names, shapes, kinds, slices, alignment and assignment."""
    layout = [[f.index, f.align, [[q.name, list(q.tensor.shape), q.kind, q.start, q.stop] for q in f.pieces]]
              for f in fragments]
    blob = json.dumps(layout, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def describe_plan_difference(ours: Sequence[Fragment],
                             theirs_layout: Sequence[tuple[str, tuple[int, ...], str]]) -> str:
    """The first tensor (name, shape, kind) where ``ours`` and a ``plan_layout`` differ."""
    mine = plan_layout(ours)
    other = sorted((n, tuple(s), k) for n, s, k in theirs_layout)
    for a, b in zip(mine, other):
        if a[:2] != b[:2]:
            return f"first differing tensor: ours {a[0]} {list(a[1])}, theirs {b[0]} {list(b[1])}"
        if a[2] != b[2]:
            return f"tensor {a[0]} is merged as {a[2]} here and as {b[2]} by the run (embedding_names differ?)"
    if len(mine) != len(other):
        longer, who = (mine, "ours") if len(mine) > len(other) else (other, "theirs")
        extra = longer[min(len(mine), len(other))]
        return f"{who} has an extra tensor {extra[0]} {list(extra[1])} ({len(mine)} vs {len(other)} tensors)"
    return "same tensors; the fragment assignment differs (fragment count or alignment)"


def plan_from_layout(layout: Sequence[tuple[str, Sequence[int], str]], n_fragments: int) -> tuple[Fragment, ...]:
    """The run's plan from its recorded layout (``plan_layout``, kept in Redis), without the model."""
    from common.quant import BLOCK
    return plan_fragments([TensorSpec(n, tuple(s), k) for n, s, k in layout], n_fragments, align=BLOCK)


def plan_layout(fragments: Sequence[Fragment]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor in a plan, sorted (what ``describe_plan_difference`` compares)."""
    return sorted({(q.name, tuple(q.tensor.shape), q.kind) for f in fragments for q in f.pieces})


def _tensor(tensors: Mapping[str, torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    tensor = tensors.get(spec.name)
    if tensor is None:
        raise FragmentationError(f"tensor {spec.name!r} is missing")
    if tuple(tensor.shape) != spec.shape:
        raise FragmentationError(
            f"tensor {spec.name!r} has shape {tuple(tensor.shape)}, plan expects {spec.shape}"
        )
    return tensor


def gather(tensors: Mapping[str, torch.Tensor], fragment: Fragment,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """A new flat float32 vector [fragment.numel] on ``device``: the fragment's pieces in order,
    zero gaps (each value written once: the gaps are zeroed, not the whole vector; large float32
    pieces past the caches, ``quant.copy_into``)."""
    spans = fragment.spans                  # computed once: ``numel`` would compute it again
    numel = spans[-1][1] if spans else 0
    flat = hostmem.empty(numel) if torch.device(device).type == "cpu" else \
        torch.empty(numel, dtype=torch.float32, device=device)
    end = 0
    for piece, (start, stop, _) in zip(fragment.pieces, spans):
        if start > end:                     # an alignment gap before this piece
            flat[end:start].zero_()
        src = _tensor(tensors, piece.tensor).detach().reshape(-1)[piece.start:piece.stop]
        if not quant.copy_into(flat[start:stop], src):
            flat[start:stop] = src.to(device=flat.device, dtype=torch.float32)
        end = stop
    return flat


def scatter(tensors: Mapping[str, torch.Tensor], fragment: Fragment, flat: torch.Tensor) -> None:
    """Copy a flat vector [fragment.numel] back into the fragment's tensors, in place (rounded
    to the nearest integer for integer buffers)."""
    if flat.dim() != 1 or flat.numel() != fragment.numel:
        raise FragmentationError(
            f"fragment {fragment.index} needs a 1-D vector of {fragment.numel} values, "
            f"got shape {tuple(flat.shape)}"
        )
    with torch.no_grad():
        for piece, (start, stop, _) in zip(fragment.pieces, fragment.spans):
            target = _tensor(tensors, piece.tensor)
            values = flat[start:stop]
            if not target.is_floating_point():
                values = values.round()
            values = values.to(device=target.device, dtype=target.dtype)
            if target.is_contiguous():
                target.view(-1)[piece.start:piece.stop].copy_(values)
            else:
                whole = target.reshape(-1).clone()
                whole[piece.start:piece.stop] = values
                target.copy_(whole.view(target.shape))


def owner(fragment_index: int, shards: int) -> int:
    """The syncer shard that owns a fragment: ``p % shards``."""
    if shards < 1:
        raise FragmentationError(f"shards must be >= 1, got {shards}")
    if fragment_index < 0:
        raise FragmentationError(f"fragment index must be >= 0, got {fragment_index}")
    return fragment_index % shards


def owned_fragments(shard: int, shards: int, n_fragments: int) -> list[int]:
    """Fragments owned by ``shard`` out of ``shards``, ascending."""
    if shards < 1:
        raise FragmentationError(f"shards must be >= 1, got {shards}")
    if not 0 <= shard < shards:
        raise FragmentationError(f"shard must be in [0, {shards}), got {shard}")
    if n_fragments < 0:
        raise FragmentationError(f"n_fragments must be >= 0, got {n_fragments}")
    return list(range(shard, n_fragments, shards))


def imbalance(fragments: Sequence[Fragment]) -> float:
    """Largest fragment size over mean fragment size (1.0 is perfect balance)."""
    if not fragments:
        raise FragmentationError("imbalance of an empty plan")
    sizes = [f.numel for f in fragments]
    total = sum(sizes)
    if total == 0:
        return 1.0
    return max(sizes) / (total / len(sizes))
