"""``make gpu-quality``'s plan: the sizes of the built-in GPT, their parameters and FLOPs, what a
machine does per second, and the tokens each size trains inside the budget (pure, standard
library only: ddloco.bench.gpu_quality runs before the wheels are installed)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Sequence

LEARNERS = 4
"""M of every system."""
VOCAB = 256
"""The gpt task's byte vocabulary (tied head)."""
MAX_TOKENS_PER_PARAM = 20.0
"""Chinchilla's 20 tokens per parameter: the published points' budget and our ceiling."""
NAMED_SIZES = {"xs": "2x32", "s": "6x64", "m": "6x192", "l": "6x384", "xl": "8x512", "xxl": "12x768"}
"""Named sizes (``n_layer x n_embd``); n_head is 4 unless given as ``LxDhH``."""
PUBLISHED = (
    (35e6, 1.020, "DiLoCo M=4 (Charles et al. 2025)"),
    (90e6, 1.015, "DiLoCo M=4 (Charles et al. 2025)"),
    (35e6, 1.026, "Streaming DiLoCo"),
    (100e6, 1.019, "Streaming DiLoCo"),
)
"""(parameters, eval loss ÷ DP's, source) at 20 tokens per parameter, H = 30."""
SYSTEMS = ("dp_emulated", "diloco_sync", "decoupled")
OUT_FILES = ("quality.json", "quality.md", "quality.png", "quality_logs.tar.gz")
LOG_FILE_LIMIT = 2_000_000
"""Bytes: larger files (checkpoints, models) stay out of the logs archive."""


class QualityError(Exception):
    """Bad input: one line for the user."""


# ------------------------------------------------------------------------------------ sizes
@dataclass(frozen=True)
class Size:
    """One model size of the gpt task."""

    n_layer: int
    n_embd: int
    n_head: int = 4

    @property
    def name(self) -> str:
        return f"{self.n_layer}x{self.n_embd}" + ("" if self.n_head == 4 else f"h{self.n_head}")

    def sets(self) -> list[str]:
        """``ddloco compare --set`` arguments of this size."""
        return [f"task.n_layer={self.n_layer}", f"task.n_embd={self.n_embd}", f"task.n_head={self.n_head}"]


def parse_size(text: str) -> Size:
    """``m`` (named), ``6x192`` or ``6x192h3`` (n_layer x n_embd, n_head 4 unless ``hH``)."""
    raw = NAMED_SIZES.get(text.strip().lower(), text.strip().lower())
    m = re.fullmatch(r"(\d+)x(\d+)(?:h(\d+))?", raw)
    if not m:
        raise QualityError(f"size {text!r}: give a name ({', '.join(NAMED_SIZES)}) or LAYERSxWIDTH[hHEADS], e.g. 6x192")
    size = Size(int(m.group(1)), int(m.group(2)), int(m.group(3) or 4))
    if min(size.n_layer, size.n_embd, size.n_head) < 1 or size.n_embd % size.n_head:
        raise QualityError(f"size {text!r}: layers, width and heads must be >= 1 and heads must divide the width")
    return size


def parse_sizes(text: str) -> list[Size]:
    """A comma list of sizes, sorted by parameters (smallest first), without repeats."""
    sizes = {parse_size(t) for t in text.split(",") if t.strip()}
    if not sizes:
        raise QualityError("--sizes is empty")
    return sorted(sizes, key=lambda s: (param_count(s, 64), s.name))


def param_count(size: Size, seq_len: int) -> int:
    """Parameters of the gpt task's model: per block 12·d² (q, k, v, proj, 4× MLP; no biases)
    and two LayerNorms, the token and position embeddings (the head is tied), the final LayerNorm."""
    d, n = size.n_embd, size.n_layer
    return n * (12 * d * d + 4 * d) + VOCAB * d + seq_len * d + 2 * d


def train_flops(params: int, tokens: int) -> float:
    """6·N·D: forward and backward of N parameters over D tokens (attention's own term left out)."""
    return 6.0 * params * tokens


