"""Goodput of a cluster under chip failures (ALGORITHM.md §9): data-parallel, elastic
data-parallel and Decoupled DiLoCo, simulated exactly from sampled failure times.

Failure model (every number is a field of ``FailureModel``):

- Chips fail as independent Poisson processes, one interruption per ``chip_mtbi_years`` per chip.
- A failed chip takes its *slice* (``slice_chips`` chips, the unit that is swapped) out for
  ``repair_s``; chips of a slice under repair do not fail again, so each slice is an alternating
  renewal process (up ~ Exp(chips·λ), down = repair_s). Slices start in the stationary state.
- Chips under repair stay provisioned: their time is never useful.

The three ways of training on ``chips`` chips:

- **Non-elastic data-parallel** (``mode="dp"``): a fixed-size job on ``1 − dp_spare_fraction``
  of the slices; the others are hot spares (provisioned, never training). A failure of one of
  the job's chips stops it; after ``restart_s`` it runs again on healthy slices (spares replace
  the failed ones; it waits for repairs only if too few are healthy). Failures during a restart
  are absorbed by it; failures of spares do not stop the job.
- **Elastic data-parallel** (``mode="elastic"``): a failure pauses the job ``downscale_s``, after
  which it runs on the healthy slices. A repaired slice rejoins at the next pause, or once it
  has waited ``rejoin_wait_s``, with an ``upscale_s`` pause of its own (re-admissions are
  batched with downscales when failures are frequent). A pause handles every membership change
  that arrives while it is in progress (such events do not extend it).
- **Decoupled DiLoCo** (``mode="diloco"``): M learners of N/M chips; each learner is an elastic
  unit as above, with its own slices, and never waits for the others. The global model advances
  while at least K learners step. With K > 1, compute done while fewer than K learners step
  counts as blocked (the learners wait at the barrier). M = 1, K = 1 is elastic data-parallel.

Every failure also throws away the partial step in flight (``step_s``; steps run back to back
from the last (re)start).

Definitions (ALGORITHM.md §9): goodput = useful chip-seconds / (chips · wall time); uptime =
fraction of wall time during which the global model advances. The simulation is vectorised
with numpy (failure sampling, repair-interval arithmetic); the only Python loop is the O(events)
scan that decides which events start a pause (O(failures) per run).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

SECONDS_PER_YEAR = 365.25 * 86400.0
MODES = ("dp", "elastic", "diloco")
MAX_SAMPLES = 50_000_000
"""Cap on sampled up-times per unit (memory: 8 bytes each)."""
DEFAULT_FAILURES = 40_000
"""Chip failures sampled per seed and scenario by default (a 95 % CI of ~0.1-0.3 points)."""


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """Failure, repair and reconfiguration times. The defaults are the one calibration used for
    every cell of the paper's Table 1 (README.md, "The calibration")."""

    chip_mtbi_years: float = 1.0
    """Mean time between interruptions of one chip [paper: 1 year]."""
    slice_chips: int = 1024
    """Chips taken out together by one chip failure (the swappable unit)."""
    repair_s: float = 600.0
    """Time until a failed slice is healthy again."""
    downscale_s: float = 19.0
    """Elastic pause after a failure (re-mesh on the healthy slices)."""
    upscale_s: float = 10.0
    """Elastic pause when a repaired slice rejoins."""
    rejoin_wait_s: float = 120.0
    """Elastic: a repaired slice rejoins at the next pause, or after waiting at most this long
    (then with its own upscale pause); 0 = rejoin at once."""
    restart_s: float = 69.0
    """Non-elastic data-parallel: time from a failure until the job trains again."""
    dp_spare_fraction: float = 0.105
    """Non-elastic data-parallel: fraction of the slices kept as hot spares. The job has a
    fixed size and restarts on spares instead of waiting for repairs; spares are provisioned
    compute that does not train (0 = no spares: a restart waits for the repair)."""
    step_s: float = 1.0
    """Training step time; a failure throws away the partial step in flight."""

    def __post_init__(self) -> None:
        for name in ("chip_mtbi_years", "repair_s", "step_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)}")
        for name in ("downscale_s", "upscale_s", "rejoin_wait_s", "restart_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.dp_spare_fraction < 1.0:
            raise ValueError(f"dp_spare_fraction must be in [0, 1), got {self.dp_spare_fraction}")
        if self.slice_chips < 1:
            raise ValueError(f"slice_chips must be >= 1, got {self.slice_chips}")

    @property
    def chip_rate_per_s(self) -> float:
        """λ: failures per chip-second."""
        return 1.0 / (self.chip_mtbi_years * SECONDS_PER_YEAR)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """What is simulated: how many chips, trained how."""

    chips: int
    """N: provisioned chips."""
    mode: str = "diloco"
    """"dp" (non-elastic data-parallel), "elastic" (elastic data-parallel) or "diloco"."""
    learners: int = 1
    """M: Decoupled DiLoCo learners of N/M chips each (1 for the data-parallel modes)."""
    quorum: int = 1
    """K: the global model advances while at least K learners step."""

    def __post_init__(self) -> None:
        if self.chips < 1:
            raise ValueError(f"chips must be >= 1, got {self.chips}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if not 1 <= self.quorum <= self.learners:
            raise ValueError(f"quorum must be in [1, learners={self.learners}], got {self.quorum}")
        if self.mode != "diloco" and (self.learners, self.quorum) != (1, 1):
            raise ValueError(f"mode {self.mode!r} has one job: learners and quorum must be 1")
        if self.learners > self.chips:
            raise ValueError(f"learners ({self.learners}) cannot exceed chips ({self.chips})")

    @property
    def label(self) -> str:
        if self.mode == "dp":
            return "DP"
        if self.mode == "elastic":
            return "elastic DP"
        return f"M={self.learners} K={self.quorum}"


@dataclass(frozen=True)
class RunResult:
    """One seed of one scenario."""

    goodput: float
    uptime: float
    failures: int
    """Chip failures (slice outages) sampled over the horizon."""
    horizon_s: float


@dataclass(frozen=True)
class _Slices:
    """Sampled outages of one unit's slices, arrays sorted by time."""

    chips_per_slice: float
    fail_t: np.ndarray      # [F] failure times (each takes its slice out)
    ret_t: np.ndarray       # [R] repair-complete times before the horizon
    ret_lo: np.ndarray      # [R] when that outage began (0 for slices down at t = 0)
    open_lo: np.ndarray     # outages still open at the horizon: when they began

def horizon_for(chips: int, model: FailureModel, failures: int) -> float:
    """Wall time over which ``chips`` chips see about ``failures`` failures."""
    return failures / (chips * model.chip_rate_per_s)


def _sample_slices(rng: np.random.Generator, n_slices: int, chips_per_slice: float,
                   model: FailureModel, horizon_s: float) -> _Slices:
    """Alternating renewal per slice (up ~ Exp, down = repair_s), stationary at t = 0."""
    mean_up = 1.0 / (chips_per_slice * model.chip_rate_per_s)
    p_down = model.repair_s / (model.repair_s + mean_up)
    down0 = rng.random(n_slices) < p_down
    # A slice down at t = 0 has a residual repair time uniform in [0, repair_s).
    first_up = np.where(down0, rng.random(n_slices) * model.repair_s, 0.0)
    expected = horizon_s / (mean_up + model.repair_s)
    width = int(expected + 8.0 * math.sqrt(expected) + 8)
    if n_slices * width > MAX_SAMPLES:
        raise ValueError(f"{n_slices:,} slices x {width:,} failures each is too large to sample; "
                         "use fewer chips, bigger slices or fewer failures")
    while True:
        ups = rng.exponential(mean_up, size=(n_slices, width))
        # failure k of a slice = first_up + sum_{j<=k} up_j + k * repair_s
        fails = first_up[:, None] + np.cumsum(ups, axis=1) + model.repair_s * np.arange(width)
        if (fails[:, -1] >= horizon_s).all():
            break
        width *= 2
    f_t = np.sort(fails[fails < horizon_s])
    lo = np.concatenate([np.zeros(int(down0.sum())), f_t])
    ret = np.concatenate([first_up[down0], f_t + model.repair_s])
    done = ret < horizon_s
    order = np.argsort(ret[done], kind="stable")
    return _Slices(chips_per_slice, f_t, ret[done][order], lo[done][order], lo[~done])


def _measure(lo: np.ndarray, hi: np.ndarray, run_lo: np.ndarray, run_hi: np.ndarray) -> np.ndarray:
    """|[lo_i, hi_i) ∩ run| for each i, where run = ⋃ [run_lo_j, run_hi_j) (sorted, disjoint)."""
    if len(run_lo) == 0:
        return np.zeros(len(lo))
    # C(t) = run time in [0, t], piecewise linear through the interval ends.
    bp = np.empty(2 * len(run_lo))
    bp[0::2], bp[1::2] = run_lo, run_hi
    cum = np.empty_like(bp)
    lengths = run_hi - run_lo
    cum[1::2] = np.cumsum(lengths)
    cum[0::2] = cum[1::2] - lengths
    return np.interp(hi, bp, cum) - np.interp(lo, bp, cum)


def _covering(lo: np.ndarray, hi: np.ndarray, t: np.ndarray) -> np.ndarray:
    """How many intervals [lo_i, hi_i) contain the instant just before each time in ``t``."""
    return (np.searchsorted(np.sort(lo), t, side="left")
            - np.searchsorted(np.sort(hi), t, side="left"))


def _elastic_unit(sl: _Slices, n_slices: int, model: FailureModel, horizon_s: float
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Running intervals of one elastic unit.

    A failure while running starts a ``downscale_s`` pause. A slice repaired while the unit runs
    waits to rejoin at the next pause, or at most ``rejoin_wait_s``, after which it starts an
    ``upscale_s`` pause itself. Every event during a pause is handled by that pause.

    Returns (run_lo, run_hi, loss_t, loss_chip_s, out_lo, out_hi): sorted disjoint running
    intervals; for each failure that interrupted a run, its time and the chip-seconds of the
    partial step thrown away; and per slice outage the interval [failure, rejoin) during which
    its chips are out of the unit.
    """
    n_fail, n_ret = len(sl.fail_t), len(sl.ret_t)
    ev_t = np.concatenate([sl.fail_t, sl.ret_t])
    ev_fail = np.concatenate([np.ones(n_fail, bool), np.zeros(n_ret, bool)])
    order = np.argsort(ev_t, kind="stable")
    down_s, up_s, wait_s = model.downscale_s, model.upscale_s, model.rejoin_wait_s
    # The only sequential part: which events start a pause (O(events)).
    p_lo: list[float] = []
    p_fail: list[bool] = []
    end, pending = -math.inf, math.inf
    for t, fail in zip(ev_t[order].tolist(), ev_fail[order].tolist()):
        if pending <= t:                        # a repaired slice waited long enough: upscale
            p_lo.append(pending)
            p_fail.append(False)
            end, pending = pending + up_s, math.inf
        if t < end:
            continue                            # handled by the pause in progress
        if fail:
            p_lo.append(t)
            p_fail.append(True)
            end, pending = t + down_s, math.inf
        elif pending == math.inf:
            pending = t + wait_s
    if pending < horizon_s:
        p_lo.append(pending)
        p_fail.append(False)
    lo = np.asarray(p_lo, dtype=np.float64)
    hit = np.asarray(p_fail, dtype=bool)
    hi = np.minimum(lo + np.where(hit, down_s, up_s), horizon_s)
    run_lo = np.concatenate([[0.0], hi])
    run_hi = np.concatenate([lo, [horizon_s]])
    ok = run_hi > run_lo
    # When does each repaired slice rejoin? At once if a pause is in progress, else at the start
    # of the next pause (its own upscale at the latest).
    i = np.searchsorted(lo, sl.ret_t, side="right") - 1
    in_pause = (i >= 0) & (sl.ret_t < hi[np.maximum(i, 0)] if len(lo) else False)
    nxt = np.append(lo, horizon_s)[np.minimum(i + 1, len(lo))]
    join = np.where(in_pause, sl.ret_t, nxt)
    out_lo = np.concatenate([sl.ret_lo, sl.open_lo])
    out_hi = np.concatenate([join, np.full(len(sl.open_lo), horizon_s)])
    # A failure that starts a pause interrupted a run: the partial step since the run began
    # (steps are back to back from the run start) is thrown away on every chip in the unit.
    t_hit = lo[hit]
    began = run_lo[:-1][hit]
    active = n_slices - _covering(out_lo, out_hi, t_hit)
    loss = np.mod(t_hit - began, model.step_s) * active * sl.chips_per_slice
    return run_lo[ok], run_hi[ok], t_hit, loss, out_lo, out_hi


def dp_job_slices(n_slices: int, model: FailureModel) -> int:
    """Slices of the fixed-size non-elastic job; the rest are hot spares."""
    return max(1, round(n_slices * (1.0 - model.dp_spare_fraction)))


def _nonelastic_unit(sl: _Slices, n_slices: int, model: FailureModel, horizon_s: float,
                     pick: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Running intervals of a fixed-size job of J slices with the other slices as hot spares.

    A failure of one of the job's slices stops it; after ``restart_s`` it runs again on any J
    healthy slices (waiting for repairs if fewer are healthy). Healthy slices are exchangeable
    (same failure rate, memoryless), so the slice that fails is one of the job's with
    probability J / healthy: ``pick`` holds one uniform draw per failure for that choice.

    Returns (run_lo, run_hi, useful_chip_s) per running interval, the partial step in flight at
    each interrupting failure subtracted.
    """
    job = dp_job_slices(n_slices, model)
    ev_t = np.concatenate([sl.fail_t, sl.ret_t])
    ev_fail = np.concatenate([np.ones(len(sl.fail_t), bool), np.zeros(len(sl.ret_t), bool)])
    ev_u = np.concatenate([pick, np.zeros(len(sl.ret_t))])
    order = np.argsort(ev_t, kind="stable")
    healthy = n_slices - int(np.sum(sl.ret_lo == 0.0)) - int(np.sum(sl.open_lo == 0.0))
    runs: list[tuple[float, float]] = []
    running, waiting = healthy >= job, healthy < job
    run_start, restart_end = 0.0, 0.0
    for t, fail, u in zip(ev_t[order].tolist(), ev_fail[order].tolist(), ev_u[order].tolist()):
        if not running and not waiting and t >= restart_end:      # restart done
            if healthy >= job:
                running, run_start = True, restart_end
            else:
                waiting = True
        if fail:
            if running and u * healthy < job:                     # it hit the job
                runs.append((run_start, t))
                running, restart_end = False, t + model.restart_s
            healthy -= 1
        else:
            healthy += 1
            if waiting and healthy >= job:
                waiting, running, run_start = False, True, t
    if running:
        runs.append((run_start, horizon_s))
    elif not waiting and restart_end < horizon_s and healthy >= job:
        runs.append((restart_end, horizon_s))
    arr = np.asarray(runs, dtype=np.float64).reshape(-1, 2)
    run_lo, run_hi = arr[:, 0], arr[:, 1]
    ended = run_hi < horizon_s
    lost = np.where(ended, np.mod(run_hi - run_lo, model.step_s), 0.0)
    return run_lo, run_hi, (run_hi - run_lo - lost) * job * sl.chips_per_slice


def _level_set(los: list[np.ndarray], his: list[np.ndarray],
               k: int) -> tuple[np.ndarray, np.ndarray]:
    """Where at least ``k`` of the interval sets overlap (each set sorted and disjoint)."""
    t = np.concatenate(los + his)
    d = np.concatenate([np.ones(sum(len(x) for x in los), np.int64),
                        -np.ones(sum(len(x) for x in his), np.int64)])
    order = np.lexsort((d, t))              # at equal times, ends (-1) before starts (+1)
    t, level = t[order], np.cumsum(d[order])
    above = level >= k
    before = np.concatenate([[False], above[:-1]])
    lo, hi = t[above & ~before], t[~above & before]
    ok = hi > lo
    return lo[ok], hi[ok]


def _unit_layout(chips: float, model: FailureModel) -> tuple[int, float]:
    """Slices of a unit of ``chips`` chips and the chips of each (equal split)."""
    n_slices = max(1, math.ceil(chips / model.slice_chips - 1e-9))
    return n_slices, chips / n_slices


def simulate(scenario: Scenario, model: FailureModel = FailureModel(), *, seed: int = 0,
             failures: int = DEFAULT_FAILURES, horizon_s: float | None = None) -> RunResult:
    """One seed: sample about ``failures`` chip failures (or simulate ``horizon_s`` seconds when
    given) and measure goodput and uptime.

    The random stream depends on (seed, chips, learners) only, so the data-parallel modes and
    M = 1 see identical failures.
    """
    if horizon_s is None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        horizon = horizon_for(scenario.chips, model, failures)
    elif math.isfinite(horizon_s) and horizon_s > 0:
        horizon = float(horizon_s)
    else:
        raise ValueError(f"horizon_s must be finite and > 0, got {horizon_s}")
    n, m, k = scenario.chips, scenario.learners, scenario.quorum
    rng = np.random.default_rng([seed, n, m])
    n_slices, cps = _unit_layout(n / m, model)
    units = [_sample_slices(rng, n_slices, cps, model, horizon) for _ in range(m)]
    n_failures = sum(len(u.fail_t) for u in units)

    if scenario.mode == "dp":
        pick = rng.random(len(units[0].fail_t))
        run_lo, run_hi, useful = _nonelastic_unit(units[0], n_slices, model, horizon, pick)
        return RunResult(float(useful.sum() / (n * horizon)),
                         float((run_hi - run_lo).sum() / horizon), n_failures, horizon)

    runs = [_elastic_unit(u, n_slices, model, horizon) for u in units]
    adv_lo, adv_hi = _level_set([r[0] for r in runs], [r[1] for r in runs], k)
    useful = 0.0
    for run_lo, run_hi, loss_t, loss, out_lo, out_hi in runs:
        if k > 1:
            # Only compute done while the global model advances counts; the rest is blocked.
            run_lo, run_hi = _level_set([run_lo, adv_lo], [run_hi, adv_hi], 2)
            loss = loss[_covering(adv_lo, adv_hi, loss_t) > 0]
        useful += (n / m) * float((run_hi - run_lo).sum())
        useful -= cps * float(_measure(out_lo, out_hi, run_lo, run_hi).sum())
        useful -= float(loss.sum())
    return RunResult(useful / (n * horizon), float((adv_hi - adv_lo).sum() / horizon),
                     n_failures, horizon)


def t_quantile_975(df: int) -> float:
    """Student-t 97.5 % quantile with ``df`` degrees of freedom: the half-width factor of a
    two-sided 95 % confidence interval (df = seeds - 1); NaN below 1."""
    from scipy.stats import t
    if df < 1:
        return math.nan
    return float(t.ppf(0.975, df))


@dataclass(frozen=True)
class Estimate:
    """Mean over seeds and the half-width of its 95 % confidence interval."""

    mean: float
    ci95: float

    @classmethod
    def of(cls, values: list[float]) -> "Estimate":
        a = np.asarray(values, dtype=np.float64)
        if len(a) < 2:
            return cls(float(a.mean()), math.nan)
        return cls(float(a.mean()), float(t_quantile_975(len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))))


@dataclass(frozen=True)
class Summary:
    """A scenario over several seeds."""

    scenario: Scenario
    goodput: Estimate
    uptime: Estimate
    seeds: int
    failures_min: int
    """Fewest failures sampled in one seed."""
    failures_total: int


def simulate_seeds(scenario: Scenario, model: FailureModel = FailureModel(), *, seeds: int = 5,
                   failures: int = DEFAULT_FAILURES, first_seed: int = 0) -> Summary:
    """``simulate`` over seeds first_seed .. first_seed + seeds - 1."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    runs = [simulate(scenario, model, seed=s, failures=failures)
            for s in range(first_seed, first_seed + seeds)]
    return Summary(scenario, Estimate.of([r.goodput for r in runs]),
                   Estimate.of([r.uptime for r in runs]), seeds,
                   min(r.failures for r in runs), sum(r.failures for r in runs))
