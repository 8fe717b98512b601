"""Merge math of one round (ALGORITHM.md §5). All fp32.

For the M answers of a round of fragment p, with Δ_m = Θ_p − θ_m the outer gradient of
learner m against the syncer's current value::

    w_m = c_tokens² / c_steps            (0 when c_steps = 0);   ŵ = w / Σ w
    Δ   = Σ ŵ_m Δ_m                      embedding tensors
    Δ   = RDA_ŵ(Δ_m)                     every other tensor, per tensor
    b  ← μ·b + Δ;   Θ ← Θ − η·(Δ + μ·b)  (torch.optim.SGD with nesterov=True)

Radial-directional averaging keeps the step size from shrinking as M grows::

    RDA_ŵ(v) = (Σ ŵ_m ‖v_m‖) · unit(Σ ŵ_m unit(v_m)),    unit(0) = 0
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from common import quant
from common.config import MERGE_RULES, AlgoConfig
# re-exported: their home before the split (the learner's receipt; the outer step and downlink)
from common.carry import Contribution, carried, carry_local_steps, carry_local_steps_, receive_merged  # noqa: F401
from common.outer import _span_kind, outer_lr_at, outer_nesterov_step, outer_step, quantized_update  # noqa: F401


def _check_matrix(vectors: torch.Tensor, weights: torch.Tensor) -> None:
    if vectors.dim() != 2:
        raise ValueError(f"vectors must be [M, n], got shape {tuple(vectors.shape)}")
    if weights.dim() != 1 or weights.shape[0] != vectors.shape[0]:
        raise ValueError(
            f"weights must be [M] with M = {vectors.shape[0]}, got shape {tuple(weights.shape)}"
        )
    if vectors.shape[0] == 0:
        raise ValueError("nothing to merge: no contributors (M = 0)")


def _check_spans(spans: Sequence[tuple[int, int, str | bool]], numel: int) -> None:
    expected_start = 0
    for start, stop, _ in spans:
        if start < expected_start or stop < start:
            raise ValueError(f"spans must be in order and disjoint within [0, {numel}), got {list(spans)}")
        expected_start = stop
    if expected_start > numel:
        raise ValueError(f"spans cover {expected_start} values but outer_grads has {numel}")


def contribution_weights(c_tokens: Sequence[float], c_steps: Sequence[float]) -> torch.Tensor:
    """Normalised contribution weights ŵ [M] (float32) of a round's contributors.

    ``w_m = c_tokens² / c_steps`` ("quantity × quality"), 0 where ``c_steps == 0``, divided by
    Σ w. When every w is 0 the result is all zeros and the caller skips the merge.
    """
    if len(c_tokens) != len(c_steps):
        raise ValueError(f"got {len(c_tokens)} token counts but {len(c_steps)} step counts")
    tokens = torch.as_tensor(list(map(float, c_tokens)), dtype=torch.float64)
    steps = torch.as_tensor(list(map(float, c_steps)), dtype=torch.float64)
    for label, counts in (("c_tokens", tokens), ("c_steps", steps)):
        if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
            raise ValueError(f"{label} must be finite and >= 0, got {counts.tolist()}")
    # Counters are integers up to ~1e9 squared: compute in float64, return float32.
    raw = torch.where(steps > 0, tokens.square() / steps.clamp_min(1.0), torch.zeros_like(steps))
    total = raw.sum()
    if total <= 0:
        return torch.zeros(len(c_steps), dtype=torch.float32)
    return (raw / total).to(torch.float32)


def weighted_average(vectors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_m ŵ_m v_m: vectors [M, n], weights [M] -> [n]."""
    _check_matrix(vectors, weights)
    return weights @ vectors                                            # [M] @ [M, n] -> [n]


