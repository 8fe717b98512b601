"""Algorithm equivalence: the real cluster (Redis, broker, shards, learners, sockets) against
references written independently here from ALGORITHM.md."""
from __future__ import annotations

import copy

import pytest
import torch

from common.config import AlgoConfig, RunConfig
from tests.conftest import TinyNet, tiny_batches, tiny_loss, wait_until

pytestmark = pytest.mark.timeout(120)


def _adamw(model: torch.nn.Module, algo: AlgoConfig):
    opt = torch.optim.AdamW(model.parameters(), lr=algo.inner_lr, betas=(0.9, 0.95),
                            weight_decay=algo.inner_weight_decay)
    warm = max(1, algo.inner_warmup_steps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))


def _inner_step(model, opt, sched, batch) -> None:
    loss = tiny_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()


def _plain_training(algo: AlgoConfig, steps: int) -> TinyNet:
    """One TinyNet trained alone on stream 0 for ``steps`` inner steps."""
    plain = TinyNet()
    opt, sched = _adamw(plain, algo)
    data = tiny_batches(0)
    for _ in range(steps):
        _inner_step(plain, opt, sched, next(data))
    return plain


def reference_sync_diloco(*, learners: int, rounds: int, algo: AlgoConfig) -> dict[str, torch.Tensor]:
    """Synchronous DiLoCo: M replicas, H AdamW steps each, per-tensor radial-directional average
    of the outer gradients (equal token weights; a tensor larger than 1/P of the model is cut in
    slices, each averaged on its own), outer SGD with Nesterov momentum."""
    from common.fragments import model_plan
    pieces = [(q.name, q.start, q.stop) for f in model_plan(TinyNet(), (), algo.fragments) for q in f.pieces]
    global_model = TinyNet()
    theta = {n: p.detach().clone() for n, p in global_model.named_parameters()}
    buf = {n: torch.zeros_like(t) for n, t in theta.items()}
    replicas = [TinyNet() for _ in range(learners)]
    optims = [_adamw(m, algo) for m in replicas]
    data = [tiny_batches(m) for m in range(learners)]
    for _ in range(rounds):
        outer = {n: [] for n in theta}
        for m, model in enumerate(replicas):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(theta[n])
            for _ in range(algo.sync_every_steps):
                _inner_step(model, *optims[m], next(data[m]))
            for n, p in model.named_parameters():
                outer[n].append(theta[n] - p.detach())
        for n, a, b in pieces:  # RDA per piece: a whole tensor, or a slice of a large one
            vs = [v.reshape(-1)[a:b] for v in outer[n]]
            w = 1.0 / len(vs)
            norm = sum(w * v.norm() for v in vs)
            direction = sum(w * v / v.norm() for v in vs)
            g = norm * direction / direction.norm()
            flat_buf, flat_theta = buf[n].view(-1), theta[n].view(-1)
            flat_buf[a:b] = algo.outer_momentum * flat_buf[a:b] + g
            flat_theta[a:b] = flat_theta[a:b] - algo.outer_lr * (g + algo.outer_momentum * flat_buf[a:b])
    return theta


def _shard_theta(cluster, shards: int) -> dict[str, torch.Tensor]:
    model = TinyNet()
    from common.fragments import scatter, state_tensors
    params = state_tensors(model)
    for k in range(shards):
        for p, f in cluster.shards[k].frags.items():
            scatter(params, f.spec, f.theta)
    return {n: p.detach().clone() for n, p in params.items()}


def test_lockstep_quorum_m_matches_reference_synchronous_diloco(make_cluster):
    rounds = 4
    algo = AlgoConfig(fragments=2, sync_every_steps=3, quorum=2, uplink_codec="fp32", downlink_codec="fp32", lockstep=True,
                      inner_warmup_steps=2, outer_lr=0.7, outer_momentum=0.9)   # exercises Nesterov
    run = RunConfig(algo=algo)
    cluster = make_cluster(run)
    for k in range(2):
        cluster.start_shard(k, 2)
    # the last round is the learners' flush after their final step
    learners = [cluster.learner(f"l{m}", m, max_steps=rounds * algo.sync_every_steps) for m in range(2)]
    threads = [cluster.start_learner(lr) for lr in learners]
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "learner did not finish its steps"
    assert not cluster.errors, cluster.errors
    versions = {p: f.version for k in range(2) for p, f in cluster.shards[k].frags.items()}
    assert versions == {0: rounds, 1: rounds}, versions
    ours = _shard_theta(cluster, 2)
    ref = reference_sync_diloco(learners=2, rounds=rounds, algo=algo)
    for n in ref:
        torch.testing.assert_close(ours[n], ref[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_single_learner_with_unit_outer_step_follows_plain_training(make_cluster):
    steps = 12
    algo = AlgoConfig(fragments=1, sync_every_steps=1, quorum=1, uplink_codec="fp32", downlink_codec="fp32", lockstep=True,
                      outer_lr=1.0, outer_momentum=0.0, inner_warmup_steps=1)
    cluster = make_cluster(RunConfig(algo=algo))
    cluster.start_shard(0, 1)
    t = cluster.start_learner(cluster.learner("solo", 0, max_steps=steps))
    t.join(timeout=60)
    assert not t.is_alive(), "learner did not finish its steps"
    assert not cluster.errors, cluster.errors
    assert cluster.shards[0].frags[0].version == steps
    plain = _plain_training(algo, steps)
    ours = _shard_theta(cluster, 1)
    for n, p in plain.named_parameters():
        torch.testing.assert_close(ours[n], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("carry", [True, False])
def test_async_single_learner_keeps_steps_taken_after_answering_only_with_carry(make_cluster, carry):
    """K = 1, no lock-step: the learner trains on while its answer is merged. With carry, every
    step it took reaches the global model (η = 1, μ = 0: the result is plain training); with
    overwrite, the steps between an answer and the merged value's arrival are lost."""
    steps = 40
    algo = AlgoConfig(fragments=2, sync_every_steps=4, quorum=1, uplink_codec="fp32", downlink_codec="fp32", outer_lr=1.0,
                      outer_momentum=0.0, inner_warmup_steps=1, carry_local_steps=carry)
    cluster = make_cluster(RunConfig(algo=algo))
    cluster.start_shard(0, 1)
    # a step floor makes merges arrive while the learner is still training (answers are async)
    learner = cluster.learner("solo", 0, max_steps=steps, step_time_floor_ms=15)
    t = cluster.start_learner(learner)
    t.join(timeout=60)
    assert not t.is_alive(), "learner did not finish its steps"
    assert not cluster.errors, cluster.errors
    assert learner.stats.unflushed == 0 and learner.stats.flushed == 2
    assert learner.stats.merges_applied >= 4, learner.stats
    plain = _plain_training(algo, steps)
    ours = _shard_theta(cluster, 1)
    gap = max(float((ours[n] - p.detach()).abs().max()) for n, p in plain.named_parameters())
    if carry:
        assert gap < 1e-4, f"global model differs from plain training by {gap}"
    else:
        assert gap > 1e-3, f"overwrite lost no steps (gap {gap}): the test no longer separates the rules"
