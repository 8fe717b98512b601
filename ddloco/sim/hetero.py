"""Heterogeneous learners: lock-step (K = M) vs quorum K = 1 vs K = 1 with the adaptive grace window.

Learners have different step times (a fraction of them ``slowdown`` slower) and per-step noise
(each step's duration is multiplied by ``1 + noise·ε``, ε ~ N(0, 1), floored at 10 % of the mean).
One round (of one fragment) is opened every ``H/P`` typical learner steps, as the syncer does
(``common.quorum.period_s``), and merged by the syncer's own policy functions
(``common.quorum.decide_round`` with ``grace_window_s``).

Two learner behaviours:

- **Lock-step** (the synchronous DiLoCo baseline, K = M): at every round each learner answers
  after its ``H/P`` steps and then waits until the round is merged and broadcast; fast learners
  wait at each sync for the slowest. Every answer is included.
- **Decoupled** (K < M, ALGORITHM.md §1): learners never wait. Each answers every open round at
  its first step boundary after the round opened; the round merges when the policy says so and
  answers arriving after the merge are dropped.

Goodput = learner compute time / (learners · wall time). Quality proxy: the fraction of live
learners whose answer is included in each round's merge (lock-step: all of them, by
construction; K = 1 without grace: only the first).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from common.quorum import Decision, Ema, QuorumPolicy, RoundView, decide_round, grace_window_s, period_s


@dataclass(frozen=True, kw_only=True)
class HeteroConfig:
    """The heterogeneous cluster and the syncer's knobs."""

    learners: int = 8
    """M: number of learners."""
    slow_fraction: float = 0.5
    """Fraction of the learners that are slow (rounded to the nearest learner)."""
    slowdown: float = 0.18
    """Slow learners' mean step time is (1 + slowdown) · step_s."""
    noise: float = 0.10
    """Per-step multiplicative noise: standard deviation of ε in step · (1 + noise·ε)."""
    step_s: float = 1.0
    """Mean step time of a fast learner."""
    fragments: int = 24
    """P: fragments; one round per fragment every H steps."""
    sync_every_steps: int = 24
    """H: steps between two merges of the same fragment (a round every H/P steps)."""
    tau: int = 2
    """τ: rounds in flight at most; the grace budget is τ learner steps."""
    grace_gamma: float = 0.8
    """γ of the adaptive grace window."""
    sync_s: float = 0.0
    """ξ_sync: merge + broadcast time of one round (0 isolates the cost of stragglers)."""
    rounds: int = 4000
    """Rounds simulated per seed."""
    ema_alpha: float = 0.2
    """Smoothing of the syncer's moving averages ξ_step and ξ_quorum."""

    def __post_init__(self) -> None:
        if self.learners < 1:
            raise ValueError(f"learners must be >= 1, got {self.learners}")
        if not 0.0 <= self.slow_fraction <= 1.0:
            raise ValueError(f"slow_fraction must be in [0, 1], got {self.slow_fraction}")
        if not (math.isfinite(self.slowdown) and self.slowdown > -1.0):
            raise ValueError(f"slowdown must be > -1, got {self.slowdown}")
        if not (math.isfinite(self.noise) and self.noise >= 0):
            raise ValueError(f"noise must be >= 0, got {self.noise}")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"step_s must be > 0, got {self.step_s}")
        if self.fragments < 1 or self.sync_every_steps < 1 or self.tau < 1:
            raise ValueError("fragments, sync_every_steps and tau must be >= 1")
        if not 0.0 <= self.grace_gamma <= 1.0:
            raise ValueError(f"grace_gamma must be in [0, 1], got {self.grace_gamma}")
        if not (math.isfinite(self.sync_s) and self.sync_s >= 0):
            raise ValueError(f"sync_s must be >= 0, got {self.sync_s}")
        if self.rounds < 10:
            raise ValueError(f"rounds must be >= 10, got {self.rounds}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")

    @property
    def slow_learners(self) -> int:
        return int(round(self.slow_fraction * self.learners))

    @property
    def steps_per_round(self) -> float:
        """H/P: learner steps between two rounds."""
        return self.sync_every_steps / self.fragments

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Policy:
    """How rounds merge and whether learners wait for them."""

    name: str
    quorum: int
    grace: bool
    lockstep: bool

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {self.quorum}")


