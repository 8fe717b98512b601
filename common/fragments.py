"""Balanced tensor fragmentation (ALGORITHM.md §2).

The model's parameter tensors are split into P fragments of near-equal size with the LPT
greedy rule: sort tensors by size descending (ties by name ascending) and put each into the
currently smallest fragment (ties: lowest index). The plan depends only on tensor names and
shapes, so every process computes the same plan; ``plan_digest`` lets processes check that.

A fragment's flat vector is the concatenation of its tensors, flattened, in name order;
``Fragment.spans`` gives each tensor's slice of it. Fragment p is owned by syncer shard
``p % shards``.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import torch


class FragmentationError(ValueError):
    """Impossible fragment plan, or parameters / vectors that do not match a plan."""


@dataclass(frozen=True)
class TensorSpec:
    """A named parameter tensor, as far as fragmentation cares."""

    name: str
    """Parameter name, as in ``model.named_parameters()``."""
    shape: tuple[int, ...]
    """Tensor shape."""
    embedding: bool = False
    """Embedding (or tied output head): merged by plain weighted averaging, not RDA."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Fragment:
    """One fragment: a set of whole tensors, merged and versioned together."""

    index: int
    """Fragment number p in [0, P)."""
    tensors: tuple[TensorSpec, ...]
    """Member tensors, sorted by name: the order of their slices in the flat vector."""

    @property
    def numel(self) -> int:
        """Length of the fragment's flat vector."""
        return sum(t.numel for t in self.tensors)

    @property
    def spans(self) -> tuple[tuple[int, int, bool], ...]:
        """``(start, stop, embedding)`` of each tensor in the flat vector, in tensor order."""
        out: list[tuple[int, int, bool]] = []
        start = 0
        for t in self.tensors:
            out.append((start, start + t.numel, t.embedding))
            start += t.numel
        return tuple(out)


def tensor_specs(model: torch.nn.Module, embedding_names: Collection[str] = ()) -> list[TensorSpec]:
    """Specs of ``model.named_parameters()``; names in ``embedding_names`` are tagged embedding.

    A tied parameter appears once, under its first name (as ``named_parameters`` yields it).
    """
    params = list(model.named_parameters())
    known = {name for name, _ in params}
    unknown = sorted(set(embedding_names) - known)
    if unknown:
        raise FragmentationError(f"embedding names not among the model's parameters: {unknown}")
    embedding = set(embedding_names)
    return [TensorSpec(name, tuple(p.shape), name in embedding) for name, p in params]


def plan_fragments(specs: Sequence[TensorSpec], n_fragments: int) -> tuple[Fragment, ...]:
    """Split tensors into ``n_fragments`` balanced fragments (LPT greedy, deterministic).

    The result does not depend on the order of ``specs``. Every tensor lands in exactly one
    fragment. Fewer tensors than fragments (or ``n_fragments < 1``) raises
    ``FragmentationError``.
    """
    if isinstance(n_fragments, bool) or not isinstance(n_fragments, int) or n_fragments < 1:
        raise FragmentationError(f"n_fragments must be an int >= 1, got {n_fragments!r}")
    if n_fragments > len(specs):
        raise FragmentationError(
            f"cannot split {len(specs)} tensors into {n_fragments} fragments "
            "(every fragment needs at least one whole tensor)"
        )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise FragmentationError(f"duplicate tensor names: {duplicates}")

    order = sorted(specs, key=lambda s: (-s.numel, s.name))
    members: list[list[TensorSpec]] = [[] for _ in range(n_fragments)]
    heap = [(0, p) for p in range(n_fragments)]        # (load, index): smallest load, lowest p
    for spec in order:
        load, p = heapq.heappop(heap)
        members[p].append(spec)
        heapq.heappush(heap, (load + spec.numel, p))
    return tuple(
        Fragment(index=p, tensors=tuple(sorted(m, key=lambda s: s.name)))
        for p, m in enumerate(members)
    )


def plan_digest(fragments: Sequence[Fragment]) -> str:
    """Short stable hash of a plan: names, shapes, embedding flags and assignment."""
    layout = [
        [f.index, [[t.name, list(t.shape), t.embedding] for t in f.tensors]] for f in fragments
    ]
    blob = json.dumps(layout, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _param(params: Mapping[str, torch.Tensor], spec: TensorSpec) -> torch.Tensor:
    tensor = params.get(spec.name)
    if tensor is None:
        raise FragmentationError(f"parameter {spec.name!r} is missing")
    if tuple(tensor.shape) != spec.shape:
        raise FragmentationError(
            f"parameter {spec.name!r} has shape {tuple(tensor.shape)}, plan expects {spec.shape}"
        )
    return tensor


def gather(params: Mapping[str, torch.Tensor], fragment: Fragment) -> torch.Tensor:
    """A new flat float32 vector [fragment.numel]: the fragment's tensors, flattened, in order."""
    parts = [_param(params, t).detach().reshape(-1).to(torch.float32) for t in fragment.tensors]
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def scatter(params: Mapping[str, torch.Tensor], fragment: Fragment, flat: torch.Tensor) -> None:
    """Copy a flat vector [fragment.numel] back into the fragment's parameter tensors, in place."""
    if flat.dim() != 1 or flat.numel() != fragment.numel:
        raise FragmentationError(
            f"fragment {fragment.index} needs a 1-D vector of {fragment.numel} values, "
            f"got shape {tuple(flat.shape)}"
        )
    with torch.no_grad():
        for spec, (start, stop, _) in zip(fragment.tensors, fragment.spans):
            target = _param(params, spec)
            target.copy_(flat[start:stop].reshape(spec.shape))


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
