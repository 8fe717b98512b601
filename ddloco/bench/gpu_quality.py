"""``make gpu-quality OUT=DIR``: quality with scale (issue 34) on one GPU in a few minutes.

    python3 -m ddloco.bench.gpu_quality OUT [--dry] [--budget-s 240] [--sizes s,m,l] [--seeds 2]
                                            [--only inproc|cluster] [--tokens-per-param R]

A size sweep of the built-in ``gpt`` task through ``ddloco compare``, M = 4 learners, three
systems at equal tokens: ``dp_emulated`` (data-parallel mathematics in one process: the M
streams' batches in one step), ``diloco_sync`` (synchronous DiLoCo in one process) and
``decoupled`` (the real cluster, ``ddloco up --insecure``: 4 learner processes sharing the GPU,
the shards on the CPU cores). Every size trains the same tokens per parameter R, the largest
that lets both lanes end inside the budget (at most 20, Chinchilla's); the plan says which.

Standard library only at import time: it first calls ``gpu_env.prepare`` (wheels, C kernels),
then runs every stage as a subprocess of ``sys.executable`` with that environment. Two lanes run
side by side, sizes smallest first: the in-process systems (one ``ddloco compare`` per size,
every seed and system at once) and the cluster (one ``ddloco compare --systems decoupled`` per
size). Each stage has its own timeout from the plan, capped by the budget's end; a stage that
fails or times out is recorded and the lane goes on. After every stage OUT gets (at most four
flat files): ``quality.json`` (every figure), ``quality.md`` (the table), ``quality.png``
(ratio to DP vs parameters with the published points) and ``quality_logs.tar.gz`` (the stages'
logs, the plan, env.json). ``--dry`` runs the same stages on the CPU at tiny sizes in seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

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
    """Seeds of the cluster at every size (each is one ``ddloco up``: ~30 s of start and stop on a GPU)."""
    eval_points: int
    min_steps: int
    """A size whose budget gives fewer steps than this is left out (reported)."""

    def tokens_per_step(self) -> int:
        """Tokens of one global step: M learners × batch × sequence."""
        return LEARNERS * self.batch_size * self.seq_len

    def seeds_at(self, i: int, lane: str = "inproc") -> int:
        if lane == "cluster":
            return self.cluster_seeds
        return 1 if i == len(self.sizes) - 1 and len(self.sizes) > 1 else self.seeds


FULL = Profile(sizes=tuple(parse_sizes("s,m,l")), seq_len=128, batch_size=64, seeds=2, cluster_seeds=1,
               eval_points=4, min_steps=24)
DRY = Profile(sizes=tuple(parse_sizes("1x16,1x24,1x32")), seq_len=16, batch_size=2, seeds=2, cluster_seeds=1,
              eval_points=2, min_steps=8)
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
    compute = flop_s * seeds if machine.shared else flop_s * seeds / min(LEARNERS, os.cpu_count() or 1)
    overhead = machine.learner_step_s * seeds / per_step_tokens
    return machine.compare_start_s + machine.cluster_start_s * seeds, compute + overhead


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


def plan(profile: Profile, machine: Machine, lane_s: float, *, max_tpp: float = MAX_TOKENS_PER_PARAM
         ) -> tuple[list[SizePlan], list[str]]:
    """Tokens per size: each lane's time after its fixed costs is shared by the sizes in the
    ratio 1 : 2 : 3 ... (smallest first: the larger sizes need more); a size never trains more
    than ``max_tpp`` tokens per parameter (its unused share goes to the others) and both lanes
    train a size on the same tokens (the slower lane's). A size under ``min_steps`` steps is left
    out, largest first (the smallest alone is kept at ``min_steps``, said over budget).
    Returns the plans and the notes on what was cut."""
    notes: list[str] = []
    sizes = list(profile.sizes)
    step = profile.tokens_per_step()
    while sizes:
        prof = replace(profile, sizes=tuple(sizes))
        tokens = _fit_tokens(prof, machine, lane_s, max_tpp)
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


def _fit_tokens(prof: Profile, machine: Machine, lane_s: float, max_tpp: float) -> list[float]:
    """Per size, the tokens both lanes fit in their shares of ``lane_s`` (see ``plan``)."""
    params = [param_count(s, prof.seq_len) for s in prof.sizes]
    best = [max_tpp * p for p in params]
    for lane in ("inproc", "cluster"):
        costs = [lane_cost(machine, lane, p, 0, prof.seeds_at(i, lane), prof) for i, p in enumerate(params)]
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
            a, b = lane_cost(machine, lane, p, n * step, prof.seeds_at(i, lane), prof)
            est[lane] = round(a + b * n * step, 1)
        out.append(SizePlan(s.name, s.n_layer, s.n_embd, s.n_head, p, n * step, n, round(n * step / p, 3),
                            prof.seeds_at(i), prof.seeds_at(i, "cluster"), est, train_flops(p, n * step)))
    return out


# ------------------------------------------------------------------------------------ results
def collect(stage_dirs: Iterable[tuple[str, Path, int]]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{size: {system: {seed: run}}} from the stages' ``runs/SYSTEM-sSEED.json``; a cluster run
    whose compare record is missing is read from its own report.json when it trained the whole
    budget (a failure after the report, e.g. a plot, loses nothing). ``stage_dirs``: (size,
    directory, the size's planned tokens)."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for size, d, tokens in stage_dirs:
        runs = d / "runs"
        if not runs.is_dir():
            continue
        for f in sorted(runs.glob("*-s*.json")):
            m = re.fullmatch(r"(.+)-s(\d+)\.json", f.name)
            try:
                r = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if m and _finite(r.get("eval_loss_final")) and r.get("tokens") == tokens:
                out.setdefault(size, {}).setdefault(m.group(1), {})[m.group(2)] = _slim(r)
        for rep in sorted(runs.glob("decoupled-s*/report.json")):
            seed = rep.parent.name.rsplit("-s", 1)[1]
            if seed in out.get(size, {}).get("decoupled", {}):
                continue
            r = _from_report(rep, tokens)
            if r is not None:
                out.setdefault(size, {}).setdefault("decoupled", {})[seed] = r
    return out


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _slim(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("eval_loss_final", "tokens", "steps", "wall_s", "bytes_per_token", "curve")
    out = {k: r[k] for k in keep if k in r}
    extra = r.get("extra", {})
    out.update({k: extra[k] for k in ("device", "merges", "goodput", "backend") if k in extra})
    return out


def _from_report(path: Path, tokens: int) -> dict[str, Any] | None:
    try:
        rep = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not _finite(rep.get("eval_loss_final")) or rep.get("timed_out") or not rep.get("eval_curve"):
        return None
    if not int(rep["eval_curve"][-1]["tokens"]) == int(rep.get("tokens_total", -1)) == tokens:
        return None
    return {"eval_loss_final": float(rep["eval_loss_final"]), "tokens": int(rep["tokens_total"]),
            "wall_s": rep.get("wall_s"), "recovered_from": "report.json"}


def table_rows(results: dict[str, dict[str, dict[str, dict[str, Any]]]], plans: Sequence[SizePlan]
               ) -> list[dict[str, Any]]:
    """One row per planned size: mean eval loss per system, ratios to dp_emulated paired by
    seed (mean over the seeds both ran), seeds."""
    rows = []
    for p in plans:
        by = results.get(p.size, {})
        row: dict[str, Any] = {"size": p.size, "params": p.params, "tokens": p.tokens,
                               "tokens_per_param": p.tokens_per_param}
        for system in SYSTEMS:
            runs = by.get(system, {})
            row[system] = (sum(r["eval_loss_final"] for r in runs.values()) / len(runs)) if runs else None
            row[f"{system}_seeds"] = sorted(int(s) for s in runs)
        dp = by.get("dp_emulated", {})
        for system in ("diloco_sync", "decoupled"):
            paired = [by[system][s]["eval_loss_final"] / dp[s]["eval_loss_final"]
                      for s in by.get(system, {}) if s in dp]
            row[f"{system}_ratio"] = sum(paired) / len(paired) if paired else None
            row[f"{system}_ratio_seeds"] = len(paired)
        rows.append(row)
    return rows


def _fmt(x: Any, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Quality with scale: {meta.get('device_name') or meta.get('device')}, M = {LEARNERS}", "",
             f"Command: `{meta.get('command', '')}`", "",
             "| size | params | tokens | tokens/param | dp (emulated) | diloco_sync | decoupled | "
             "diloco_sync ÷ dp | decoupled ÷ dp | seeds (dp/sync/dec) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        seeds = "/".join(str(len(r[f"{s}_seeds"])) for s in SYSTEMS)
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.2f} M | {r['tokens']:,} | {r['tokens_per_param']:.2f} | "
                     f"{_fmt(r['dp_emulated'], '.4f')} | {_fmt(r['diloco_sync'], '.4f')} | "
                     f"{_fmt(r['decoupled'], '.4f')} | {_fmt(r['diloco_sync_ratio'], '.4f')} | "
                     f"{_fmt(r['decoupled_ratio'], '.4f')} | {seeds} |")
    lines += ["", "Ratios: each system's final eval loss ÷ dp_emulated's at the same seed, mean over seeds. "
              "Published at 20 tokens/param, H = 30: DiLoCo M=4 1.020 (35 M), 1.015 (90 M); "
              "Streaming DiLoCo 1.026 (35 M), 1.019 (100 M)."]
    for note in meta.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def short_table(rows: Sequence[dict[str, Any]]) -> str:
    head = f"{'size':>8} {'params':>9} {'tok/par':>7} {'dp':>7} {'sync':>7} {'dec':>7} {'sync/dp':>8} {'dec/dp':>8}"
    body = [f"{r['size']:>8} {r['params'] / 1e6:>8.2f}M {r['tokens_per_param']:>7.2f} {_fmt(r['dp_emulated'], '7.4f')} "
            f"{_fmt(r['diloco_sync'], '7.4f')} {_fmt(r['decoupled'], '7.4f')} {_fmt(r['diloco_sync_ratio'], '8.4f')} "
            f"{_fmt(r['decoupled_ratio'], '8.4f')}" for r in rows]
    return "\n".join([head, *body])


def plot(path: Path, rows: Sequence[dict[str, Any]], title: str) -> bool:
    """Ratio to DP vs parameters (log x): ours per system, the published points. False: no matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for system, marker in (("diloco_sync", "s"), ("decoupled", "o")):
        pts = [(r["params"], r[f"{system}_ratio"]) for r in rows if r[f"{system}_ratio"] is not None]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, label=f"ours: {system} ÷ dp")
    for r in rows:    # what each of our sizes trained on
        ys = [r[f"{s}_ratio"] for s in ("diloco_sync", "decoupled") if r[f"{s}_ratio"] is not None]
        if ys:
            ax.annotate(f"{r['tokens_per_param']:.2g} tok/param", (r["params"], max(ys)), fontsize=7,
                        textcoords="offset points", xytext=(4, 6))
    for label, marker in (("DiLoCo M=4 (Charles et al. 2025)", "^"), ("Streaming DiLoCo", "v")):
        pts = [(x, y) for x, y, lab in PUBLISHED if lab == label]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, linestyle=":", color="grey"
                if marker == "^" else "black", label=f"published: {label}, 20 tok/param")
    ax.axhline(1.0, color="lightgrey", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final eval loss ÷ data-parallel's")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ------------------------------------------------------------------------------------ stages
REPO = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 8.0
"""A timed-out stage gets Ctrl-C (its cluster stops cleanly), then SIGKILL after this long."""
END_RESERVE_S = STOP_GRACE_S + 3.0 + 4.0
"""Every stage ends this long before the budget does: a stage's stop (Ctrl-C, SIGKILL) and the
last outputs fit in it, so the whole command ends inside ``--budget-s``."""


@dataclass
class Stage:
    """One ``ddloco compare`` of one lane at one size."""

    name: str
    lane: str
    size: str
    argv: list[str]
    timeout_s: float
    report: Path
    status: str = "pending"
    rc: int | None = None
    wall_s: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "lane": self.lane, "size": self.size, "status": self.status, "rc": self.rc,
                "wall_s": round(self.wall_s, 1), "timeout_s": round(self.timeout_s, 1),
                "command": " ".join(self.argv[1:])}


