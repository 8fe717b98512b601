"""WAN bandwidth needed to keep compute utilisation >= u: data-parallel vs Decoupled DiLoCo.

Data-parallel: every step, a ring all-reduce of the gradients sends (and receives)
``2·(n−1)/n ≈ 2`` times the parameters per participant. The all-reduce can hide behind a
fraction ``dp_overlap`` of the step (the backward pass, with gradient bucketing); whatever is
left is exposed, and utilisation = step / (step + exposed) >= u allows ``step·(1/u − 1)`` of
exposure. So the all-reduce must finish within ``step·(dp_overlap + 1/u − 1)``.

Decoupled DiLoCo: a learner sends one fragment (params/P) of deltas every H/P steps and
receives the merged fragment as often (ALGORITHM.md §2, §7; full-duplex link, same codec both
ways: the downlink carries the quantized update). The transfer overlaps compute: a learner only
needs a fragment τ·H/P steps after sending it, so the link must (a) sustain params·bits per H
steps, with a step allowed to stretch to step/u, and (b) move one fragment within its
τ·H/P-step window. The binding one is reported.

Bits per parameter: fp32 32, bf16 16, int8 8.25, int4 4.25 (blockwise absmax, one 16-bit scale
per 64 values, ALGORITHM.md §7).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

CODEC_BITS: dict[str, float] = {"fp32": 32.0, "bf16": 16.0, "int8": 8.0 + 16 / 64,
                                "int4": 4.0 + 16 / 64}
"""Bits on the wire per parameter, scales included."""

PAPER_GBIT_S: dict[tuple[str, str], float] = {("dp", "bf16"): 104.0, ("diloco", "bf16"): 1.7,
                                              ("diloco", "int4"): 0.43}
"""The paper's reported bandwidths at 1 s steps (ALGORITHM.md §9), keyed (method, codec)."""


@dataclass(frozen=True, kw_only=True)
class BandwidthConfig:
    """Model size, step time and schedule (defaults: the paper's setting, README.md "The calibration")."""

    params: float = 2.8e9
    """Parameters of the model (2.8e9 is what the paper's figures imply, README.md "The calibration")."""
    step_s: float = 1.0
    """Compute time of one training step."""
    fragments: int = 24
    """P: fragments."""
    sync_every_steps: int = 24
    """H: steps between two merges of one fragment."""
    tau: int = 2
    """τ: a fragment's transfer may overlap τ·H/P steps."""
    utilisation: float = 0.9
    """u: compute utilisation to keep."""
    dp_overlap: float = 0.75
    """Fraction of a data-parallel step the all-reduce hides behind (backward pass) [ours]."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.params) and self.params > 0):
            raise ValueError(f"params must be > 0, got {self.params}")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"step_s must be > 0, got {self.step_s}")
        if self.fragments < 1 or self.sync_every_steps < 1 or self.tau < 1:
            raise ValueError("fragments, sync_every_steps and tau must be >= 1")
        if not 0.0 < self.utilisation <= 1.0:
            raise ValueError(f"utilisation must be in (0, 1], got {self.utilisation}")
        if not 0.0 <= self.dp_overlap <= 1.0:
            raise ValueError(f"dp_overlap must be in [0, 1], got {self.dp_overlap}")
        if self.dp_window_s <= 0:
            raise ValueError("dp_overlap = 0 with utilisation = 1 leaves no time for the all-reduce")

    @property
    def dp_window_s(self) -> float:
        """Time a data-parallel all-reduce may take: step·(overlap + 1/u − 1)."""
        return self.step_s * (self.dp_overlap + 1.0 / self.utilisation - 1.0)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def dp_bits_per_s(cfg: BandwidthConfig, codec: str) -> float:
    """Data-parallel: 2·params·bits per step within the all-reduce window."""
    return 2.0 * cfg.params * CODEC_BITS[codec] / cfg.dp_window_s


def diloco_bits_per_s(cfg: BandwidthConfig, codec: str) -> float:
    """Decoupled DiLoCo, per learner and direction: max(sustained, one fragment within τ·H/P)."""
    bits = cfg.params * CODEC_BITS[codec]
    sustained = bits * cfg.utilisation / (cfg.sync_every_steps * cfg.step_s)
    window = bits / cfg.fragments / (cfg.tau * cfg.sync_every_steps / cfg.fragments * cfg.step_s)
    return max(sustained, window)


def required_bits_per_s(cfg: BandwidthConfig, method: str, codec: str) -> float:
    if codec not in CODEC_BITS:
        raise ValueError(f"codec must be one of {sorted(CODEC_BITS)}, got {codec!r}")
    if method == "dp":
        return dp_bits_per_s(cfg, codec)
    if method == "diloco":
        return diloco_bits_per_s(cfg, codec)
    raise ValueError(f"method must be 'dp' or 'diloco', got {method!r}")


def implied_params(cfg: BandwidthConfig, method: str, codec: str, gbit_s: float) -> float:
    """Model size at which this model needs ``gbit_s`` (bandwidth is linear in params)."""
    per_param = required_bits_per_s(cfg, method, codec) / cfg.params
    return gbit_s * 1e9 / per_param


def assumptions(cfg: BandwidthConfig) -> list[str]:
    """The model's assumptions, printed with every result."""
    h_over_p = cfg.sync_every_steps / cfg.fragments
    return [
        f"model: {cfg.params:.3g} parameters, {cfg.step_s:g} s compute per step, "
        f"target compute utilisation {cfg.utilisation:.0%}",
        "data-parallel: ring all-reduce of the gradients every step, 2(n-1)/n ~ 2 x params per "
        "participant and direction",
        f"data-parallel: the all-reduce hides behind {cfg.dp_overlap:.0%} of the step (backward "
        f"pass); exposed time <= step x (1/u - 1), so it must finish in {cfg.dp_window_s:.3f} s",
        f"Decoupled DiLoCo: one fragment (params/P, P={cfg.fragments}) up and one merged fragment "
        f"down every H/P = {h_over_p:g} steps (H={cfg.sync_every_steps}); same codec both ways; "
        "full-duplex link, figure is per learner and per direction",
        f"Decoupled DiLoCo: transfers overlap compute; the link must sustain params x bits per H "
        f"steps (a step may stretch to step/u) and move a fragment within tau x H/P = "
        f"{cfg.tau * h_over_p:g} steps (tau={cfg.tau}); the larger of the two is reported",
        "bits per parameter: " + ", ".join(f"{k} {v:g}" for k, v in CODEC_BITS.items())
        + " (int: blockwise absmax, one 16-bit scale per 64 values)",
        "the syncer's ingress is M x the per-learner uplink figure (sharded over S syncers)",
    ]
