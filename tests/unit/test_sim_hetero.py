"""Heterogeneous learners (sim.hetero): lock-step vs quorum K = 1 vs K = 1 + grace window."""
from __future__ import annotations

import pytest

from ddloco.sim.hetero import HeteroConfig, Policy, simulate_hetero, standard_policies

pytestmark = pytest.mark.timeout(60)

CFG = HeteroConfig(rounds=400)


def run(cfg: HeteroConfig, name: str, seed: int = 0):
    policy = next(p for p in standard_policies(cfg.learners) if p.name.startswith(name))
    return simulate_hetero(cfg, policy, seed=seed)


def test_quorum_one_goodput_is_at_least_lock_step() -> None:
    lock, k1, grace = (run(CFG, n) for n in ("K=M", "K=1", "K=1 + grace"))
    assert k1.goodput >= lock.goodput
    assert grace.goodput >= lock.goodput
    assert lock.goodput < 1.0


def test_identical_learners_without_noise_never_wait_in_lock_step() -> None:
    cfg = HeteroConfig(rounds=200, slowdown=0.0, noise=0.0)
    assert run(cfg, "K=M").goodput == pytest.approx(1.0)


def test_lock_step_goodput_falls_as_the_slow_learners_get_slower() -> None:
    values = [run(HeteroConfig(rounds=300, slowdown=s), "K=M").goodput for s in (0.0, 0.1, 0.3)]
    assert values[0] > values[1] > values[2], values


def test_grace_window_merges_more_answers_than_quorum_one_alone() -> None:
    k1, grace = run(CFG, "K=1"), run(CFG, "K=1 + grace")
    assert grace.included > k1.included
    assert grace.included_slow > k1.included_slow
    assert run(CFG, "K=M").included == 1.0


def test_zero_gamma_grace_window_is_no_grace_at_all() -> None:
    """The syncer's own grace_window_s: γ = 0 gives a zero window, so grace changes nothing."""
    cfg = HeteroConfig(rounds=200, grace_gamma=0.0)
    assert run(cfg, "K=1 + grace").included == run(cfg, "K=1").included


def test_hetero_is_deterministic_for_a_seed() -> None:
    assert run(CFG, "K=1 + grace", seed=2) == run(CFG, "K=1 + grace", seed=2)
    assert run(CFG, "K=M", seed=2) != run(CFG, "K=M", seed=3)


def test_lock_step_needs_every_learner_in_the_quorum() -> None:
    with pytest.raises(ValueError, match="K = M"):
        simulate_hetero(CFG, Policy(name="bad", quorum=2, grace=False, lockstep=True))


@pytest.mark.parametrize("kwargs", [dict(learners=0), dict(noise=-0.1), dict(grace_gamma=1.5),
                                    dict(slow_fraction=2.0), dict(rounds=1)])
def test_invalid_hetero_configs_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        HeteroConfig(**kwargs)