def compare_argv(p: SizePlan, lane: str, profile: Profile, *, device: str, config: Path, report: Path,
                 seed_start: int) -> list[str]:
    """The ``ddloco compare`` of one lane at one size."""
    if lane == "inproc":
        systems, seeds = "dp_emulated,diloco_sync", p.seeds
    else:
        systems, seeds = "decoupled", p.cluster_seeds
    argv = [sys.executable, "-m", "ddloco", "compare", "--task", "gpt", "--learners", str(LEARNERS),
            "--tokens", str(p.tokens), "--seed-list", ",".join(str(seed_start + k) for k in range(seeds)),
            "--systems", systems, "--jobs", str(2 * seeds if lane == "inproc" else 1),
            "--eval-points", str(profile.eval_points), "--device", device, "--insecure",
            "--config", str(config), "--report", str(report)]
    for kv in [f"task.seq_len={profile.seq_len}", f"task.batch_size={profile.batch_size}",
               *Size(p.n_layer, p.n_embd, p.n_head).sets()]:
        argv += ["--set", kv]
    return argv


CONFIG_TOML = """# gpu_quality: every system in fp32 (TF32 matmuls on a GPU), the cluster evaluated at its start and end
[learner]
autocast = "off"

[up]
eval_every_s = 100000.0
"""


