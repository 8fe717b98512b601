"""In-process systems of `ddloco compare` (the real cluster and DDP run as processes elsewhere).

- ``single``: one learner alone (data stream 0) at equal steps: ``steps`` inner steps.
- ``diloco_sync``: synchronous DiLoCo [lineage]: M replicas, every H steps every replica's
  outer gradient is averaged (plain mean over the whole model) and the outer optimizer steps.
- ``decoupled_emulated``: Decoupled DiLoCo's streaming rounds emulated deterministically in one
  process: fragment p opens every H steps at offset p·H/P, every learner answers with its
  quantized delta, the shard math of ``common.merge`` runs, and the merged value reaches the
  learners ``delay_steps`` steps later (the grace window and transport). Used for fast seeded
  sweeps of the outer optimizer and for the regression guard in the test suite; the real
  cluster (``ddloco up``) confirms what it finds.
- ``dp_emulated``: data-parallel as one model on the M streams' concatenated batches (the
  same mathematics as DDP with M ranks); for sweeps. ``ddloco compare`` runs real DDP.

Every system evaluates the global model on the task's fixed held-out batches at exact token
counts: after the same numbers of inner steps per learner (``eval_steps``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from common import quant
from common.config import AlgoConfig
from common.fragments import Fragment, gather, model_plan, scatter, state_tensors
from common.merge import Contribution, contribution_weights, outer_update, quantized_update, receive_merged
from common.task import Task, batch_to, build_model, count_tokens, evaluate, scalar_loss
from learner.inner import inner_step, make_inner_optimizer


@dataclass
class SystemResult:
    """One run of one system at one seed."""

    system: str
    seed: int
    learners: int
    steps: int
    """Inner steps per learner (DP: optimizer steps)."""
    tokens: int
    wall_s: float
    eval_loss_final: float
    curve: list[tuple[int, float]]
    """(tokens, global model's eval loss), starting at (0, initial loss)."""
    bytes_per_token: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"system": self.system, "seed": self.seed, "learners": self.learners, "steps": self.steps,
                "tokens": self.tokens, "wall_s": round(self.wall_s, 2), "eval_loss_final": self.eval_loss_final,
                "curve": [[t, l] for t, l in self.curve], "bytes_per_token": self.bytes_per_token,
                **({"extra": self.extra} if self.extra else {})}


def eval_steps(steps: int, points: int) -> list[int]:
    """Step counts (1..steps) at which to evaluate: ``points`` evenly spaced, always ``steps``."""
    return sorted({max(1, round(steps * k / points)) for k in range(1, points + 1)} | {steps})




def _set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)


def _train_alone(task: Task, algo: AlgoConfig, data: Iterator[Any], *, seed: int, steps: int,
                 eval_points: int, schedule_scale: int = 1,
                 device: torch.device | None = None) -> tuple[int, list[tuple[int, float]]]:
    """One model, ``steps`` AdamW steps on ``data``, evaluated at ``eval_steps``. The run's
    learning-rate schedule reads ``schedule_scale`` × this model's tokens as the global count
    (one learner alone at equal steps: M, so step t has the learning rate of every system's step t).
    ``device``: where the model and its steps live (None: the CPU)."""
    device = device or torch.device("cpu")
    model = build_model(task, seed).to(device)
    tokens = 0
    opt, sched = make_inner_optimizer(model.parameters(), algo, tokens=lambda: tokens * schedule_scale)
    marks = set(eval_steps(steps, eval_points))
    curve = [(0, evaluate(task, model))]
    model.train()
    for t in range(1, steps + 1):
        batch = next(data)
        inner_step(model, opt, sched, scalar_loss(task, model, batch_to(batch, device)), algo)
        tokens += count_tokens(task, batch)
        if t in marks:
            curve.append((tokens, evaluate(task, model)))
    return tokens, curve