def standard_policies(learners: int) -> list[Policy]:
    """The three policies of the paper's comparison."""
    return [Policy(name=f"K=M={learners} lock-step", quorum=learners, grace=False, lockstep=True),
            Policy(name="K=1", quorum=1, grace=False, lockstep=False),
            Policy(name="K=1 + grace", quorum=1, grace=True, lockstep=False)]


@dataclass(frozen=True)
class HeteroResult:
    """One policy, one seed."""

    goodput: float
    included: float
    """Mean fraction of learners whose answer is merged, per round."""
    included_slow: float
    """The same, over slow learners only (NaN without slow learners)."""
    merge_latency_steps: float
    """Mean open-to-merge time of a round, in fast-learner steps."""
    rounds: int


def _step_times(rng: np.random.Generator, cfg: HeteroConfig, n_steps: int) -> np.ndarray:
    """[M, n_steps] step durations: slow learners last, noise floored at 10 % of the mean."""
    m = cfg.learners
    mean = np.full(m, cfg.step_s)
    mean[m - cfg.slow_learners:] *= 1.0 + cfg.slowdown
    eps = rng.standard_normal((m, n_steps))
    return mean[:, None] * np.maximum(1.0 + cfg.noise * eps, 0.1)


def _merge_time(opened_s: float, answers_s: np.ndarray, policy: QuorumPolicy, grace_s: float,
                live: int) -> tuple[float, int, float]:
    """Ask ``decide_round`` at every answer and at the grace deadline; the first MERGE wins.

    Returns (merge time, answers included, quorum time). ``answers_s`` is sorted.
    """
    k = policy.quorum
    quorum_s = float(answers_s[k - 1])
    candidates = [float(t) for t in answers_s[k - 1:]]
    candidates.append(quorum_s + grace_s)
    for now in sorted(candidates):
        count = int(np.searchsorted(answers_s, now, side="right"))
        decision, _reason = decide_round(
            now, RoundView(opened_at_s=opened_s, answers=count, quorum_reached_at_s=quorum_s,
                           live_learners=live), policy, grace_s=grace_s)
        if decision is Decision.MERGE:
            return now, count, quorum_s
    raise AssertionError("decide_round never merged a round whose live learners all answered")


def _lockstep(rng: np.random.Generator, cfg: HeteroConfig) -> HeteroResult:
    m = cfg.learners
    per = max(1, int(round(cfg.steps_per_round)))
    policy = QuorumPolicy(quorum=m, tau=cfg.tau, grace_gamma=cfg.grace_gamma, grace_enabled=False)
    steps = _step_times(rng, cfg, per * cfg.rounds).reshape(m, cfg.rounds, per).sum(axis=2)
    now, latency = 0.0, 0.0
    for r in range(cfg.rounds):
        answers = np.sort(now + steps[:, r])
        merged_s, count, _ = _merge_time(now, answers, policy, 0.0, m)
        latency += merged_s - now
        now = merged_s + cfg.sync_s
    return HeteroResult(float(steps.sum() / (m * now)), 1.0, 1.0 if cfg.slow_learners else math.nan,
                        latency / cfg.rounds / cfg.step_s, cfg.rounds)


class _OutOfSteps(Exception):
    """The pre-drawn step times ended before the last round: draw more."""