# ------------------------------------------------------------------------------------ cost model
@dataclass(frozen=True)
class Machine:
    """What a stage costs on one kind of machine (effective, not peak, figures)."""

    name: str
    flops_per_s: float
    """Training FLOP/s one process reaches at these sizes (the GPU's is shared by every process)."""
    shared: bool
    """True: the device's FLOP/s are shared by the lane's processes (one GPU); False: each
    process has its own core."""
    step_s: float
    """Per inner step overhead of an in-process system (Python, launches, AdamW, the batch)."""
    learner_step_s: float
    """Per step overhead of a cluster learner (its threads, the exchange)."""
    compare_start_s: float
    """``ddloco compare`` start (imports, corpus, CUDA contexts of the workers, evaluations)."""
    cluster_start_s: float
    """One ``ddloco up``: Redis, broker, shards, learners (CUDA contexts), first and final evaluation, stop."""


GPU = Machine("cuda", flops_per_s=40e12, shared=True, step_s=0.008, learner_step_s=0.015,
              compare_start_s=10.0, cluster_start_s=25.0)
"""An H100/H200 with fp32 weights and TF32 matmuls: ~40 TFLOP/s effective (8 % of TF32 dense
peak, 5 % of bf16's ~790; small matrices, launch-bound), 8 ms a step in process, 15 ms a learner
step, 25 s per cluster (4 CUDA contexts at 3-5 s each, Redis, shards, the first and last
evaluation on the CPU, stop)."""
CPU = Machine("cpu", flops_per_s=3.0e10, shared=False, step_s=0.004, learner_step_s=0.010,
              compare_start_s=5.0, cluster_start_s=12.0)
"""This project's CPU, one thread per process: 30-45 GFLOP/s measured (docs/gpu.md)."""


@dataclass(frozen=True)
class Profile:
    """The sweep's shape: batch geometry, sizes, seeds."""

    sizes: tuple[Size, ...]
    seq_len: int
    batch_size: int
    seeds: int
    """Seeds of the in-process systems at every size below the largest (the largest gets one)."""
    cluster_seeds: int
    """Seeds of the cluster per size, each in a lane of its own, the lanes side by side (no more
    than the in-process systems' seeds at that size: one at the largest)."""
    eval_points: int
    min_steps: int
    """A size whose budget gives fewer steps than this is left out (reported)."""
    cluster_fragments: int = 4
    """Fragments of the cluster (``algo.fragments``; the in-process systems sync the whole model).
    Its learners step every 14-25 ms on a shared GPU, and each shard must merge F ÷ (S · H · step)
    rounds a second, at most min(τ, F ÷ S) of them in flight (a fragment is never reopened while
    in flight). At the default 24 fragments that asked each of the two shards for ~50 merges a
    second at 20 ms steps, where an H200 run's rounds (~0.21 s each, 2 in flight) allowed ~9.5:
    95 % of merges behind schedule at 10.8 M parameters (docs/results/gpu.md). Four ask ~8.3 with
    2 in flight (two: ~4.2 with 1): little headroom; quality.md marks a size that fell behind."""
    cluster_step_floor_ms: float | None = None
    """Every cluster learner's step takes at least this long (``ddloco compare --step-time-floor-ms``).
    Four learners sharing one GPU step unevenly (an H200 run: 10-28 ms within one run at 2.7 M and
    10.8 M parameters), so the slow ones' answers missed the rounds the fast ones closed (21-39 %
    late, 78 % of the steps merged at 10.8 M): a real cluster's GPUs each step at their own steady
    pace. A floor above every learner's own step gives them one pace, and rounds time to spare
    (at 60 ms, 4 fragments, 2 shards and H = 12, each shard is asked ~2.8 merges a second).
    None: no floor."""

    def tokens_per_step(self) -> int:
        """Tokens of one global step: M learners × batch × sequence."""
        return LEARNERS * self.batch_size * self.seq_len

    def seeds_at(self, i: int, lane: str = "inproc") -> int:
        """Seeds of size i: the in-process systems' (one at the largest of several sizes), the
        cluster's no more than those (a cluster seed without a dp_emulated run has no ratio)."""
        inproc = 1 if i == len(self.sizes) - 1 and len(self.sizes) > 1 else self.seeds
        return min(self.cluster_seeds, inproc) if lane == "cluster" else inproc

    def seeds_per_lane(self, i: int, lane: str) -> int:
        """How many seeds one lane runs at size i: the in-process lane every seed at once, a
        cluster lane one."""
        return 1 if lane == "cluster" else self.seeds_at(i)


