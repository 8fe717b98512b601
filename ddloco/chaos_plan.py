"""The chaos harness's schedule: ``--chaos SPEC`` parsed (``parse_chaos``) and the seeded faults
drawn from it (``plan_faults``). Pure: the same spec, duration and cluster give the same schedule;
ddloco/chaos.py injects it into a running cluster and says what each key means.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any, Sequence

from common.config import ConfigError

KINDS = ("learner_kill", "stall", "shard_kill", "shard_wipe", "broker_restart", "redis_restart")


@dataclass(frozen=True)
class ChaosSpec:
    seed: int = 0
    learner_mtbf_s: float = 0.0
    stalls: int = 0
    stall_s: float = 20.0
    shard_kills: int = 0
    shard_wipes: int = 0
    broker_restarts: int = 0
    redis_restarts: int = 0

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def parse_chaos(text: str) -> ChaosSpec:
    """``"seed=7,learner_mtbf_s=60,..."`` -> ChaosSpec; ConfigError naming a bad key or value."""
    types = {f.name: f.type for f in fields(ChaosSpec)}
    values: dict[str, Any] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in types:
            raise ConfigError(f"--chaos: {item!r} is not key=value with a key among {', '.join(types)}")
        conv = int if types[key] in ("int", int) else float
        try:
            v = conv(raw.strip())
        except ValueError:
            raise ConfigError(f"--chaos: {key} must be {'an integer' if conv is int else 'a number'}, "
                              f"got {raw.strip()!r}") from None
        if v < 0:
            raise ConfigError(f"--chaos: {key} must be >= 0, got {v}")
        values[key] = v
    spec = ChaosSpec(**values)
    if spec.stalls and spec.stall_s <= 0:
        raise ConfigError("--chaos: stall_s must be > 0 when stalls > 0")
    return spec


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    target: str
    """A learner id, ``shard<k>``, ``broker`` or ``redis``."""


def plan_faults(spec: ChaosSpec, *, duration_s: float, learners: Sequence[str], shards: int) -> list[Fault]:
    """The seeded schedule: learner kills as a Poisson process per learner (mean ``learner_mtbf_s``)
    from 5 % to 85 % of the run, the other faults spread between 15 % and 80 % of it. The same
    spec, duration and cluster give the same schedule."""
    rng = random.Random(spec.seed)
    out: list[Fault] = []
    lo, hi = 0.05 * duration_s, 0.85 * duration_s
    if spec.learner_mtbf_s > 0:
        for lid in learners:
            t = lo + rng.expovariate(1.0 / spec.learner_mtbf_s)
            while t < hi:
                out.append(Fault(round(t, 3), "learner_kill", lid))
                t += rng.expovariate(1.0 / spec.learner_mtbf_s)
    others = ([("stall", None)] * spec.stalls + [("shard_kill", None)] * spec.shard_kills
              + [("shard_wipe", None)] * spec.shard_wipes + [("broker_restart", "broker")] * spec.broker_restarts
              + [("redis_restart", "redis")] * spec.redis_restarts)
    rng.shuffle(others)
    n = len(others)
    a, b = 0.15 * duration_s, 0.80 * duration_s
    for i, (kind, target) in enumerate(others):  # one per slot of the window, jittered inside it
        t = a + (b - a) * (i + rng.uniform(0.2, 0.8)) / max(n, 1)
        if kind == "stall":
            target = rng.choice(list(learners))
        elif kind in ("shard_kill", "shard_wipe"):
            target = f"shard{rng.randrange(max(shards, 1))}"
        out.append(Fault(round(t, 3), kind, str(target)))
    return sorted(out, key=lambda f: f.at_s)