def _decoupled(rng: np.random.Generator, cfg: HeteroConfig, quorum: int, grace: bool,
               n_steps: int) -> HeteroResult:
    m = cfg.learners
    policy = QuorumPolicy(quorum=quorum, tau=cfg.tau, grace_gamma=cfg.grace_gamma,
                          grace_enabled=grace)
    durations = _step_times(rng, cfg, n_steps)
    bounds = np.cumsum(durations, axis=1)                     # [M, n_steps] step boundaries
    # Per-learner EMA of its step time, as the learner reports it after each step.
    ema = np.empty_like(durations)
    for i in range(m):
        e = Ema(cfg.ema_alpha)
        ema[i] = [e.update(x) for x in durations[i].tolist()]
    slow = np.arange(m) >= m - cfg.slow_learners
    xi_quorum, xi_sync = Ema(cfg.ema_alpha), Ema(cfg.ema_alpha, initial=cfg.sync_s)
    opened: list[float] = []
    merged: list[float] = []
    included, included_slow, latency = 0.0, 0.0, 0.0
    known_at = 0.0
    for r in range(cfg.rounds):
        # What the syncer knows when it schedules: each learner's last reported step-time EMA.
        last = np.array([np.searchsorted(bounds[i], known_at, side="right") - 1
                         for i in range(m)])
        xi = np.where(last >= 0, ema[np.arange(m), np.maximum(last, 0)], cfg.step_s)
        spacing = period_s(sync_every_steps=cfg.sync_every_steps,
                           xi_step_s=float(xi.mean())) / cfg.fragments
        opens = 0.0 if r == 0 else opened[-1] + spacing
        if r >= cfg.tau:                                      # at most τ rounds in flight
            opens = max(opens, merged[r - cfg.tau])
        idx = np.array([np.searchsorted(bounds[i], opens, side="right") for i in range(m)])
        if (idx >= n_steps).any():
            raise _OutOfSteps
        answers_by_learner = bounds[np.arange(m), idx]
        order = np.argsort(answers_by_learner, kind="stable")
        answers = answers_by_learner[order]
        grace_s = grace_window_s(xi_step_s=float(xi.max()),
                                 xi_quorum_s=xi_quorum.value if xi_quorum.value is not None else 0.0,
                                 xi_sync_s=float(xi_sync.value), tau=cfg.tau,
                                 gamma=cfg.grace_gamma)
        merged_s, count, quorum_s = _merge_time(opens, answers, policy, grace_s, m)
        xi_quorum.update(quorum_s - opens)
        xi_sync.update(cfg.sync_s)
        in_merge = answers_by_learner <= merged_s
        included += count / m
        if slow.any():
            included_slow += float(in_merge[slow].mean())
        latency += merged_s - opens
        opened.append(opens)
        merged.append(merged_s + cfg.sync_s)
        known_at = opens
    n = cfg.rounds
    # Decoupled learners never wait (ALGORITHM.md §1): every second of their time is compute.
    return HeteroResult(1.0, included / n, included_slow / n if slow.any() else math.nan,
                        latency / n / cfg.step_s, n)


def simulate_hetero(cfg: HeteroConfig, policy: Policy, *, seed: int = 0) -> HeteroResult:
    """One policy, one seed."""
    if policy.quorum > cfg.learners:
        raise ValueError(f"quorum {policy.quorum} exceeds learners {cfg.learners}")
    if policy.lockstep and policy.quorum != cfg.learners:
        raise ValueError("lock-step needs K = M (every learner waits for every answer)")
    if policy.lockstep:
        return _lockstep(np.random.default_rng([seed, cfg.learners]), cfg)
    n_steps = int(cfg.rounds * cfg.steps_per_round * (1 + max(cfg.slowdown, 0)) * 1.3) + 64
    while True:     # rounds throttled by τ take longer than planned: redraw with more steps
        try:
            return _decoupled(np.random.default_rng([seed, cfg.learners]), cfg, policy.quorum,
                              policy.grace, n_steps)
        except _OutOfSteps:
            n_steps *= 2