def run_single(task: Task, algo: AlgoConfig, *, steps: int, seed: int, eval_points: int = 8,
               threads: int = 1, stream: int = 0, learners: int = 1,
               device: torch.device | None = None) -> SystemResult:
    """One learner alone: ``steps`` AdamW steps on data stream ``stream`` (its schedule at step t
    as for ``learners`` learners at step t)."""
    _set_threads(threads)
    t0 = time.perf_counter()
    tokens, curve = _train_alone(task, algo, task.batches(stream, seed, 0), seed=seed, steps=steps,
                                 eval_points=eval_points, schedule_scale=learners, device=device)
    return SystemResult("single", seed, 1, steps, tokens, time.perf_counter() - t0, curve[-1][1], curve)


class _ConcatBatches:
    """M streams' batches joined along the batch dimension (one DP step)."""

    def __init__(self, streams: list[Iterator[Any]]) -> None:
        self.streams = streams

    def __iter__(self) -> "_ConcatBatches":
        return self

    def __next__(self) -> Any:
        parts = [next(s) for s in self.streams]
        first = parts[0]
        return type(first)(inputs=torch.cat([p.inputs for p in parts]), targets=torch.cat([p.targets for p in parts]),
                           tokens=sum(p.tokens for p in parts))


def run_dp_emulated(task: Task, algo: AlgoConfig, *, learners: int, steps: int, seed: int,
                    eval_points: int = 8, threads: int = 1, device: torch.device | None = None) -> SystemResult:
    """Data-parallel mathematics in one process: one model, M streams' batches concatenated
    (the mean loss over the concatenation equals the mean of M equal ranks' mean losses)."""
    _set_threads(threads)
    t0 = time.perf_counter()
    data = _ConcatBatches([task.batches(m, seed, 0) for m in range(learners)])
    tokens, curve = _train_alone(task, algo, data, seed=seed, steps=steps, eval_points=eval_points, device=device)
    return SystemResult("dp_emulated", seed, learners, steps, tokens, time.perf_counter() - t0, curve[-1][1], curve)


@dataclass
class _Replica:
    model: torch.nn.Module
    params: dict[str, torch.Tensor]
    opt: torch.optim.Optimizer
    sched: Any
    data: Iterator[Any]


def _replicas(task: Task, algo: AlgoConfig, learners: int, seed: int,
              run_tokens: Callable[[], float], device: torch.device | None = None) -> list[_Replica]:
    out = []
    for m in range(learners):
        model = build_model(task, seed).to(device or torch.device("cpu"))
        model.train()
        opt, sched = make_inner_optimizer(model.parameters(), algo, tokens=run_tokens)
        out.append(_Replica(model, state_tensors(model), opt, sched,
                            task.batches(m, seed, 0)))
    return out


def _plan(task: Task, model: torch.nn.Module, fragments: int) -> tuple[Fragment, ...]:
    return model_plan(model, task.embedding_names, fragments)


