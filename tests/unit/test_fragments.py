"""Balanced tensor fragmentation: deterministic LPT plans, gather/scatter, shard ownership."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from common.fragments import (
    Fragment,
    FragmentationError,
    Piece,
    TensorSpec,
    model_plan,
    state_tensors,
    gather,
    imbalance,
    owned_fragments,
    owner,
    plan_digest,
    plan_fragments,
    scatter,
    tensor_specs,
)


def _specs(sizes: dict[str, int]) -> list[TensorSpec]:
    return [TensorSpec(name, (n,)) for name, n in sizes.items()]


def _whole(*specs: TensorSpec) -> tuple[Piece, ...]:
    return tuple(Piece(s, 0, s.numel) for s in specs)


def _assignment(fragments: tuple[Fragment, ...]) -> list[list[str]]:
    return [[t.name for t in f.tensors] for f in fragments]


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin1 = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.lin2 = nn.Linear(7, 3, bias=False)
        self.scale = nn.Parameter(torch.ones(()))


def test_tensor_spec_numel_and_fragment_spans() -> None:
    a, b, c = TensorSpec("a", (2, 3)), TensorSpec("b", ()), TensorSpec("c", (4,), "embedding")
    assert (a.numel, b.numel, c.numel) == (6, 1, 4)
    frag = Fragment(index=0, pieces=_whole(a, b, c))
    assert frag.numel == 11
    assert frag.spans == ((0, 6, "param"), (6, 7, "param"), (7, 11, "embedding"))
    aligned = Fragment(index=0, pieces=_whole(a, b, c), align=4)   # every piece starts on a block
    assert aligned.spans == ((0, 6, "param"), (8, 9, "param"), (12, 16, "embedding"))
    assert (aligned.numel, aligned.values_numel) == (16, 11)


def test_tensor_specs_tag_embeddings_and_reject_unknown_names() -> None:
    model = _Toy()
    specs = {s.name: s for s in tensor_specs(model, {"emb.weight"})}
    assert set(specs) == {n for n, _ in model.named_parameters()}
    assert specs["emb.weight"] == TensorSpec("emb.weight", (11, 6), "embedding")
    assert specs["scale"].shape == () and not specs["scale"].embedding
    with pytest.raises(FragmentationError, match="head.weight"):
        tensor_specs(model, {"emb.weight", "head.weight"})


def test_plan_is_deterministic_and_ignores_input_order() -> None:
    rng = random.Random(0)
    specs = [TensorSpec(f"t{i:02d}", (rng.choice([1, 7, 64, 100, 100, 333]),)) for i in range(40)]
    reference = plan_fragments(specs, 6)
    assert plan_fragments(specs, 6) == reference
    for seed in range(5):
        shuffled = list(specs)
        random.Random(seed).shuffle(shuffled)
        plan = plan_fragments(shuffled, 6)
        assert plan == reference
        assert plan_digest(plan) == plan_digest(reference)


def test_every_tensor_lands_in_exactly_one_fragment_sorted_by_name() -> None:
    specs = [TensorSpec(f"w{i}", (i % 9 + 1, 3)) for i in range(30)]
    plan = plan_fragments(specs, 7)
    assert [f.index for f in plan] == list(range(7))
    names = [q.name for f in plan for q in f.pieces]
    assert sorted(set(names)) == sorted(s.name for s in specs)
    for spec in specs:   # the pieces of a tensor tile it exactly once
        covered = sorted((q.start, q.stop) for f in plan for q in f.pieces if q.name == spec.name)
        assert covered[0][0] == 0 and covered[-1][1] == spec.numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for f in plan:
        assert [(q.name, q.start) for q in f.pieces] == sorted((q.name, q.start) for q in f.pieces)


def test_lpt_places_largest_first_into_the_smallest_fragment() -> None:
    # 7,6,5,4,3 into 2 bins: 7->0, 6->1, 5->1 (6 < 7), 4->0 (7 < 11), 3->0 (11 = 11: lowest).
    plan = plan_fragments(_specs({"a": 7, "b": 6, "c": 5, "d": 4, "e": 3}), 2)
    assert _assignment(plan) == [["a", "d", "e"], ["b", "c"]]
    assert [f.numel for f in plan] == [14, 11]


def test_lpt_matches_the_optimum_on_hand_cases() -> None:
    # 8,7,6,5,4 into 3 bins: 8 | 7 | 6, then 5 -> the 6 (11), 4 -> the 7 (11). Optimum is 11.
    plan = plan_fragments(_specs({"a": 8, "b": 7, "c": 6, "d": 5, "e": 4}), 3)
    assert [f.numel for f in plan] == [8, 11, 11]
    # Equal sizes spread evenly, ties broken by name then by lowest fragment index.
    plan = plan_fragments(_specs({f"x{i}": 10 for i in range(6)}), 3)
    assert _assignment(plan) == [["x0", "x3"], ["x1", "x4"], ["x2", "x5"]]
    assert imbalance(plan) == 1.0


def test_lpt_classic_worst_case_stays_within_four_thirds_of_optimum() -> None:
    # Graham's tight example for 2 machines: 3,3,2,2,2 -> LPT 7 vs optimum 6.
    plan = plan_fragments(_specs({"a": 3, "b": 3, "c": 2, "d": 2, "e": 2}), 2)
    assert max(f.numel for f in plan) == 7
    assert max(f.numel for f in plan) <= 4 / 3 * 6


def test_single_fragment_holds_everything() -> None:
    specs = _specs({"b": 2, "a": 5})
    (only,) = plan_fragments(specs, 1)
    assert [t.name for t in only.tensors] == ["a", "b"] and only.numel == 7


def test_too_many_fragments_raise_a_clear_error() -> None:
    specs = _specs({f"t{i}": 2 for i in range(10)})
    with pytest.raises(FragmentationError, match=r"model of 20 elements \(10 tensors\) into 24 fragments; "
                                                 r"use --fragments 20 or fewer"):
        plan_fragments(specs, 24)
    with pytest.raises(FragmentationError, match=">= 1"):
        plan_fragments(specs, 0)


def test_duplicate_names_raise() -> None:
    with pytest.raises(FragmentationError, match="duplicate"):
        plan_fragments([TensorSpec("a", (1,)), TensorSpec("a", (2,))], 1)


def test_plan_digest_changes_with_layout() -> None:
    specs = _specs({"a": 5, "b": 4, "c": 3})
    base = plan_digest(plan_fragments(specs, 2))
    assert isinstance(base, str) and len(base) >= 8
    assert plan_digest(plan_fragments(specs, 3)) != base
    assert plan_digest(plan_fragments(_specs({"a": 5, "b": 4, "c": 2}), 2)) != base
    tagged = [TensorSpec("a", (5,), "embedding")] + specs[1:]
    assert plan_digest(plan_fragments(tagged, 2)) != base


def test_gather_scatter_round_trip_on_a_module() -> None:
    torch.manual_seed(0)
    model = _Toy()
    params = dict(model.named_parameters())
    plan = plan_fragments(tensor_specs(model, {"emb.weight"}), 3)
    original = {n: p.detach().clone() for n, p in params.items()}

    flats = [gather(params, f) for f in plan]
    for f, flat in zip(plan, flats):
        assert flat.dtype == torch.float32 and flat.shape == (f.numel,)
        for piece, (start, stop, kind) in zip(f.pieces, f.spans):
            assert torch.equal(flat[start:stop], original[piece.name].reshape(-1)[piece.start:piece.stop])
            assert kind == piece.kind

    flats[0].add_(1.0)                      # a copy: the model is untouched
    assert all(torch.equal(p, original[n]) for n, p in params.items())

    for f, flat in zip(plan, flats):
        scatter(params, f, flat)
    for n, p in params.items():
        expected = original[n].clone().reshape(-1)
        for q in plan[0].pieces:
            if q.name == n:
                expected[q.start:q.stop] += 1.0
        assert torch.equal(p.detach(), expected.view(original[n].shape)), n
        assert p.requires_grad


def test_scatter_rejects_a_vector_of_the_wrong_length() -> None:
    model = _Toy()
    params = dict(model.named_parameters())
    (frag,) = plan_fragments(tensor_specs(model), 1)
    with pytest.raises(FragmentationError, match=f"{frag.numel} values"):
        scatter(params, frag, torch.zeros(frag.numel + 1))


def test_gather_rejects_missing_or_reshaped_parameters() -> None:
    frag = Fragment(index=0, pieces=_whole(TensorSpec("w", (2, 3))))
    with pytest.raises(FragmentationError, match="missing"):
        gather({}, frag)
    with pytest.raises(FragmentationError, match="shape"):
        gather({"w": torch.zeros(3, 2)}, frag)


def test_gather_zeroes_the_alignment_gaps_of_fresh_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vector is allocated without zeroing it (one pass, not two); its gaps are zeroed."""
    (frag,) = plan_fragments(_specs({"a": 70, "b": 5, "c": 130}), 1, align=64)
    assert [s[:2] for s in frag.spans] == [(0, 70), (128, 133), (192, 322)]
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))   # memory as found
    tensors = {n: torch.arange(float(k), dtype=torch.float32) + 1 for n, k in (("a", 70), ("b", 5), ("c", 130))}
    flat = gather(tensors, frag)
    assert torch.equal(flat[70:128], torch.zeros(58)) and torch.equal(flat[133:192], torch.zeros(59))
    assert torch.equal(flat[128:133], tensors["b"]) and torch.equal(flat[192:], tensors["c"])


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 24, 30])
def test_owned_fragments_partition_all_fragments(shards: int) -> None:
    n = 24
    owned = [owned_fragments(s, shards, n) for s in range(shards)]
    flat = sorted(p for ps in owned for p in ps)
    assert flat == list(range(n))
    for s, ps in enumerate(owned):
        assert all(owner(p, shards) == s for p in ps)
    assert max(map(len, owned)) - min(map(len, owned)) <= 1


