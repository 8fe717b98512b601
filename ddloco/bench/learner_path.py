"""``ddloco bench learner``: a learner's sync work on one fragment, the passes it made before the
issue "The sync path at the memory limit" (``old``) against the one-pass path it makes now
(``new``), measured in the same process, alternately, in three runs.

Rows, per fragment of ``--numel`` values (two tensors, like the synthetic model's weight and bias):

- ``snapshot`` (training thread): the answered value gathered from the tensors. old: torch's copy;
  new: streaming stores (the snapshot is read again later; its fresh lines need not be read first);
- ``answer`` (network thread): δ = snapshot − base, int4, the wire message (CRC of the payload).
  old: δ into a reused buffer, then encoded; new: quantised as it is subtracted;
- ``receive`` (network thread): a broadcast int4 update decoded and added to the base (the new
  base). old: decoded into a vector, then added; new: added as it is decoded, streaming stores;
- ``apply`` (training thread): the carry θ ← Θ_new + (θ − snapshot) written into the tensors.
  old: θ gathered, the carry on copies, scattered back; new: in place, one pass;
- ``total``: the four, as a learner makes them once per fragment per round.

For each: milliseconds (median of the runs' medians, and the runs' range), ``touched_mb`` (the bytes
the work must read and write at least: its inputs and outputs once) and ``vs_memcpy`` = the time a
memcpy of those bytes takes (a copy of fp32 values measured in this process, scaled to the bytes)
÷ the path's time: 1 = as fast as touching the bytes once (the memcpy writes to one buffer, still
in the caches: a favourable yardstick). The process uses the learner's allocator policy
(``common.lifecycle.tune_allocator``); snapshots and new bases stay alive for ``KEPT`` calls, as in
a learner, the other temporaries are freed at once.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Any, Callable

import torch

from common import quant, wire
from common.fragments import TensorSpec, gather, plan_fragments, scatter
from common.lifecycle import tune_allocator
from common.merge import Contribution, receive_merged
from ddloco.bench.timing import _median_ms, memcpy_ms
from learner.exchange import carry_into
from learner.receipt import Carry

RUNS = 3
CODEC = "int4"
KEPT = 8
"""Outputs kept alive (snapshots, bases): a learner holds one base per fragment and the snapshots
of its answers in flight."""


def _fragment(numel: int) -> tuple[dict[str, torch.Tensor], Any]:
    """A weight and a bias (the bias 1/2048 of the values, as the synthetic model's at 10^8)."""
    bias = max(1, min(2048, numel // 2048))
    specs = [TensorSpec("w", (numel - bias,)), TensorSpec("b", (bias,))]
    g = torch.Generator().manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    return tensors, plan_fragments(specs, 1, align=quant.BLOCK)[0]


def _answer(**payload: Any) -> list[Any]:
    """An answer's wire message; ``payload``: ``values=`` (encoded by wire) or ``encoded=``."""
    return wire.encode(kind=wire.UPDATE, run="bench", sender="b", fragment=0, codec=CODEC, epoch=1, round=1,
                       base=0, steps=12, tokens=12 * 1024, **payload)


def _gather_old(tensors: dict[str, torch.Tensor], frag: Any) -> torch.Tensor:
    """``gather`` as it was: torch's copies (zeros first where the fragment has gaps)."""
    spans = frag.spans
    gaps = sum(b - a for a, b, _ in spans) != frag.numel
    flat = (torch.zeros if gaps else torch.empty)(frag.numel)
    for piece, (a, b, _) in zip(frag.pieces, spans):
        flat[a:b] = tensors[piece.name].detach().reshape(-1)[piece.start:piece.stop]
    return flat


def _kept(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` whose results stay alive for the next ``KEPT`` calls, as a learner keeps its snapshots
    and bases for a round: each call writes to memory that has left the caches."""
    ring: deque[Any] = deque(maxlen=KEPT)
    return lambda: ring.append(fn())


def _paths(numel: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """name -> (old, new, bytes touched at least)."""
    tensors, frag = _fragment(numel)
    n = frag.numel
    g = torch.Generator().manual_seed(1)
    base = gather(tensors, frag)
    snapshot = base + 1e-3 * torch.randn(n, generator=g)
    merged = base + 1e-2 * torch.randn(n, generator=g)
    update = [bytes(f) for f in _answer(values=merged - base)]
    payload = quant.payload_nbytes(n, CODEC)
    delta = torch.empty(n)

    def answer_old() -> Any:
        return _answer(values=torch.sub(snapshot, base, out=delta))

    def answer_new() -> Any:
        return _answer(encoded=(quant.encode_diff(snapshot, base, CODEC), n))

    def receive_old() -> torch.Tensor:
        return base + wire.decode(update).values()

    def receive_new() -> torch.Tensor:
        return wire.decode(update).values_added_to(base)

    contributed = Contribution(snapshot, 12, 12 * 1024)

    def apply_old() -> None:
        value, _, _ = receive_merged(merged, _gather_old(tensors, frag), base, contributed, 14, 14 * 1024, carry=True)
        scatter(tensors, frag, value)

    def apply_new() -> None:
        carry_into(tensors, frag, Carry(merged, snapshot))

    return {"snapshot": (_kept(lambda: _gather_old(tensors, frag)), _kept(lambda: gather(tensors, frag)), 8 * n),
            "answer": (answer_old, answer_new, 8 * n + payload),
            "receive": (_kept(receive_old), _kept(receive_new), payload + 8 * n),
            "apply": (apply_old, apply_new, 16 * n)}


def bench_learner(numel: int, repeats: int) -> list[dict[str, Any]]:
    """The rows of the module docstring (``--numel 4194304``: a fragment of a 10^8-parameter model
    with P = 24)."""
    tune_allocator()
    if quant.encode_diff(torch.zeros(quant.BLOCK), torch.zeros(quant.BLOCK), CODEC) is None:
        raise RuntimeError("bench learner compares the one-pass kernels: common._qkernels is not built with them")
    paths = _paths(numel)
    for old, new, _ in paths.values():   # the kept outputs' memory mapped before anything is timed
        for _ in range(KEPT):
            old()
            new()
    times: dict[tuple[str, str], list[float]] = {}
    copy = []
    for _ in range(RUNS):            # old and new alternate, so drift on a shared machine hits both
        copy.append(memcpy_ms(numel, repeats))
        for name, (old, new, _) in paths.items():
            for impl, fn in (("old", old), ("new", new)):
                times.setdefault((name, impl), []).append(_median_ms(fn, repeats))
    for impl in ("old", "new"):      # the total: every path once
        times[("total", impl)] = [sum(times[(name, impl)][r] for name in paths) for r in range(RUNS)]
    touched = {name: t for name, (_, _, t) in paths.items()}
    touched["total"] = sum(touched.values())
    copy_ms = statistics.median(copy)
    rows = []
    for name, nbytes in touched.items():
        memcpy_equiv = copy_ms * nbytes / (8 * numel)      # a copy of numel fp32 values touches 8·numel bytes
        row: dict[str, Any] = {"path": name, "numel": numel, "touched_mb": round(nbytes / 2**20, 1),
                               "memcpy_ms": memcpy_equiv}
        for impl in ("old", "new"):
            ms = times[(name, impl)]
            row[f"{impl}_ms"] = statistics.median(ms)
            row[f"{impl}_range_ms"] = f"{min(ms):.3g}-{max(ms):.3g}"
            row[f"{impl}_vs_memcpy"] = memcpy_equiv / statistics.median(ms)
        row["speedup"] = row["old_ms"] / row["new_ms"]
        rows.append(row)
    return rows