def run_diloco_sync(task: Task, algo: AlgoConfig, *, learners: int, steps: int, seed: int,
                    eval_points: int = 8, threads: int = 1, device: torch.device | None = None) -> SystemResult:
    """Synchronous DiLoCo [lineage]: every H steps every replica answers with its whole model,
    outer gradients are averaged (plain mean, equal weights), the outer optimizer (η, μ,
    Nesterov from ``algo``) steps, every replica restarts from Θ. Inner AdamW state persists.
    ``device``: where the replicas train and the global model is evaluated (None: the CPU); the
    outer step runs on the CPU in fp32, as the shards' does."""
    _set_threads(threads)
    t0 = time.perf_counter()
    tokens = 0
    device = device or torch.device("cpu")
    reps = _replicas(task, algo, learners, seed, lambda: tokens, device)
    glob = build_model(task, seed).to(device)
    whole = _plan(task, glob, 1)[0]
    gparams = state_tensors(glob)
    theta = gather(gparams, whole)
    momentum = torch.zeros_like(theta)
    marks = set(eval_steps(steps, eval_points))
    curve = [(0, evaluate(task, glob))]
    H = algo.sync_every_steps
    syncs = 0
    pending_mark = False
    for t in range(1, steps + 1):
        for r in reps:
            batch = next(r.data)
            inner_step(r.model, r.opt, r.sched, scalar_loss(task, r.model, batch_to(batch, device)), algo)
            tokens += count_tokens(task, batch)
        pending_mark = pending_mark or t in marks
        if t % H == 0 or t == steps:
            outer = torch.stack([theta - gather(r.params, whole) for r in reps])        # [M, n]
            weights = torch.full((learners,), 1.0 / learners)
            theta, momentum = outer_update(theta, momentum, outer, weights, whole.spans, algo, merges_done=syncs,
                                           rule="mean")
            syncs += 1
            for r in reps:
                scatter(r.params, whole, theta)
            if pending_mark:
                scatter(gparams, whole, theta)
                curve.append((tokens, evaluate(task, glob)))
                pending_mark = False
    n = whole.numel
    bytes_per_token = syncs * learners * 2 * 4 * n / max(1, tokens)   # fp32 up and down
    return SystemResult("diloco_sync", seed, learners, steps, tokens, time.perf_counter() - t0, curve[-1][1],
                        curve, bytes_per_token, {"syncs": syncs})


class _EmulatedRounds:
    """The state of ``run_decoupled_emulated`` (one thread): the shards' fp32 masters, the
    learners' replicas, bases and contribution counters, and what crossed the network."""

    def __init__(self, task: Task, algo: AlgoConfig, *, learners: int, seed: int) -> None:
        self.task, self.algo = task, algo
        self.tokens = 0
        self.reps = _replicas(task, algo, learners, seed, lambda: self.tokens)
        self.glob = build_model(task, seed)
        self.gparams = state_tensors(self.glob)
        self.plan = plan = _plan(task, self.glob, algo.fragments)
        self.theta = [gather(self.gparams, f) for f in plan]                 # the shards' fp32 masters
        self.replica = [x.clone() for x in self.theta]                        # what every learner holds
        self.momentum = [torch.zeros_like(x) for x in self.theta]
        self.version = [0] * len(plan)
        self.history = [{0: x.clone()} for x in self.theta]
        self.base = [[(0, x.clone()) for x in self.theta] for _ in self.reps]  # per learner: (version, value)
        self.c_steps = [[0] * len(plan) for _ in self.reps]
        self.c_tokens = [[0] * len(plan) for _ in self.reps]
        self.answered: list[dict[int, Contribution]] = [{} for _ in self.reps]
        self.bytes_up = self.bytes_down = 0
        self.merges = 0

    def train_step(self) -> None:
        """Every learner's inner step; each step counts towards every fragment's contribution."""
        for m, r in enumerate(self.reps):
            batch = next(r.data)
            inner_step(r.model, r.opt, r.sched, scalar_loss(self.task, r.model, batch), self.algo)
            n_tok = count_tokens(self.task, batch)
            self.tokens += n_tok
            for p in range(len(self.plan)):
                self.c_steps[m][p] += 1
                self.c_tokens[m][p] += n_tok

    def deliver(self, p: int) -> None:
        algo, plan = self.algo, self.plan
        for m, r in enumerate(self.reps):
            value, self.c_steps[m][p], self.c_tokens[m][p] = receive_merged(
                self.replica[p], gather(r.params, plan[p]), self.base[m][p][1], self.answered[m].pop(p, None),
                self.c_steps[m][p], self.c_tokens[m][p], carry=algo.carry_local_steps, mix_alpha=algo.mix_alpha)
            scatter(r.params, plan[p], value)
            self.base[m][p] = (self.version[p], self.replica[p].clone())
            self.bytes_down += quant.payload_nbytes(plan[p].numel, algo.downlink_codec)

    def open_round(self, p: int) -> None:
        algo, plan, replica = self.algo, self.plan, self.replica
        outer, toks, stps = [], [], []
        for m, r in enumerate(self.reps):
            if self.c_steps[m][p] < 1:
                continue
            snap = gather(r.params, plan[p])
            bv, bval = self.base[m][p]
            delta = snap - bval                                                        # δ_m
            deq = quant.decode(quant.encode(delta, algo.uplink_codec), algo.uplink_codec, delta.numel())
            self.bytes_up += quant.payload_nbytes(delta.numel(), algo.uplink_codec)
            outer.append(replica[p] - (self.history[p][bv] + deq))                     # Δ_m (vs the replica)
            toks.append(self.c_tokens[m][p])
            stps.append(self.c_steps[m][p])
            self.answered[m][p] = Contribution(snap, self.c_steps[m][p], self.c_tokens[m][p])
        if not outer:
            return
        weights = contribution_weights(toks, stps)
        self.theta[p], self.momentum[p] = outer_update(self.theta[p], self.momentum[p], torch.stack(outer), weights,
                                                       plan[p].spans, algo, merges_done=self.version[p])
        if algo.downlink_codec == "fp32":
            replica[p] = self.theta[p].clone()
        else:   # the shard's update downlink (ALGORITHM §7): replicas += deq(q(master − replica))
            replica[p], _ = quantized_update(replica[p], self.theta[p], algo.downlink_codec)
        self.version[p] += 1
        self.history[p][self.version[p]] = replica[p].clone()
        for v in sorted(self.history[p])[:-algo.history_versions]:
            del self.history[p][v]
        self.merges += 1

    def global_loss(self) -> float:
        """The global model as the shards serve it (the replicas' value), evaluated."""
        for p, f in enumerate(self.plan):
            scatter(self.gparams, f, self.replica[p])
        return evaluate(self.task, self.glob)