FULL = Profile(sizes=tuple(parse_sizes("s,m,l")), seq_len=128, batch_size=64, seeds=2, cluster_seeds=2,
               eval_points=4, min_steps=24, cluster_step_floor_ms=60.0)
DRY = Profile(sizes=tuple(parse_sizes("1x16,1x24,1x32")), seq_len=16, batch_size=2, seeds=2, cluster_seeds=2,
              eval_points=2, min_steps=8, cluster_step_floor_ms=20.0)
DRY_TOKENS_PER_PARAM = 0.5


def lane_cost(machine: Machine, lane: str, params: int, tokens: int, seeds: int, profile: Profile
              ) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of one stage: ``inproc`` runs dp_emulated and
    diloco_sync for every seed at once; ``cluster`` runs one ``ddloco up`` per seed."""
    del tokens   # the cost is affine in the tokens: (fixed, per token)
    per_step_tokens = profile.tokens_per_step()
    flop_s = 6.0 * params / machine.flops_per_s                       # seconds of compute per token
    if lane == "inproc":
        jobs = 2 * seeds                                               # each job trains every token once
        compute = flop_s * jobs if machine.shared else flop_s * jobs / min(jobs, os.cpu_count() or 1)
        overhead = (machine.step_s * (1 + LEARNERS)) / per_step_tokens   # diloco_sync: M steps per step
        return machine.compare_start_s, (compute + overhead)
    # a global step (every learner's batch) takes the learners' compute, or the floor if longer
    compute = flop_s if machine.shared else flop_s / min(LEARNERS, os.cpu_count() or 1)
    overhead = machine.learner_step_s / per_step_tokens
    floor = (profile.cluster_step_floor_ms or 0.0) / 1000.0 / per_step_tokens
    return machine.compare_start_s + machine.cluster_start_s * seeds, max(compute + overhead, floor) * seeds


@dataclass(frozen=True)
class SizePlan:
    size: str
    n_layer: int
    n_embd: int
    n_head: int
    params: int
    tokens: int
    steps: int
    tokens_per_param: float
    seeds: int
    """Seeds of dp_emulated and diloco_sync."""
    cluster_seeds: int
    est_s: dict[str, float]
    """Estimated seconds per lane at this plan."""
    flops: float


def plan(profile: Profile, machine: Machine, lane_s: float, *, max_tpp: float = MAX_TOKENS_PER_PARAM,
         equal: bool = False) -> tuple[list[SizePlan], list[str]]:
    """Tokens per size: each lane's time after its fixed costs is shared by the sizes in the
    ratio 1 : 2 : 3 ... (smallest first: the larger sizes need more); a size never trains more
    than ``max_tpp`` tokens per parameter (its unused share goes to the others) and both lanes
    train a size on the same tokens (the slower lane's). ``equal``: every size the same tokens
    per parameter instead, the most that fits (size alone changes along the sweep). A size under
    ``min_steps`` steps is left out, largest first (the smallest alone is kept at ``min_steps``,
    said over budget).
    Returns the plans and the notes on what was cut."""
    notes: list[str] = []
    sizes = list(profile.sizes)
    step = profile.tokens_per_step()
    while sizes:
        prof = replace(profile, sizes=tuple(sizes))
        fit = _equal_tokens if equal else _fit_tokens
        tokens = fit(prof, machine, lane_s, max_tpp)
        steps = [int(t // step) for t in tokens]
        if min(steps) >= profile.min_steps:
            break
        if len(sizes) == 1:
            notes.append(f"over budget: {sizes[0].name} at {profile.min_steps} steps does not fit {lane_s:.0f} s "
                         f"per lane; the stage timeouts cut what does not finish")
            steps = [profile.min_steps]
            break
        notes.append(f"size {sizes[-1].name} left out: the budget gives some size fewer than "
                     f"{profile.min_steps} steps in {lane_s:.0f} s per lane")
        sizes.pop()
    else:
        return [], notes
    plans = _size_plans(prof, machine, steps)
    capped = [p.size for p in plans if p.tokens_per_param >= max_tpp * 0.95]
    notes.append(f"tokens per parameter: " + ", ".join(f"{p.size} {p.tokens_per_param:.2f}" for p in plans)
                 + f" (ceiling {max_tpp:g}; {lane_s:.0f} s per lane{'; at the ceiling: ' + ', '.join(capped) if capped else ''})")
    return plans, notes


def _equal_tokens(prof: Profile, machine: Machine, lane_s: float, max_tpp: float) -> list[float]:
    """Per size, R × its parameters for the largest R (at most ``max_tpp``) that every lane fits
    in ``lane_s``."""
    params = [param_count(s, prof.seq_len) for s in prof.sizes]
    r = max_tpp
    for lane in ("inproc", "cluster"):
        costs = [lane_cost(machine, lane, p, 0, prof.seeds_per_lane(i, lane), prof) for i, p in enumerate(params)]
        per_r = sum(p * c for p, (_, c) in zip(params, costs))
        r = min(r, max(0.0, lane_s - sum(a for a, _ in costs)) / per_r)
    return [r * p for p in params]


def _fit_tokens(prof: Profile, machine: Machine, lane_s: float, max_tpp: float) -> list[float]:
    """Per size, the tokens both lanes fit in their shares of ``lane_s`` (see ``plan``)."""
    params = [param_count(s, prof.seq_len) for s in prof.sizes]
    best = [max_tpp * p for p in params]
    for lane in ("inproc", "cluster"):
        costs = [lane_cost(machine, lane, p, 0, prof.seeds_per_lane(i, lane), prof) for i, p in enumerate(params)]
        avail = lane_s - sum(a for a, _ in costs)
        weights = [float(i + 1) for i in range(len(params))]
        tokens = [0.0] * len(params)
        open_ = set(range(len(params)))
        for _ in range(len(params)):          # hand out the time; a size at its ceiling returns the rest
            if avail <= 0 or not open_:
                break
            total_w = sum(weights[i] for i in open_)
            spent = 0.0
            for i in sorted(open_):
                share = avail * weights[i] / total_w
                t = min(best[i] - tokens[i], share / costs[i][1])
                tokens[i] += t
                spent += t * costs[i][1]
                if tokens[i] >= best[i] * 0.999:
                    open_.discard(i)
            avail -= spent
        best = [min(b, t) for b, t in zip(best, tokens)]
    return best


def _size_plans(prof: Profile, machine: Machine, steps: Sequence[int]) -> list[SizePlan]:
    step = prof.tokens_per_step()
    out = []
    for i, (s, n) in enumerate(zip(prof.sizes, steps)):
        p = param_count(s, prof.seq_len)
        est = {}
        for lane in ("inproc", "cluster"):
            a, b = lane_cost(machine, lane, p, n * step, prof.seeds_per_lane(i, lane), prof)
            est[lane] = round(a + b * n * step, 1)
        out.append(SizePlan(s.name, s.n_layer, s.n_embd, s.n_head, p, n * step, n, round(n * step / p, 3),
                            prof.seeds_at(i), prof.seeds_at(i, "cluster"), est, train_flops(p, n * step)))
    return out