def run_stage(stage: Stage, env: dict[str, str], deadline: float) -> None:
    """Run one stage under min(its timeout, the budget's end); the outcome goes into ``stage``."""
    left = deadline - time.monotonic()
    timeout = min(stage.timeout_s, left)
    if left < 5:
        stage.status = "skipped: no time left in the budget"
        return
    stage.report.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(stage.report / "stage.log", "wb") as log:
        proc = subprocess.Popen(stage.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            stage.rc = proc.wait(timeout)
            stage.status = "ok" if stage.rc == 0 else f"failed (exit {stage.rc})"
        except subprocess.TimeoutExpired:
            stage.status = f"timed out after {timeout:.0f} s"
            stage.rc = _stop(proc)
    stage.wall_s = time.monotonic() - t0


def _stop(proc: subprocess.Popen) -> int | None:
    """Ctrl-C to the stage's process group (compare stops its cluster), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


class Sweep:
    """The stages of one run and what they produced; lanes run on their own threads, the outputs
    are rewritten (under ``lock``) after every stage."""

    def __init__(self, out: Path, work: Path, plans: list[SizePlan], meta: dict[str, Any],
                 merged: dict[str, Any] | None) -> None:
        self.out, self.work, self.plans, self.meta = out, work, plans, meta
        self.merged = merged or {}
        self.stages: list[Stage] = []
        self.lock = threading.Lock()

    def run_lanes(self, env: dict[str, str], deadline: float) -> None:
        lanes = sorted({s.lane for s in self.stages})
        threads = [threading.Thread(target=self._lane, args=(lane, env, deadline), name=f"lane-{lane}")
                   for lane in lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _lane(self, lane: str, env: dict[str, str], deadline: float) -> None:
        for stage in (s for s in self.stages if s.lane == lane):
            print(f"[gpu quality] {stage.name}: start (timeout {min(stage.timeout_s, deadline - time.monotonic()):.0f} s)",
                  file=sys.stderr, flush=True)
            run_stage(stage, env, deadline)
            print(f"[gpu quality] {stage.name}: {stage.status} ({stage.wall_s:.1f} s)", file=sys.stderr, flush=True)
            self.write()

    def missing(self) -> list[str]:
        """The planned runs (size, system, seed) without a figure: empty when the sweep is whole,
        whatever a stage's exit status (a compare that fails after its runs, e.g. on a plot
        library the machine lacks, loses no figure)."""
        res, out = self.results(), []
        for p in self.plans:
            for stage in (s for s in self.stages if s.size == p.size):
                systems = ("dp_emulated", "diloco_sync") if stage.lane == "inproc" else ("decoupled",)
                seeds = p.seeds if stage.lane == "inproc" else p.cluster_seeds
                for system in systems:
                    for k in range(seeds):
                        seed = str(self.meta.get("seed_start", 0) + k)
                        if seed not in res.get(p.size, {}).get(system, {}):
                            out.append(f"{p.size} {system} seed {seed}")
        return out

    def results(self) -> dict[str, Any]:
        tokens = {p.size: p.tokens for p in self.plans}
        res = collect((s.size, s.report, tokens[s.size]) for s in self.stages)
        for size, systems in self.merged.items():   # an earlier run's seeds at the same size and tokens
            for system, seeds in systems.items():
                for seed, r in seeds.items():
                    res.setdefault(size, {}).setdefault(system, {}).setdefault(seed, r)
        return res

    def write(self) -> list[dict[str, Any]]:
        """quality.json, quality.md, quality.png, quality_logs.tar.gz from what has finished."""
        with self.lock:
            results = self.results()
            rows = table_rows(results, self.plans)
            meta = {**self.meta, "stages": [s.record() for s in self.stages]}
            title = f"Ratio to data-parallel vs size, M={LEARNERS}, {meta.get('device_name') or meta.get('device')}"
            try:
                meta["plot"] = "ok" if plot(self.out / "quality.png", rows, title) else "skipped: no matplotlib"
            except Exception as e:   # a figure never costs the figures
                meta["plot"] = f"failed: {e!r}"[:200]
            doc = {"meta": meta, "plan": [asdict(p) for p in self.plans], "rows": rows, "results": results}
            _write(self.out / "quality.json", json.dumps(doc, indent=1))
            _write(self.out / "quality.md", markdown(rows, meta))
            self._archive()
            return rows

    def _archive(self) -> None:
        tmp = self.out / "quality_logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for f in sorted(self.work.rglob("*")):
                if f.is_file() and f.suffix in (".log", ".json", ".md", ".toml", ".txt") \
                        and f.stat().st_size <= LOG_FILE_LIMIT:
                    tar.add(f, arcname=str(f.relative_to(self.work)))
        os.replace(tmp, self.out / "quality_logs.tar.gz")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m ddloco.bench.gpu_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUT", help="results directory (quality.json, .md, .png, quality_logs.tar.gz)")
    ap.add_argument("--dry", action="store_true", help="tiny sizes on the CPU, in seconds (the suite runs it)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall seconds for everything, env set-up "
                    "included (default 240; --dry 90, a cap: it takes ~35 s)")
    ap.add_argument("--sizes", default=None, help="comma list of names (" + ", ".join(
        f"{k}={v}" for k, v in NAMED_SIZES.items()) + ") or LAYERSxWIDTH[hHEADS] (default s,m,l)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds of dp_emulated and diloco_sync below the "
                    "largest size (default 2; the largest gets 1)")
    ap.add_argument("--cluster-seeds", type=int, default=None, help="seeds of the decoupled cluster per size (default 1)")
    ap.add_argument("--seed-start", type=int, default=0, help="first seed (a later run adds seeds 2, 3, ...)")
    ap.add_argument("--tokens-per-param", type=float, default=None,
                    help="the ceiling of R, tokens per parameter (default 20; --dry 0.5); the plan takes the "
                         "largest R up to it that fits the budget")
    ap.add_argument("--only", choices=("inproc", "cluster"), default=None,
                    help="one lane: inproc (dp_emulated, diloco_sync) or cluster (decoupled)")
    ap.add_argument("--device", default="auto", help="auto (cuda when torch sees one; --dry: cpu), cpu, cuda")
    ap.add_argument("--keep-work", action="store_true",
                    help="keep the stages' directories (cluster reports, checkpoints) in /tmp; their logs are "
                         "in quality_logs.tar.gz either way")
    ap.add_argument("--merge", metavar="QUALITY_JSON", default=None,
                    help="an earlier run's quality.json: this run takes its plan (sizes, tokens) and its "
                         "runs join the table (use --seed-start for new seeds)")
    return ap


def _profile(args: argparse.Namespace) -> Profile:
    prof = DRY if args.dry else FULL
    if args.sizes:
        prof = replace(prof, sizes=tuple(parse_sizes(args.sizes)))
    if args.seeds is not None:
        prof = replace(prof, seeds=args.seeds)
    if args.cluster_seeds is not None:
        prof = replace(prof, cluster_seeds=args.cluster_seeds)
    if prof.seeds < 1 or prof.cluster_seeds < 1 or args.seed_start < 0:
        raise QualityError("--seeds and --cluster-seeds must be >= 1, --seed-start >= 0")
    return prof


def merged_plan(path: str, profile: Profile) -> tuple[list[SizePlan], dict[str, Any]]:
    """``--merge``: the earlier run's plan (its sizes and tokens, this run's seeds) and results,
    so this run's seeds join them at equal tokens."""
    try:
        doc = json.loads(Path(path).read_text())
        plans = [SizePlan(**p) for p in doc["plan"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise QualityError(f"--merge {path}: not a quality.json of this tool ({e!r})") from None
    if not plans:
        raise QualityError(f"--merge {path}: its plan is empty")
    prof = replace(profile, sizes=tuple(parse_size(p.size) for p in plans))
    plans = [replace(p, seeds=prof.seeds_at(i), cluster_seeds=prof.cluster_seeds) for i, p in enumerate(plans)]
    return plans, doc.get("results", {})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    budget = args.budget_s if args.budget_s is not None else (90.0 if args.dry else 240.0)
    deadline = t0 + budget - END_RESERVE_S
    out = Path(args.out)
    try:
        profile = _profile(args)
        out.mkdir(parents=True, exist_ok=True)
    except (QualityError, OSError) as e:
        print(f"gpu quality: {e}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ddloco-quality-"))
    from ddloco.bench.gpu_env import prepare
    env = prepare(work)
    facts = json.loads((work / "env.json").read_text())
    device = args.device if args.device != "auto" else (
        "cuda" if facts.get("cuda_available") and not args.dry else "cpu")
    machine = GPU if device.startswith("cuda") else CPU
    if machine is GPU:
        env["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "1"     # TF32 matmuls in every process, the learners' too
    left = deadline - time.monotonic()
    lane_s = left * 0.75 - 5.0
    tpp = args.tokens_per_param or (DRY_TOKENS_PER_PARAM if args.dry else MAX_TOKENS_PER_PARAM)
    merged: dict[str, Any] = {}
    if args.merge:
        try:
            plans, merged = merged_plan(args.merge, profile)
        except QualityError as e:
            print(f"gpu quality: {e}", file=sys.stderr)
            return 2
        notes = [f"plan of {args.merge} (its sizes and tokens); its runs are merged"]
    else:
        plans, notes = plan(profile, machine, lane_s if not args.dry else 1e9, max_tpp=tpp)
    (work / "config.toml").write_text(CONFIG_TOML)
    meta = {"device": device, "device_name": facts.get("gpu") or ("cpu" if device == "cpu" else device),
            "dry": args.dry, "budget_s": budget, "lane_s": round(lane_s, 1), "machine_model": asdict(machine),
            "profile": {"seq_len": profile.seq_len, "batch_size": profile.batch_size, "learners": LEARNERS,
                        "tokens_per_step": profile.tokens_per_step(), "eval_points": profile.eval_points},
            "env": facts, "notes": notes, "seed_start": args.seed_start,
            "command": "python3 -m ddloco.bench.gpu_quality " + " ".join(sys.argv[1:] if argv is None else argv)}
    sweep = Sweep(out, work, plans, meta, merged)
    for p in plans:
        for lane in ("inproc", "cluster"):
            if args.only and lane != args.only:
                continue
            report = work / f"{lane}-{p.size}"
            sweep.stages.append(Stage(f"{lane}-{p.size}", lane, p.size,
                                      compare_argv(p, lane, profile, device=device, config=work / "config.toml",
                                                   report=report, seed_start=args.seed_start),
                                      timeout_s=2.0 * p.est_s[lane] + 20.0, report=report))
    print(f"[gpu quality] device {meta['device_name']}, {len(plans)} size(s), lane budget {lane_s:.0f} s; "
          + "; ".join(f"{p.size}: {p.params / 1e6:.2f} M params, {p.tokens:,} tokens ({p.tokens_per_param:.2f}/param),"
                      f" est {p.est_s['inproc']:.0f}/{p.est_s['cluster']:.0f} s" for p in plans), file=sys.stderr,
          flush=True)
    for n in notes:
        print(f"[gpu quality] {n}", file=sys.stderr, flush=True)
    sweep.run_lanes(env, deadline)
    rows = sweep.write()
    missing = sweep.missing()
    if missing:
        print(f"[gpu quality] missing: {', '.join(missing)}", file=sys.stderr, flush=True)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    print(f"[gpu quality] done in {time.monotonic() - t0:.1f} s; outputs in {out}"
          + (f" (stage directories: {work})" if args.keep_work else ""), file=sys.stderr, flush=True)
    print(short_table(rows), flush=True)
    return 0 if plans and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
