"""What every system of a `ddloco compare --chaos/--hetero` shares (ddloco/compare/failures.py
says what the command does): the systems, the mixed-hardware spec, the seeded schedule, the
setting, and the figures computed from a run's record (goodput, targets, equal wall time).
"""
from __future__ import annotations

import random
import socket
from dataclasses import dataclass, field
from typing import Any, Sequence

from common.config import ConfigError, RunConfig
from ddloco.chaos_plan import ChaosSpec, Fault

ELASTIC = ("dp_elastic", "diloco_sync_elastic")
BOOT_ALLOWANCE_S = 20.0
"""``ddloco up``'s time cap is counted from its start: the cap plus this much for its boot."""
OURS = ("decoupled", "decoupled_lockstep", "decoupled_k1")
SIDE_SYSTEMS = (*ELASTIC, "torchft", *OURS)
CHAOS_DEFAULT = ("dp_elastic", "diloco_sync_elastic", "torchft", "decoupled", "decoupled_lockstep")
HETERO_DEFAULT = ("dp_elastic", "decoupled_lockstep", "decoupled_k1", "decoupled")
KEYS = ("goodput", "global_downtime_s", "wall_s_to_target", "eval_loss_at_wall", "eval_loss_final", "restarts",
        "tokens_lost", "bytes_per_token")
"""The figures of every system in compare.json (scripts depend on these names)."""


@dataclass(frozen=True)
class HeteroSpec:
    slow: int = -1
    """Learners that are slower (the last ones; -1: half)."""
    factor: float = 1.2
    noise: float = 0.1

    def factors(self, learners: int) -> list[float]:
        n = learners // 2 if self.slow < 0 else min(self.slow, learners)
        return [1.0] * (learners - n) + [self.factor] * n


def parse_hetero(text: str) -> HeteroSpec:
    """``"slow=2,factor=1.2,noise=0.1"`` → HeteroSpec; ConfigError naming a bad item."""
    values: dict[str, Any] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, raw = item.partition("=")
        if not sep or key.strip() not in ("slow", "factor", "noise"):
            raise ConfigError(f"--hetero: {item!r} is not key=value with a key among slow, factor, noise")
        try:
            v = int(raw) if key.strip() == "slow" else float(raw)
        except ValueError:
            raise ConfigError(f"--hetero: {key.strip()} must be a number, got {raw!r}") from None
        values[key.strip()] = v
    spec = HeteroSpec(**values)
    if spec.factor < 1.0 or not 0.0 <= spec.noise <= 1.0 or spec.slow < -1:
        raise ConfigError(f"--hetero: factor must be >= 1, noise in [0, 1], slow >= 0 (got {text!r})")
    return spec


def plan_schedule(spec: ChaosSpec, learners: int, nominal_s: float) -> list[Fault]:
    """The seeded schedule shared by every system: per rank a Poisson process of kills (mean
    ``learner_mtbf_s``) from 5 % of the failure-free duration ``nominal_s`` to 4 × it (a system
    slowed by its failures keeps meeting them at the same rate), and ``stalls`` stalls spread over
    15-80 % of ``nominal_s``. Targets are ``learner-<i>`` (rank i)."""
    rng = random.Random(spec.seed)
    out: list[Fault] = []
    if spec.learner_mtbf_s > 0:
        for i in range(learners):
            t = 0.05 * nominal_s + rng.expovariate(1.0 / spec.learner_mtbf_s)
            while t < 4 * nominal_s:
                out.append(Fault(round(t, 3), "learner_kill", f"learner-{i}"))
                t += rng.expovariate(1.0 / spec.learner_mtbf_s)
    for k in range(spec.stalls):
        t = nominal_s * (0.15 + 0.65 * (k + rng.uniform(0.2, 0.8)) / spec.stalls)
        out.append(Fault(round(t, 3), "stall", f"learner-{rng.randrange(learners)}"))
    return sorted(out, key=lambda f: f.at_s)


