"""Goodput simulator under failures (sim.cluster): properties, not the paper's numbers."""
from __future__ import annotations

import pytest

from ddloco.sim.cluster import FailureModel, Scenario, simulate, simulate_seeds

pytestmark = pytest.mark.timeout(60)

FAST = 3000          # failures per seed: enough for orderings, quick to run
MODEL = FailureModel()
NO_FAILURES = FailureModel(chip_mtbi_years=1e12, dp_spare_fraction=0.0)


def goodput(scenario: Scenario, model: FailureModel = MODEL, seeds: int = 2) -> float:
    return simulate_seeds(scenario, model, seeds=seeds, failures=FAST).goodput.mean


@pytest.mark.parametrize("scenario", [
    Scenario(chips=150_000, mode="dp"),
    Scenario(chips=150_000, mode="elastic"),
    Scenario(chips=150_000, learners=4, quorum=1),
    Scenario(chips=150_000, learners=4, quorum=4),
    Scenario(chips=2_400_000, learners=16, quorum=1),
], ids=lambda s: f"{s.label}@{s.chips}")
def test_no_failures_gives_full_goodput_and_uptime(scenario: Scenario) -> None:
    r = simulate(scenario, NO_FAILURES, seed=0, horizon_s=1e6)
    assert r.failures == 0
    assert r.goodput == pytest.approx(1.0, abs=1e-12), r
    assert r.uptime == pytest.approx(1.0, abs=1e-12), r


def test_dp_hot_spares_are_provisioned_compute_that_never_trains() -> None:
    spares = FailureModel(chip_mtbi_years=1e12, dp_spare_fraction=0.25)
    r = simulate(Scenario(chips=1024 * 100, mode="dp"), spares, horizon_s=1e6)
    assert r.uptime == pytest.approx(1.0)
    assert r.goodput == pytest.approx(0.75)


@pytest.mark.parametrize("make", [
    lambda n: Scenario(chips=n, mode="dp"),
    lambda n: Scenario(chips=n, mode="elastic"),
    lambda n: Scenario(chips=n, learners=4),
    lambda n: Scenario(chips=n, learners=16),
], ids=["dp", "elastic", "M=4", "M=16"])
def test_goodput_falls_with_chips(make) -> None:
    values = [goodput(make(n)) for n in (150_000, 600_000, 2_400_000)]
    assert values[0] > values[1] > values[2], values


@pytest.mark.parametrize("chips", [300_000, 2_400_000])
def test_goodput_rises_with_learners(chips: int) -> None:
    values = [goodput(Scenario(chips=chips, learners=m)) for m in (1, 2, 4, 8, 16)]
    assert values == sorted(values) and len(set(values)) == len(values), values


@pytest.mark.parametrize("chips", [150_000, 1_200_000])
def test_non_elastic_dp_is_below_elastic_dp(chips: int) -> None:
    assert goodput(Scenario(chips=chips, mode="dp")) < goodput(Scenario(chips=chips, mode="elastic"))


@pytest.mark.parametrize("seed", [0, 7])
def test_one_learner_equals_elastic_dp(seed: int) -> None:
    elastic = simulate(Scenario(chips=600_000, mode="elastic"), MODEL, seed=seed, failures=FAST)
    one = simulate(Scenario(chips=600_000, mode="diloco", learners=1, quorum=1), MODEL,
                   seed=seed, failures=FAST)
    assert one == elastic


def test_results_are_deterministic_for_a_seed() -> None:
    s = Scenario(chips=1_200_000, learners=8, quorum=2)
    a = simulate(s, MODEL, seed=3, failures=FAST)
    assert simulate(s, MODEL, seed=3, failures=FAST) == a
    assert simulate(s, MODEL, seed=4, failures=FAST) != a


@pytest.mark.parametrize("learners", [4, 8, 16])
@pytest.mark.parametrize("chips", [150_000, 2_400_000])
def test_uptime_is_about_one_for_four_or_more_learners_at_quorum_one(learners: int,
                                                                    chips: int) -> None:
    s = simulate_seeds(Scenario(chips=chips, learners=learners, quorum=1), MODEL, seeds=2,
                       failures=FAST)
    assert s.uptime.mean >= 0.99, s


def test_larger_quorum_blocks_learners_and_stops_the_model_more_often() -> None:
    by_k = [simulate_seeds(Scenario(chips=1_200_000, learners=4, quorum=k), MODEL, seeds=2,
                           failures=FAST) for k in (1, 2, 4)]
    goodputs = [s.goodput.mean for s in by_k]
    uptimes = [s.uptime.mean for s in by_k]
    assert goodputs[0] > goodputs[1] > goodputs[2], goodputs
    assert uptimes[0] > uptimes[1] > uptimes[2], uptimes


def test_lock_step_quorum_is_no_better_than_one_elastic_job() -> None:
    """K = M: a pause of any learner stops everyone, and learners' pauses do not share a
    reconfiguration as one elastic job's do."""
    lock = goodput(Scenario(chips=600_000, learners=4, quorum=4), seeds=3)
    elastic = goodput(Scenario(chips=600_000, mode="elastic"), seeds=3)
    assert lock < elastic


def test_more_reliable_chips_give_more_goodput() -> None:
    flaky = FailureModel(chip_mtbi_years=0.5)
    solid = FailureModel(chip_mtbi_years=2.0)
    s = Scenario(chips=600_000, learners=2)
    assert goodput(s, flaky) < goodput(s, MODEL) < goodput(s, solid)


def test_sampled_failures_match_the_requested_count() -> None:
    r = simulate(Scenario(chips=300_000, learners=4), MODEL, seed=1, failures=5000)
    assert 4500 <= r.failures <= 5500, r


@pytest.mark.parametrize("chips", [150_000, 2_400_000])
def test_elastic_uptime_matches_renewal_formula(chips: int) -> None:
    """Rejoining at once, every failure and every repair pauses once: 1 / (1 + Λ(d + u))."""
    model = FailureModel(rejoin_wait_s=0.0, step_s=1e-6)
    s = simulate_seeds(Scenario(chips=chips, mode="elastic"), model, seeds=2, failures=10_000)
    rate = chips * model.chip_rate_per_s
    expected = 1.0 / (1.0 + rate * (model.downscale_s + model.upscale_s))
    assert s.uptime.mean == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize("chips", [150_000, 2_400_000])
def test_dp_goodput_matches_renewal_formula(chips: int) -> None:
    """Only the job's slices interrupt it; a restart absorbs failures: J/N / (1 + Λ_J·R)."""
    model = FailureModel(step_s=1e-6, dp_spare_fraction=0.3)
    s = simulate_seeds(Scenario(chips=chips, mode="dp"), model, seeds=2, failures=10_000)
    job = 0.7
    expected = job / (1.0 + job * chips * model.chip_rate_per_s * model.restart_s)
    assert s.goodput.mean == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize("kwargs", [
    dict(chips=0),
    dict(chips=100, learners=2, quorum=3),
    dict(chips=100, mode="dp", learners=2),
    dict(chips=100, mode="bogus"),
    dict(chips=2, learners=3),
])
def test_invalid_scenarios_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        Scenario(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(chip_mtbi_years=0), dict(repair_s=-1), dict(downscale_s=float("nan")),
    dict(dp_spare_fraction=1.0), dict(slice_chips=0), dict(step_s=0),
])
def test_invalid_failure_models_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        FailureModel(**kwargs)