def test_owner_rejects_bad_arguments() -> None:
    with pytest.raises(FragmentationError):
        owner(3, 0)
    with pytest.raises(FragmentationError):
        owned_fragments(2, 2, 24)


def test_imbalance_is_largest_over_mean() -> None:
    plan = plan_fragments(_specs({"a": 6, "b": 3, "c": 3}), 2)
    assert [f.numel for f in plan] == [6, 6]
    assert imbalance(plan) == 1.0
    plan = plan_fragments(_specs({"a": 9, "b": 1, "c": 2}), 2)   # "a" > 12/2 is cut in two slices
    assert imbalance(plan) == 1.0 and [[(q.name, q.start, q.stop) for q in f.pieces] for f in plan] == [
        [("a", 0, 5), ("b", 0, 1)], [("a", 5, 9), ("c", 0, 2)]]


def test_builtin_model_is_balanced_into_24_fragments() -> None:
    from common.task import build_model, load_task

    task = load_task("gpt")
    model = build_model(task, 0)
    specs = tensor_specs(model, task.embedding_names)
    frags = model_plan(model, task.embedding_names, 24)
    assert sorted({t.name for f in frags for t in f.tensors}) == sorted(s.name for s in specs)
    assert imbalance(frags) <= 4 / 3, [f.numel for f in frags]