@dataclass
class Setting:
    """What every system of one comparison shares."""

    learners: int
    steps: int
    per_batch: int
    floor_ms: float
    factors: list[float]
    noise: float
    chaos: ChaosSpec | None
    checkpoint_every: int
    syncers: int
    insecure: bool
    device: str
    eval_every_s: float
    wall_cap: float = 3.0
    """A system still short of the budget this many failure-free durations after its first step is
    stopped there; its figures cover what it did until then (``capped``)."""
    stall_s: float = 20.0
    gap_s: float = 1.0
    """Global downtime: every gap longer than this between advances of the global model."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nominal_s(self) -> float:
        """The failure-free duration: steps × the slowest rank's emulated step time."""
        return self.steps * self.floor_ms / 1000.0 * max(self.factors)

    @property
    def cap_s(self) -> float:
        return self.wall_cap * self.nominal_s


def goodput_of(res: dict[str, Any], st: Setting) -> float:
    """Σ_r useful steps_r × the rank's emulated step time ÷ Σ_r provisioned time_r, a rank (a
    learner slot) provisioned from its first step to the end of its last process (ALGORITHM §9,
    as `ddloco up` counts it): a rank that waits for the others is provisioned and not useful,
    one whose budget is done is released. From a run's stored figures (also for reused runs)."""
    floor = st.floor_ms / 1000.0
    useful = provisioned = 0.0
    for r in range(st.learners):
        lid = f"learner-{r}"
        lanes = res["timeline"].get(lid) or []
        if not lanes:
            continue
        if res["system"] in (*ELASTIC, "torchft"):
            steps = (float(res["extra"]["committed"].get(lid, 0)) if res["system"] == "torchft"
                     else res["tokens"] / (st.learners * st.per_batch))
            start = min(a for a, _ in lanes) - floor * st.factors[r]   # lanes: step completions
        else:
            steps = float(res["extra"]["merged_steps"].get(lid, 0.0))
            start = min(a for a, _ in lanes)
        end = max(b for _, b in lanes)
        if res.get("capped"):
            end = max(end, res["span_s"])
        useful += steps * floor * st.factors[r]
        provisioned += max(1e-9, end - start)
    return round(useful / provisioned, 4) if provisioned else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _advances_downtime(times: Sequence[float], start: float, end: float, gap_s: float) -> float:
    """Seconds in gaps between advances of the training longer than ``gap_s`` or twice the run's
    usual interval between advances (the median gap, bursts within 50 ms counted as one advance),
    whichever is longer: lock-step merges every fragment in one burst per H steps, and that
    rhythm is not downtime."""
    from statistics import median
    inner = sorted(t for t in times if start <= t <= end)
    pts = [start, *inner, end]
    gaps = [b - a for a, b in zip(inner, inner[1:]) if b - a > 0.05]
    usual = median(gaps) if len(gaps) > 2 else 0.0
    limit = max(gap_s, 2 * usual)
    return sum(b - a for a, b in zip(pts, pts[1:]) if b - a > limit)


def with_targets(runs: list[dict[str, Any]], target: float) -> None:
    """``wall_s_to_target`` (first wall time the global model's loss ≤ target; None: never) and
    ``eval_loss_at_wall`` (at the seed's shortest span) of one seed's runs, in place."""
    w = min(r["span_s"] for r in runs)
    for r in runs:
        r["target_loss"] = target
        r["wall_s_to_target"] = next((t for t, loss in r["wall_curve"] if loss <= target), None)
        before = [loss for t, loss in r["wall_curve"] if t <= w + 1e-6]
        r["eval_loss_at_wall"] = before[-1] if before else r["wall_curve"][0][1]
        r["equal_wall_s"] = round(w, 2)


def meta_of(st: Setting, run: RunConfig) -> dict[str, Any]:
    """What ``ddloco.sim.replay`` needs of the setting (also in compare.json's meta)."""
    return {"learners": st.learners, "steps_per_learner": st.steps, "step_time_floor_ms": st.floor_ms,
            "factors": st.factors, "checkpoint_every": st.checkpoint_every,
            "sync_every_steps": run.algo.sync_every_steps, "cap_s": st.cap_s, "noise": st.noise}