def run_decoupled_emulated(task: Task, algo: AlgoConfig, *, learners: int, steps: int, seed: int,
                           eval_points: int = 8, threads: int = 1, delay_steps: int = 2) -> SystemResult:
    """Decoupled DiLoCo's rounds, deterministic and in one process (see the module docstring).

    At each step boundary: merged fragments due now are applied by every learner (overwrite,
    or carry of uncontributed steps with ``algo.carry_local_steps``), then fragments due to open
    are answered by every learner (delta against its base, through ``algo.uplink_codec``),
    merged with the shard's math (weights, RDA/mean, outer step) and scheduled to arrive
    ``delay_steps`` boundaries later. At the end every fragment is flushed once."""
    _set_threads(threads)
    H = algo.sync_every_steps
    if not 0 <= delay_steps < H:
        raise ValueError(f"delay_steps must be in [0, H={H}), got {delay_steps}")
    t0 = time.perf_counter()
    em = _EmulatedRounds(task, algo, learners=learners, seed=seed)
    fragments = range(len(em.plan))
    in_flight: list[tuple[int, int]] = []                              # (deliver at boundary, fragment)
    offsets = [(p * H) // len(em.plan) for p in fragments]
    marks = set(eval_steps(steps, eval_points))
    curve = [(0, evaluate(task, em.glob))]
    for t in range(1, steps + 1):
        em.train_step()
        for due in [x for x in in_flight if x[0] <= t]:
            in_flight.remove(due)
            em.deliver(due[1])
        if t < steps:
            for p in fragments:
                if t >= offsets[p] and (t - offsets[p]) % H == 0 and t > 0:
                    em.open_round(p)
                    in_flight.append((t + delay_steps, p))
        else:  # the budget is spent: every learner's remaining steps are merged once (a flush)
            for _, p in sorted(in_flight):
                em.deliver(p)
            in_flight.clear()
            for p in fragments:
                em.open_round(p)
                em.deliver(p)
        if t in marks:
            curve.append((em.tokens, em.global_loss()))
    return SystemResult("decoupled_emulated", seed, learners, steps, em.tokens, time.perf_counter() - t0,
                        curve[-1][1], curve, (em.bytes_up + em.bytes_down) / max(1, em.tokens),
                        {"merges": em.merges, "delay_steps": delay_steps})