class _FiveTensorsWithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)       # weight, bias
        self.bn = nn.BatchNorm2d(4)          # weight, bias; running_mean, running_var, num_batches_tracked
        self.head = nn.Linear(4, 10, bias=False)


def test_a_model_with_fewer_tensors_than_fragments_is_sliced_into_balanced_fragments() -> None:
    model = _FiveTensorsWithBatchNorm()
    assert len(list(model.parameters())) == 5
    plan = model_plan(model, (), 24)
    assert len(plan) == 24 and all(f.pieces for f in plan)
    sizes = [f.values_numel for f in plan]
    assert sum(sizes) == sum(t.numel() for t in state_tensors(model).values())
    assert max(sizes) <= 2 * sum(sizes) / 24, sizes
    for f in plan:   # every piece starts on a quantisation block: no block mixes two tensors
        assert all(start % 64 == 0 for start, _, _ in f.spans)


def test_buffers_travel_with_their_kind_and_integer_buffers_are_rounded_back() -> None:
    model = _FiveTensorsWithBatchNorm()
    kinds = {s.name: s.kind for s in tensor_specs(model)}
    assert kinds["bn.running_mean"] == kinds["bn.running_var"] == "buffer"
    assert kinds["bn.num_batches_tracked"] == "int_buffer" and kinds["conv.weight"] == "param"
    tensors = state_tensors(model)
    plan = model_plan(model, (), 3)
    flats = [gather(tensors, f) for f in plan]
    for f, flat in zip(plan, flats):
        for piece, (start, stop, _) in zip(f.pieces, f.spans):
            if piece.name == "bn.num_batches_tracked":
                flat[start:stop] = 41.6
            if piece.name == "bn.running_var":
                flat[start:stop] = 2.5
        scatter(tensors, f, flat)
    assert model.bn.num_batches_tracked.item() == 42 and model.bn.num_batches_tracked.dtype == torch.int64
    assert torch.equal(model.bn.running_var, torch.full((4,), 2.5))


def test_non_persistent_buffers_stay_out_and_tied_parameters_appear_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("mask", torch.ones(3), persistent=False)
    names = set(state_tensors(Tied()))
    assert names == {"emb.weight"}