def radial_directional_average(
    vectors: torch.Tensor, weights: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """RDA: (Σ ŵ_m ‖v_m‖) · unit(Σ ŵ_m unit(v_m)); vectors [M, n], weights [M] -> [n].

    unit(0) = 0. If the mean direction's norm is below ``eps`` times its largest possible value
    Σ ŵ_m (opposite or zero inputs: rescaling it would blow rounding noise up to the full
    radius), the result falls back to the weighted average.
    """
    _check_matrix(vectors, weights)
    norms = torch.linalg.vector_norm(vectors, dim=1)                    # [M]
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    units = vectors / safe.unsqueeze(1)                                 # [M, n], zero rows stay 0
    direction = weights @ units                                         # [n]
    direction_norm = torch.linalg.vector_norm(direction)
    if not bool(direction_norm >= eps * weights.abs().sum()):
        return weighted_average(vectors, weights)
    radius = (weights * norms).sum()
    return direction * (radius / direction_norm)


@dataclass(frozen=True)
class Measured:
    """An answer's first pass (``OuterAccumulator.measure``)."""

    norm: float
    """‖Δ_m‖ over the fragment's parameter pieces (float64 sums)."""
    segment_sq: Any
    """The C kernels' per-segment sums of squares (numpy float64), or None (no kernels)."""


class OuterAccumulator:
    """The merged outer gradient Δ of one fragment, one contributor at a time.

    Memory is O(numel) whatever M (two accumulators: Σ ŵ_m Δ_m and Σ ŵ_m unit(Δ_m) per piece,
    plus a radius per piece), so a shard never stacks M copies of a large fragment. The result
    equals ``merge_outer_gradients`` on the stacked rows to fp32 rounding (sums in another order;
    with the C kernel the norms are summed in double)."""

    def __init__(self, numel: int, spans: Sequence[tuple[int, int, str | bool]], rule: str = "rda",
                 device: torch.device | str | None = None,
                 scratch: tuple[torch.Tensor, torch.Tensor] | None = None, robust_buffers: bool = False,
                 robust_radius: bool = False) -> None:
        """``scratch``: two fp32 buffers of ``numel`` to accumulate in (zeroed here; reusing them
        across merges of a fragment spares fresh memory's page faults). ``result()`` returns the
        first one: use it before the next merge reuses it. ``robust_buffers``: buffers (float and
        integer) take the weighted median of the answers' values, coordinate by coordinate, instead
        of the weighted average (float) and the largest value (integer): a minority of answers
        cannot move a running variance below zero nor a counter to 2^31 (the buffers of each answer
        are kept: M × the fragment's buffers, small beside its parameters). ``robust_radius``: an
        RDA piece's length is the weighted mean of the norms of the answers that moved it (× the
        weight folded in): a free rider's zeros cannot shorten the step (honest answers are
        never zero: for them it is RDA as it is)."""
        if rule not in MERGE_RULES:
            raise ValueError(f"merge rule must be one of {MERGE_RULES}, got {rule!r}")
        _check_spans(spans, numel)
        self.numel = numel
        self.pieces = [(start, stop, _span_kind(kind)) for start, stop, kind in spans]
        self.rda = [kind == "param" and rule == "rda" for _, _, kind in self.pieces]
        ends = [0] + [stop for _, stop, _ in self.pieces]
        self.gaps = [(end, start) for end, (start, _, _) in zip(ends, self.pieces + [(numel, 0, "")]) if start > end]
        """Stretches no piece covers: zero in the result (``add`` sums whole vectors, gaps included)."""
        if scratch is not None and all(b.numel() == numel and b.dtype == torch.float32 for b in scratch):
            self.mean = scratch[0]           # zeroed by the first fold (``_zero_once``)
            self.direction = scratch[1] if any(self.rda) else None
            self._unset = True
        else:
            self.mean = torch.zeros(numel, dtype=torch.float32, device=device)
            self.direction = torch.zeros(numel, dtype=torch.float32, device=device) if any(self.rda) else None
            self._unset = False
        self.radius = [0.0] * len(self.pieces)
        self._robust_radius = robust_radius
        self._piece_norms: list[tuple[float, list[float]]] = []
        self.alignment: float | None = None   # set by result(): _mean_cosine
        """(ŵ_m, the norms of its RDA pieces as folded) of every answer (``robust_radius``)."""
        self.weight_sum = 0.0
        self.count = 0
        self._ints = [(start, stop) for start, stop, kind in self.pieces if kind == "int_buffer"]
        self._floats = [(start, stop) for start, stop, kind in self.pieces if kind == "buffer"]
        self._buffer_pieces = sorted(self._floats + self._ints) if robust_buffers else []
        self._buffer_rows: list[tuple[float, torch.Tensor]] = []
        """(ŵ_m, Δ_m over the buffer pieces) of every answer folded in (``robust_buffers``)."""
        self._bounded = [(start, stop) for start, stop, kind in self.pieces
                         if kind in ("param", "embedding") and stop > start]
        """The parameter pieces: what a norm bound sees and scales (buffers move by their own rule)."""
        # for add_answer's C kernels (common/_qkernels.c): segments tiling [0, numel) as (start, stop, rda),
        # the pieces and the gaps between them, and which segment each RDA piece is
        bounds = sorted([(a, b, on) for (a, b, _), on in zip(self.pieces, self.rda)] +
                        [(a, b, False) for a, b in self.gaps])
        self._segments = np.array([(a, b, int(on)) for a, b, on in bounds if b > a] or np.empty((0, 3)),
                                  dtype=np.int64)
        self._norms = np.zeros(len(self._segments), dtype=np.float64)
        starts = {int(a): k for k, a in enumerate(self._segments[:, 0])} if len(self._segments) else {}
        self._rda_segment = [(i, starts[a]) for i, (a, b, _) in enumerate(self.pieces) if self.rda[i] and b > a]
        self._bounded_segments = np.array([starts[a] for a, _ in self._bounded], dtype=np.int64)

    def bounded_norm(self, x: torch.Tensor) -> float:
        """‖x‖ over the parameter pieces of the fragment (param, embedding), in float64: the norm a
        bound on outer gradients sees. Buffers (BatchNorm statistics, integer counters) are left
        out: a counter's jump of hundreds is no outer gradient."""
        return _pieces_norm(x, self._bounded)

    def float_buffer_norm(self, x: torch.Tensor) -> float:
        """‖x‖ over the floating-point buffer pieces (BatchNorm statistics), in float64."""
        return _pieces_norm(x, self._floats)

    def _scale_params(self, outer: torch.Tensor, scale: float) -> torch.Tensor:
        """Δ_m with its parameter pieces scaled (a clipped answer); buffers and gaps as they are."""
        for a, b in self._bounded:
            outer[a:b].mul_(scale)
        return outer

    def _zero_once(self) -> None:
        """Zero the scratch accumulators before the first fold that adds to them (the round
        kernels' first answer writes them instead: no pass of its own)."""
        if self._unset:
            self.mean.zero_()
            if self.direction is not None:
                self.direction.zero_()
            self._unset = False

    def add(self, outer: torch.Tensor, weight: float) -> None:
        """Fold in one contributor's Δ_m [numel] with normalised weight ŵ_m (Δ_m is only read)."""
        if outer.dim() != 1 or outer.shape[0] != self.numel:
            raise ValueError(f"outer gradient must be [{self.numel}], got shape {tuple(outer.shape)}")
        self._zero_once()
        w = float(weight)
        kept = self._ints_so_far()
        self.mean.add_(outer, alpha=w)          # one pass over the fragment (gaps add zeros)
        rda = [i for i, on in enumerate(self.rda) if on]
        if rda:   # per piece: ‖Δ_m‖ and Δ_m / ‖Δ_m‖, in a few calls over all the pieces at once
            blocks = [outer[self.pieces[i][0]:self.pieces[i][1]] for i in rda]
            norms = torch.stack(torch._foreach_norm(blocks)).tolist()
            for i, block, n in zip(rda, blocks, norms):
                if n > 0:
                    self.direction[self.pieces[i][0]:self.pieces[i][1]].add_(block, alpha=w / n)
                self.radius[i] += w * n
            if self._robust_radius:   # the non-empty pieces, as the kernel path records them
                self._piece_norms.append((w, [n for i, n in zip(rda, norms) if self.pieces[i][1] > self.pieces[i][0]]))
        self._fold_ints(kept, [outer[a:b] for a, b in self._ints])
        self._keep_buffers(w, [outer[a:b] for a, b in self._buffer_pieces])
        self.weight_sum += abs(w)
        self.count += 1

    def _keep_buffers(self, w: float, blocks: list[torch.Tensor]) -> None:
        if blocks:
            self._buffer_rows.append((w, torch.cat(blocks).to(torch.float64)))

    def _ints_so_far(self) -> list[torch.Tensor]:
        """The integer-buffer pieces of the mean before a contributor is added (none for the first)."""
        return [self.mean[a:b].clone() for a, b in self._ints] if self._ints and self.count else []

    def _fold_ints(self, kept: list[torch.Tensor], blocks: list[torch.Tensor]) -> None:
        """Integer buffers: the smallest Δ_m (Θ − Δ is the largest learner value)."""
        for (a, b), old, block in zip(self._ints, kept or [None] * len(self._ints), blocks):
            self.mean[a:b] = block if old is None else torch.minimum(old, block)

    def add_answer(self, theta: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, weight: float,
                   clip: Callable[[float], float] | None = None, buf: torch.Tensor | None = None,
                   buffer_ceiling: float | None = None) -> float:
        """Fold in the answer δ_m built on ``base``: Δ_m = Θ − (base + δ_m), scaled by
        ``clip(‖Δ_m‖)`` (e.g. ``NormClipper.observe``; None: 1; 0: the answer is left out, not
        counted). ``clip`` sees the norm of the parameter pieces only and scales only them:
        buffers always move by their own rule; an answer whose float buffers move by more than
        ``buffer_ceiling`` (norm) is left out (returns 0: a 1e30 running variance is no statistic).
        Returns that scale. ``measure`` then ``fold``: with the C kernels (fp32 on CPU) Δ_m is
        never stored (two passes over the inputs); otherwise it is built in ``buf`` (a scratch
        [numel] buffer, or a new one)."""
        if buffer_ceiling is not None and self._floats and not self.buffers_within(theta, base, delta, buffer_ceiling):
            return 0.0
        measured = self.measure(theta, base, delta, buf=buf)
        scale = clip(measured.norm) if clip is not None else 1.0
        if scale != 0.0:
            self.fold(theta, base, delta, weight, scale, measured, buf=buf)
        return scale

    def _kernel_inputs(self, theta: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> bool:
        return quant._kernels is not None and all(t.device.type == "cpu" and t.dtype == torch.float32
                                                  and t.is_contiguous() for t in (theta, base, delta, self.mean))

    def measure(self, theta: torch.Tensor, base: torch.Tensor, delta: torch.Tensor,
                buf: torch.Tensor | None = None) -> "Measured":
        """First pass over an answer: ‖Δ_m‖ over the parameter pieces (what a bound sees), and
        what ``fold`` reuses (the C kernels' per-segment sums of squares)."""
        if self._kernel_inputs(theta, base, delta):
            sq = np.zeros(len(self._segments), dtype=np.float64)
            quant._kernels.outer_sq_sums(*(t.detach().numpy() for t in (theta, base, delta)), self._segments, sq)
            return Measured(math.sqrt(float(sq[self._bounded_segments].sum())), sq)
        outer = torch.add(base, delta, out=buf) if buf is not None else base + delta
        return Measured(self.bounded_norm(torch.sub(theta, outer, out=outer)), None)

    def fold(self, theta: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, weight: float, scale: float,
             measured: "Measured", buf: torch.Tensor | None = None) -> None:
        """Second pass: fold Δ_m = Θ − (base + δ_m), its parameter pieces scaled by ``scale``, in
        with weight ŵ_m (``measured``: what ``measure`` returned for the same inputs)."""
        self._zero_once()
        w = float(weight)
        if measured.segment_sq is None or not self._kernel_inputs(theta, base, delta):
            outer = torch.add(base, delta, out=buf) if buf is not None else base + delta
            outer = torch.sub(theta, outer, out=outer)
            self.add(outer if scale == 1.0 else self._scale_params(outer, scale), w)
            return
        th, ba, de = (t.detach().numpy() for t in (theta, base, delta))
        kept = self._ints_so_far()
        np.sqrt(measured.segment_sq, out=self._norms)   # the pieces' norms before scaling: the unit
        quant._kernels.accumulate_outer(th, ba, de, scale, w, self.mean.numpy(),   # vectors do not see it
                                        None if self.direction is None else self.direction.numpy(),
                                        self._segments, self._norms)
        for i, k in self._rda_segment:
            self.radius[i] += w * scale * float(self._norms[k])
        if self._robust_radius and self._rda_segment:
            self._piece_norms.append((w, [scale * float(self._norms[k]) for _, k in self._rda_segment]))
        if scale != 1.0:   # the kernel scaled every piece: float buffers take their whole Δ_m back
            for a, b in self._floats:
                self.mean[a:b].add_(theta[a:b] - (base[a:b] + delta[a:b]), alpha=w * (1.0 - scale))
        self._fold_ints(kept, [theta[a:b] - (base[a:b] + delta[a:b]) for a, b in self._ints])
        self._keep_buffers(w, [theta[a:b] - (base[a:b] + delta[a:b]) for a, b in self._buffer_pieces])
        self.weight_sum += abs(w)
        self.count += 1

    def round_kernels(self, theta: torch.Tensor, answers: Sequence[tuple[torch.Tensor, Any]]) -> bool:
        """Whether ``measure_round`` / ``fold_round`` serve this round: the C kernels built, fp32
        CPU tensors (Θ, the accumulators, each base and fp32 δ) and every buffer piece merged by
        the weighted median (``robust_buffers``: nothing of a buffer piece is read from the
        accumulators, so they need no answer-by-answer step)."""
        if quant._kernels is None or len(self._buffer_pieces) != len(self._floats) + len(self._ints):
            return False
        tensors = [theta, self.mean] + [b for b, _ in answers] + \
            [d for _, d in answers if not isinstance(d, quant.EncodedVector)]
        return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float32
                   and t.is_contiguous() and t.numel() == self.numel for t in tensors)

    def _round_inputs(self, answers: Sequence[tuple[torch.Tensor, Any]]) -> list[tuple[Any, ...]]:
        return [(b.numpy(), *d.kernel_args()) if isinstance(d, quant.EncodedVector) else (b.numpy(), d.numpy())
                for b, d in answers]

    def measure_round(self, theta: torch.Tensor, answers: Sequence[tuple[torch.Tensor, Any]]) -> list["Measured"]:
        """``measure`` of every (base, δ) of a round in one call, tile by tile (``round_kernels``):
        Θ stays in cache while the answers pass; an encoded δ is decoded a tile at a time."""
        sums = np.zeros((len(answers), len(self._segments)), dtype=np.float64)
        quant._kernels.round_sq_sums(theta.numpy(), self._round_inputs(answers), self._segments, sums)
        return [Measured(math.sqrt(float(row[self._bounded_segments].sum())), row) for row in sums]

    def fold_round(self, theta: torch.Tensor, folds: Sequence[tuple[torch.Tensor, Any, float, float, "Measured"]]) -> None:
        """``fold`` of every (base, δ, ŵ, scale, measured) of a round, in order, in one call (the
        same values as folding them one by one: ``round_kernels`` must hold)."""
        if not folds:
            return
        norms = np.sqrt(np.stack([m.segment_sq for *_, m in folds]))
        scale_weight = np.array([(float(sc), float(w)) for _, _, w, sc, _ in folds], dtype=np.float64)
        quant._kernels.round_accumulate(theta.numpy(), self._round_inputs([(b, d) for b, d, *_ in folds]),
                                        scale_weight, self.mean.numpy(),
                                        None if self.direction is None else self.direction.numpy(),
                                        self._segments, norms, self._unset)
        self._unset = False
        for (base, delta, w, scale, _), row in zip(folds, norms):
            w = float(w)
            for i, k in self._rda_segment:
                self.radius[i] += w * scale * float(row[k])
            if self._robust_radius and self._rda_segment:
                self._piece_norms.append((w, [scale * float(row[k]) for _, k in self._rda_segment]))
            self._keep_buffers(w, [theta[a:b] - (base[a:b] + delta[a:b]) for a, b in self._buffer_pieces])
            self.weight_sum += abs(w)
            self.count += 1

    def buffers_within(self, theta: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, ceiling: float) -> bool:
        """The answer's float-buffer pieces of Δ_m = Θ − (base + δ_m) are finite and within ``ceiling``."""
        sq = 0.0
        for a, b in self._floats:
            n = float(torch.linalg.vector_norm(theta[a:b] - (base[a:b] + delta[a:b]), dtype=torch.float64))
            sq += n * n
        return math.isfinite(sq) and math.sqrt(sq) <= ceiling

    def result(self, eps: float = 1e-6) -> torch.Tensor:
        """Δ [numel]: RDA for param pieces (rule "rda"; the weighted average when the mean
        direction nearly cancels, as ``radial_directional_average``), the weighted average
        for the others, the minimum for integer buffers; gaps zero."""
        if self.count == 0:
            raise ValueError("nothing to merge: no contributors (M = 0)")
        merged = self.mean
        for start, stop in self.gaps:
            merged[start:stop] = 0.0
        if self._buffer_rows:
            median = weighted_median_rows(torch.stack([row for _, row in self._buffer_rows]),
                                          torch.tensor([w for w, _ in self._buffer_rows], dtype=torch.float64))
            at = 0
            for a, b in self._buffer_pieces:
                merged[a:b] = median[at:at + b - a].to(merged.dtype)
                at += b - a
        if self._piece_norms:   # the weighted mean of the answers' non-zero norms, per RDA piece
            rows = torch.tensor([n for _, n in self._piece_norms], dtype=torch.float64)            # [M, rda pieces]
            w = torch.tensor([w for w, _ in self._piece_norms], dtype=torch.float64).unsqueeze(1)  # [M, 1]
            moved = (rows > 0).to(torch.float64) * w
            lengths = (moved * rows).sum(0) / moved.sum(0).clamp_min(1e-300)
            for i, length in zip([i for i, on in enumerate(self.rda) if on and self.pieces[i][1] > self.pieces[i][0]],
                                 lengths.tolist()):
                self.radius[i] = length * self.weight_sum
        self.alignment = None
        aligned: list[tuple[float, float]] = []   # (piece length, its answers' weighted mean pairwise cosine)
        for i, (start, stop, _) in enumerate(self.pieces):
            if not self.rda[i]:
                continue
            direction = self.direction[start:stop]
            direction_norm = float(torch.linalg.vector_norm(direction))
            cosine = self._mean_cosine(direction_norm, len(aligned))
            if cosine is not None:
                aligned.append((float(stop - start), cosine))
            if direction_norm >= eps * self.weight_sum and direction_norm > 0:
                torch.mul(direction, self.radius[i] / direction_norm, out=merged[start:stop])
        if aligned:
            self.alignment = sum(n * c for n, c in aligned) / sum(n for n, _ in aligned)
        return merged

    def _mean_cosine(self, direction_norm: float, k: int) -> float | None:
        """The weighted mean pairwise cosine of the answers' outer gradients on RDA piece ``k``
        (of those with a norm there), read off the direction accumulator d = Σ w_m u_m (unit
        vectors u_m): ‖d‖² = Σ w_m² + Σ_{m≠n} w_m w_n cos_mn. None with fewer than two answers or
        without ``robust_radius`` (no per-answer norms kept): a figure for the dashboard, no pass."""
        if not self._robust_radius or len(self._piece_norms) < 2:
            return None
        ws = [w for w, norms in self._piece_norms if k < len(norms) and norms[k] > 0]
        w1, w2 = sum(ws), sum(w * w for w in ws)
        if len(ws) < 2 or w1 * w1 - w2 <= 0:
            return None
        return max(-1.0, min(1.0, (direction_norm ** 2 - w2) / (w1 * w1 - w2)))

    def answer_norms(self) -> list[float]:
        """Each folded answer's outer-gradient norm over the RDA pieces, after its clip (in order)."""
        return [math.sqrt(sum(n * n for n in norms)) for _, norms in self._piece_norms]


def weighted_median_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise lower weighted median of ``rows`` [M, n] with ``weights`` [M] -> [n]: at
    each coordinate, the smallest value at which the weight of the values at or below it reaches
    half the total (one of the rows' values: an integer counter stays an integer)."""
    values, order = rows.sort(dim=0)                                     # [M, n]
    cum = weights[order].cumsum(dim=0)                                   # [M, n]
    first = (cum >= 0.5 * weights.sum()).to(torch.int8).argmax(dim=0)   # [n]
    return values.gather(0, first.unsqueeze(0)).squeeze(0)


def _pieces_norm(x: torch.Tensor, pieces: Sequence[tuple[int, int]]) -> float:
    """‖x‖ over ``pieces`` ([start, stop) ranges), in float64 (1e38s: no overflow)."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(x[a:b], dtype=torch.float64)) ** 2 for a, b in pieces))


def merge_outer_gradients(
    outer_grads: torch.Tensor,
    weights: torch.Tensor,
    spans: Sequence[tuple[int, int, str | bool]],
    rule: str = "rda",
) -> torch.Tensor:
    """Merged outer gradient Δ [numel] of one fragment.

    ``outer_grads`` [M, numel] holds one Δ_m per row; ``weights`` [M] are normalised;
    ``spans`` is ``Fragment.spans``: each piece's ``(start, stop, kind)``, in order, with zero
    gaps between them allowed. ``param`` pieces use ``rule``: "rda" (radial-directional
    average) or "mean" (weighted average), each piece separately; ``embedding`` and ``buffer``
    pieces the weighted average; ``int_buffer`` pieces the smallest Δ_m (so that Θ − Δ is the
    largest learner value). Gaps stay zero. (``OuterAccumulator``: the same, row by row.)
    """
    if rule not in MERGE_RULES:
        raise ValueError(f"merge rule must be one of {MERGE_RULES}, got {rule!r}")
    _check_matrix(outer_grads, weights)
    numel = outer_grads.shape[1]
    _check_spans(spans, numel)
    merged = torch.zeros(numel, dtype=torch.float32, device=outer_grads.device)
    for start, stop, kind in spans:
        block = outer_grads[:, start:stop]                              # [M, stop - start]
        kind = _span_kind(kind)
        if kind == "int_buffer":
            merged[start:stop] = block.min(dim=0).values
            continue
        combine = radial_directional_average if kind == "param" and rule == "rda" else weighted_average
        merged[start:stop] = combine(block, weights)
    return merged


def outer_update(theta: torch.Tensor, momentum: torch.Tensor, outer_grads: torch.Tensor, weights: torch.Tensor,
                 spans: Sequence[tuple[int, int, str | bool]], algo: AlgoConfig, *, merges_done: int = 0,
                 rule: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One round of fragment p (ALGORITHM §5) on copies: merge the outer gradients
    [M, numel] with ``weights`` (``rule``, default ``algo.merge_rule``) and take the run's outer
    step (η warmed up over ``algo.outer_warmup_merges``, μ, Nesterov or not). Returns
    (Θ_new, b_new); the inputs are left unchanged so a caller can still drop the result."""
    grad = merge_outer_gradients(outer_grads, weights, spans, rule or algo.merge_rule)    # [numel]
    return outer_step(theta, momentum, grad, spans, algo, merges_done=merges_done)
