"""A sharded torchrun learner's collectives (learner/group.py, FSDP): two real gloo ranks."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.fragments import gather, model_plan, state_tensors
from learner.group import Group, _local_rows, resolve_sharding
from ddloco.tasks.gpt import GPT

pytestmark = pytest.mark.timeout(180)


def _model() -> GPT:
    torch.manual_seed(0)   # the same initial values on every rank, as build_model gives them
    # odd sizes: 13 rows of wpe split 7 + 6, experts nested in blocks (inner units first)
    return GPT(seq_len=13, n_layer=2, n_head=2, n_embd=6, n_experts=2, top_k=1)


def _rank(rank: int, store: str) -> None:
    _check(rank, store)
    # passed: leave without the interpreter's teardown, where gloo's threads sometimes abort the
    # process ("terminate called without an active exception", SIGABRT) after every check passed
    os._exit(0)


def _check(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = _model()
        names = ("wte.weight", "wpe.weight")
        plan = model_plan(model, names, 5)
        whole = [gather(state_tensors(model), f) for f in plan]
        g = Group(rank, 2, rank)
        g.start(torch.device("cpu"))
        g.wrap(model, torch.device("cpu"), "fsdp")
        tensors = state_tensors(model)
        assert g.sharded and any(hasattr(t, "to_local") for t in tensors.values())
        held = sum(t.to_local().numel() for t in tensors.values() if hasattr(t, "to_local"))
        assert 0 < held < sum(t.numel() for t in tensors.values() if hasattr(t, "to_local"))

        # rank 0 gets every fragment whole, exactly as the unsharded model held it
        got = g.gather_fragments(plan, tensors, range(len(plan)))
        assert sorted(got) == (list(range(len(plan))) if rank == 0 else [])
        for p, v in got.items():
            assert torch.equal(v, whole[p]), p

        # rank 0's new values of fragments 0, 2, 4 reach every rank's shard; the rest stay
        gen = torch.Generator().manual_seed(1)
        new = {}
        for p in (0, 2, 4):
            new[p] = whole[p].clone()
            for start, stop, _ in plan[p].spans:   # the alignment gaps stay 0, as gather gives them
                new[p][start:stop] += torch.randn(stop - start, generator=gen)
        changed = g.share_changed(plan, tensors, new if rank == 0 else {})
        assert changed == [0, 2, 4]
        full = g.materialize(model)
        for p, f in enumerate(plan):
            assert torch.equal(gather(full, f), new[p] if p in new else whole[p]), p

        # the sharded model still trains, and what rank 0 gathers afterwards is the trained model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        idx = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(2 + rank))
        model(idx).float().logsumexp(-1).mean().backward()
        opt.step()
        after = g.gather_fragments(plan, tensors, range(len(plan)))
        trained = g.materialize(model)
        for p, v in after.items():
            assert torch.equal(v, gather(trained, plan[p])), p
            assert not torch.equal(v, gather(full, plan[p])), p   # the step moved every fragment
        dist.barrier()   # tear down together: a rank that leaves first can make gloo abort the other
    finally:
        dist.destroy_process_group()


def test_a_sharded_group_gathers_and_shares_fragments_exactly(tmp_path):
    mp.start_processes(_rank, args=(str(tmp_path / "store"),), nprocs=2, start_method="spawn")


def test_fsdp_rows_follow_torch_chunk():
    for rows in (1, 2, 7, 13, 64):
        for world in (2, 3, 4):
            chunks = torch.arange(rows).chunk(world)
            for r in range(world):
                lo, hi = _local_rows((rows, 3), r, world)
                expect = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(lo, hi)) == expect, (rows, world, r)


def test_sharding_choice():
    cpu = torch.device("cpu")
    assert resolve_sharding("auto", cpu, 10**12) == "ddp"     # a CPU group replicates
    assert resolve_sharding("fsdp", cpu, 10) == "fsdp"
    assert resolve_sharding("ddp", cpu, 10) == "ddp"
    with pytest.raises(ValueError, match="ddp, fsdp"):
        resolve_sharding("zero3", cpu, 10)


def test_a_torch_without_fsdp2_is_refused_for_fsdp_and_replicates_on_auto(monkeypatch):
    import learner.group as group
    monkeypatch.setattr(group, "fsdp_available", lambda: False)
    with pytest.raises(ValueError, match="needs torch >= 2.6"):
        group.resolve_sharding("fsdp", torch.device("cpu"), 10)
    assert group.resolve_sharding("auto", torch.device("cpu"), 10**12) == "ddp"
