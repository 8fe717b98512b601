"""`ddloco compare --chaos SPEC` / `--hetero SPEC`: the systems a user would pick, each on its real
engine, through the same seeded failures and the same emulated accelerator, side by side.

Systems:
- ``dp_elastic``: PyTorch DDP under torchrun's elastic agent (c10d rendezvous, ``--max-restarts``),
  a checkpoint every ``--checkpoint-every`` steps, the whole group restarted from it when a rank dies
  (``ddloco.compare.elastic_worker``);
- ``diloco_sync_elastic``: synchronous DiLoCo as a torch.distributed job (all-reduce of the outer
  gradients every H steps, outer Nesterov) under the same elastic restarts;
- ``torchft``: needs the optional ``torchft`` package; listed as skipped, with the reason, when it
  is not run;
- ``decoupled`` (ours, defaults: K = 1 + grace), ``decoupled_lockstep`` (K = M), ``decoupled_k1``
  (K = 1, no grace window): ``ddloco up`` with the schedule given to its chaos harness.

The schedule (``plan_schedule``) is drawn once per seed: learner (rank) i is SIGKILLed as a
Poisson process of mean ``learner_mtbf_s``, and ``stalls`` SIGSTOPs of ``stall_s``; times are
seconds after the system's first training step, the same for every system. A fault that finds
its rank down (restarting) hits nothing and is reported as missed.

Figures per system and seed (``compare.json``): ``goodput`` = Σ_r useful steps_r × the rank's
emulated step time ÷ (M × the training span) (useful: steps whose result reached the final model:
DP's kept steps, our merged answers' steps; ALGORITHM §9), ``global_downtime_s`` (every gap longer
than max(1 s, 5 emulated steps) between advances of the training: the elastic jobs' steps, our
merges), ``wall_s_to_target``, ``eval_loss_at_wall`` (at the shortest span of the seed's
systems), ``eval_loss_final`` (at the token budget), ``restarts``, ``tokens_lost`` (trained then
discarded), ``bytes_per_token``, ``goodput_predicted`` (``ddloco.sim.replay`` on the same schedule).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from common.config import ConfigError, ConfigFile, RunConfig, override
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


# ------------------------------------------------------------------------------ the setting
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

    def useful_s(self, steps_by_rank: Sequence[float]) -> float:
        return sum(s * self.floor_ms / 1000.0 * f for s, f in zip(steps_by_rank, self.factors))


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
    pts = [start, *sorted(t for t in times if start <= t <= end), end]
    return sum(b - a for a, b in zip(pts, pts[1:]) if b - a > gap_s)


# ------------------------------------------------------------------------------ elastic systems
class _Injector(threading.Thread):
    """The schedule on torchrun's workers: SIGKILL (SIGSTOP for a stall, SIGCONT after ``stall_s``)
    of the process that holds rank i at the time, from the first training step on."""

    def __init__(self, faults: list[Fault], workdir: Path, stall_s: float, done: threading.Event,
                 marker: bytes = b"elastic_worker") -> None:
        super().__init__(name="inject", daemon=True)
        self.marker = marker
        self.faults, self.workdir, self.stall_s, self.done = list(faults), workdir, stall_s, done
        self.t_start: float | None = None
        self.records: list[dict[str, Any]] = []

    def _first_step(self) -> float | None:
        first = None
        for f in (self.workdir / "progress").glob("rank*.log"):
            for line in f.read_text(errors="replace").splitlines():
                if line.startswith("step "):
                    t = float(line.split()[-1])
                    first = t if first is None else min(first, t)
                    break
        return first

    def _pid(self, rank: int) -> int | None:
        try:
            pid = int((self.workdir / "pids" / f"rank{rank}").read_text().split()[0])
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError, IndexError):
            return None
        state = stat.rsplit(")", 1)[-1].split()[0]
        return pid if self.marker in cmd and state not in ("Z", "X") else None

    def run(self) -> None:
        while self.t_start is None and not self.done.wait(0.05):
            self.t_start = self._first_step()
        stalled: list[tuple[float, int]] = []
        pending = list(self.faults)
        while not self.done.wait(0.02):
            assert self.t_start is not None
            now = time.time()
            for until, pid in [s for s in stalled if s[0] <= now]:
                stalled.remove((until, pid))
                _signal(pid, signal.SIGCONT)
            while pending and now - self.t_start >= pending[0].at_s:
                f = pending.pop(0)
                rank = int(f.target.rsplit("-", 1)[-1])
                pid = self._pid(rank)
                if pid is not None:
                    _signal(pid, signal.SIGKILL if f.kind == "learner_kill" else signal.SIGSTOP)
                    if f.kind == "stall":
                        stalled.append((now + self.stall_s, pid))
                self.records.append({"t": round(now - self.t_start, 3), "kind": f.kind, "target": f.target,
                                     "hit": pid is not None})
        for _, pid in stalled:
            _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _progress(workdir: Path, learners: int) -> dict[int, list[tuple[str, int, int, float]]]:
    """Per rank: (kind, life, step, time) of its step/sync/resume lines."""
    out: dict[int, list[tuple[str, int, int, float]]] = {}
    for r in range(learners):
        rows = []
        path = workdir / "progress" / f"rank{r}.log"
        for line in (path.read_text(errors="replace").splitlines() if path.exists() else []):
            parts = line.split()
            if len(parts) == 4 and parts[0] in ("step", "sync", "resume", "drop"):
                try:
                    rows.append((parts[0], int(parts[1]), int(parts[2]), float(parts[3])))
                except ValueError:
                    continue                       # the line a SIGKILL cut short
        out[r] = rows
    return out


def run_elastic(system: str, run: RunConfig, st: Setting, *, seed: int, workdir: Path,
                faults: list[Fault]) -> dict[str, Any]:
    """One elastic baseline under torchrun with the schedule injected; its figures."""
    import shutil
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    M = st.learners
    spec = {"mode": "dp" if system == "dp_elastic" else "diloco_sync", "run": run.to_dict(), "steps": st.steps,
            "seed": seed, "threads": 1, "floor_ms": st.floor_ms, "factors": st.factors, "noise": st.noise,
            "checkpoint_every": st.checkpoint_every, "snapshot_every": max(1, st.steps // 24),
            "workdir": str(workdir), "device": st.device}
    (workdir / "spec.json").write_text(json.dumps(spec))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", f"--nproc-per-node={M}",
            "--max-restarts", "100000", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", f"{system}-s{seed}",
            "-m", "ddloco.compare.elastic_worker", "--spec", str(workdir / "spec.json")]
    # the workers' process group on a store of its own: the rendezvous store shared with the agent
    # hands a restarted group its previous life's addresses (pytorch/pytorch#135712), and every
    # restart after a few fails to connect
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    done = threading.Event()
    injector = _Injector(faults, workdir, st.stall_s, done)
    t_launch = time.time()
    capped = False
    with open(workdir / "torchrun.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        injector.start()
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    first = injector.t_start
                    if (first is not None and time.time() - first > st.cap_s) or time.time() - t_launch > st.cap_s + 300:
                        capped = True
                        os.killpg(proc.pid, signal.SIGKILL)
                        rc = proc.wait()
                        break
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            done.set()
            injector.join(5)
    finished = (workdir / "finished.json").exists()
    if injector.t_start is None or (not capped and (rc != 0 or not finished)):
        tail = (workdir / "torchrun.log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"torchrun {system} failed (exit {rc}" + (", no step before its time cap" if capped else "")
                           + "):\n" + "\n".join(tail))
    capped = capped and not finished
    prog = _progress(workdir, M)
    steps_lines = [(r, life, s, t) for r, rows in prog.items() for kind, life, s, t in rows if kind == "step"]
    t_start = injector.t_start or min(t for *_, t in steps_lines)
    t_start -= st.floor_ms / 1000.0                # the first step's start: one emulated step earlier
    t_end = t_start + st.cap_s if capped else max(t for *_, t in steps_lines)
    span = t_end - t_start
    trained = [sum(1 for kind, *_ in rows if kind == "step") for _, rows in sorted(prog.items())]
    lives = 1 + max(life for _, life, _, _ in steps_lines)
    kept = st.steps
    if capped:   # what the global model holds at the cap: rank 0's last step (sync DiLoCo: its last sync)
        last = max(life for _, life, _, _ in steps_lines)
        mine = [(kind, s) for kind, life, s, _ in prog[0] if life == last and kind in ("step", "sync", "resume")]
        marks = [s for kind, s in mine if kind == ("step" if spec["mode"] == "dp" else "sync") or kind == "resume"]
        kept = max(marks, default=0)
    advances = [t for r, _, _, t in steps_lines if r == 0]   # training progress (sync DiLoCo: its steps too)
    n = _numel(run)
    per_step = M * 2 * (M - 1) / M * n * 4            # ring all-reduce, fp32, all ranks
    moved = per_step * (sum(trained) / M if spec["mode"] == "dp" else
                        sum(1 for kind, *_ in prog[0] if kind == "sync"))
    tokens = kept * M * st.per_batch
    wall_curve, curve = _snapshot_curve(run, workdir, t_start)
    timeline = {f"learner-{r}": _elastic_lanes(rows, t_start) for r, rows in sorted(prog.items())}
    return {"system": system, "seed": seed, "learners": M, "steps": st.steps, "tokens": tokens,
            "wall_s": round(span, 2), "span_s": round(span, 2), "launch_s": round(t_start - t_launch, 2),
            "eval_loss_final": None if capped else curve[-1][1], "curve": curve, "wall_curve": wall_curve,
            "capped": capped, "goodput": None,
            "global_downtime_s": round(_advances_downtime(advances, t_start, t_end, st.gap_s), 2),
            "restarts": lives - 1, "tokens_lost": int((sum(trained) - kept * M) * st.per_batch),
            "bytes_per_token": moved / tokens, "faults": injector.records, "timeline": timeline}


def run_torchft(run: RunConfig, st: Setting, *, seed: int, workdir: Path, faults: list[Fault]) -> dict[str, Any]:
    """torchft's fault-tolerant DDP (``ddloco.compare.torchft_worker``): a Lighthouse here, one
    process per replica group, a killed one started again at once (its next life recovers from a
    peer); the schedule injected as for the elastic jobs."""
    import shutil
    from torchft.coordination import LighthouseServer
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    M = st.learners
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=1000)
    spec = {"run": run.to_dict(), "steps": st.steps, "seed": seed, "floor_ms": st.floor_ms, "factors": st.factors,
            "noise": st.noise, "snapshot_every": max(1, st.steps // 24), "workdir": str(workdir),
            "lighthouse": lighthouse.address()}
    (workdir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = threading.Event()
    injector = _Injector(faults, workdir, st.stall_s, done, marker=b"torchft_worker")
    lives = [0] * M
    logs = [open(workdir / f"replica{r}.log", "ab") for r in range(M)]

    def start(r: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "ddloco.compare.torchft_worker", "--spec",
                                 str(workdir / "spec.json"), "--replica", str(r), "--life", str(lives[r])],
                                stdout=logs[r], stderr=subprocess.STDOUT, env=env, start_new_session=True)

    t_launch = time.time()
    procs = [start(r) for r in range(M)]
    injector.start()
    capped = False
    try:
        while True:
            finished = [(workdir / f"finished-{r}.json").exists() for r in range(M)]
            if all(finished) or (any(finished) and all(p.poll() is not None for p in procs)):
                break
            first = injector.t_start
            if (first is not None and time.time() - first > st.cap_s) or time.time() - t_launch > st.cap_s + 300:
                capped = True
                break
            for r, p in enumerate(procs):
                if p.poll() is not None and not finished[r]:
                    if lives[r] > 200:
                        raise RuntimeError(f"torchft replica {r} failed 200 times; see {workdir}/replica{r}.log")
                    lives[r] += 1                      # killed (or failed): a new process, recovering from a peer
                    procs[r] = start(r)
            time.sleep(0.05)
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        injector.join(5)
        lighthouse.shutdown()
        for fh in logs:
            fh.close()
    capped = capped and not all((workdir / f"finished-{r}.json").exists() for r in range(M))
    prog = _progress(workdir, M)
    steps_lines = [(r, life, s, t) for r, rows in prog.items() for kind, life, s, t in rows if kind == "step"]
    if not steps_lines:
        raise RuntimeError(f"torchft: no step committed; see {workdir}/replica0.log")
    t_start = (injector.t_start or min(t for *_, t in steps_lines)) - st.floor_ms / 1000.0
    t_end = t_start + st.cap_s if capped else max(t for *_, t in steps_lines)
    committed = {f"learner-{r}": sum(1 for kind, *_ in rows if kind == "step") for r, rows in prog.items()}
    dropped = sum(1 for rows in prog.values() for kind, *_ in rows if kind == "drop")
    n = _numel(run)
    moved = sum(committed.values()) * 2 * (M - 1) / M * n * 4
    tokens = sum(committed.values()) * st.per_batch
    wall_curve, curve = _snapshot_curve(run, workdir, t_start)
    return {"system": "torchft", "seed": seed, "learners": M, "steps": st.steps, "tokens": tokens,
            "wall_s": round(t_end - t_start, 2), "span_s": round(t_end - t_start, 2), "capped": capped,
            "launch_s": round(t_start - t_launch, 2), "eval_loss_final": None if capped else curve[-1][1],
            "curve": curve, "wall_curve": wall_curve, "goodput": None,
            "global_downtime_s": round(_advances_downtime([t for *_, t in steps_lines], t_start, t_end, st.gap_s), 2),
            "restarts": sum(lives), "tokens_lost": int(dropped * st.per_batch),
            "bytes_per_token": moved / max(1, tokens), "faults": injector.records,
            "timeline": {f"learner-{r}": _elastic_lanes(rows, t_start) for r, rows in sorted(prog.items())},
            "extra": {"committed": committed, "dropped_steps": dropped}}


def _numel(run: RunConfig) -> int:
    from common.task import bind_task, build_model
    task, run = bind_task(run)
    return sum(t.numel() for t in build_model(task, run.task.seed).state_dict().values())


def _elastic_lanes(rows: list[tuple[str, int, int, float]], t0: float) -> list[list[float]]:
    """A rank's training intervals (one per life, from its first step to its last), in seconds."""
    spans: dict[int, list[float]] = {}
    for kind, life, _, t in rows:
        if kind == "step":
            lo_hi = spans.setdefault(life, [t, t])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], t), max(lo_hi[1], t)
    return [[round(a - t0, 2), round(b - t0, 2)] for _, (a, b) in sorted(spans.items())]


def _snapshot_curve(run: RunConfig, workdir: Path, t0: float) -> tuple[list[list[float]], list[list[float]]]:
    """The saved global models evaluated after the run: (wall s, loss) of every snapshot and
    (tokens, loss) of the kept ones (the last life's line of each step)."""
    import torch
    from common.task import bind_task, build_model, evaluate
    task, run = bind_task(run)
    model = build_model(task, run.task.seed)
    rows = [json.loads(x) for x in (workdir / "snap" / "index.jsonl").read_text().splitlines() if x.strip()]
    init = evaluate(task, model)
    wall, kept = [[0.0, init]], {0: init}
    seen: set[tuple[int, int]] = set()
    for row in rows:
        if (row["step"], row["life"]) in seen and "replica" in row:   # torchft: each live replica saved it
            continue
        seen.add((row["step"], row["life"]))
        model.load_state_dict(torch.load(workdir / "snap" / row["file"], weights_only=True))
        loss = evaluate(task, model)
        wall.append([round(row["t"] - t0, 2), loss])
        kept[int(row["tokens"])] = loss
        for tok in [k for k in kept if k > int(row["tokens"])]:
            del kept[tok]                            # rolled back: those tokens were trained again
    return wall, [[k, v] for k, v in sorted(kept.items())]


# ------------------------------------------------------------------------------ our cluster
def ours_run(system: str, run: RunConfig, learners: int) -> RunConfig:
    if system == "decoupled_lockstep":
        return replace(run, algo=replace(run.algo, lockstep=True, quorum=learners))
    if system == "decoupled_k1":
        return replace(run, algo=replace(run.algo, quorum=1, grace_enabled=False))
    return run


def run_ours(system: str, cfg: ConfigFile, st: Setting, *, seed: int, workdir: Path,
             faults: list[Fault]) -> dict[str, Any]:
    """``ddloco up`` with the schedule handed to its chaos harness; its figures."""
    from ddloco.up import run_up
    M = st.learners
    run = ours_run(system, cfg.run, M)
    up = override(cfg.up, learners=M, syncers=st.syncers, steps=st.steps, report_dir=str(workdir),
                  minutes=(st.cap_s + BOOT_ALLOWANCE_S) / 60, eval_every_s=st.eval_every_s)
    learner = override(cfg.learner, step_noise=st.noise) if st.noise else cfg.learner
    run_id = f"side-{system.replace('_', '-')}-s{seed}-{os.getpid()}"
    c = replace(cfg, run=run, up=up, learner=learner, endpoints=override(cfg.endpoints, run_id=run_id))
    rep_path = workdir / "report.json"
    rep_path.unlink(missing_ok=True)
    chaos = st.chaos if faults else None
    rc = run_up(c, external_redis=False, quiet=True, insecure=st.insecure, step_time_floor_ms=st.floor_ms,
                slowdowns=st.factors if any(f != 1.0 for f in st.factors) else None, chaos=chaos,
                chaos_faults=faults if faults else None)
    if rc == 130:
        raise KeyboardInterrupt
    if not rep_path.exists():
        raise RuntimeError(f"ddloco up for {system} seed {seed} wrote no report (exit {rc})")
    rep = json.loads(rep_path.read_text())
    tokens = int(rep["tokens_total"])
    capped = bool(rep.get("timed_out"))
    if rc != 0 or (not capped and (rep.get("eval_loss_final") is None or tokens < st.steps * M * st.per_batch)):
        raise RuntimeError(f"ddloco up for {system} seed {seed} failed (exit {rc}, {tokens:,} tokens): "
                           f"{rep.get('failure')}")
    lives = rep["lives"]
    t_start = min(x["trains_from"] for x in lives)
    t_end = max(x["ended"] for x in lives)
    span = t_end - t_start
    merged = [float(rep["merged_steps"].get(f"learner-{i}", 0.0)) for i in range(M)]
    trained = sum(x["steps"] for x in lives)
    chaos_events = rep.get("chaos_events", [])
    faults_done = [{"t": round(float(e["t"]) - t_start, 3), "kind": e["kind"], "target": e["target"], "hit": True}
                   for e in chaos_events if e.get("kind") in ("learner_kill", "stall")]
    curve = [[int(e["tokens"]), float(e["loss"])] for e in rep["eval_curve"]]
    curve[0][0] = 0
    # the final evaluation runs after the learners stopped: its model is the one at the span's end
    wall_curve = [[round(min(span, max(0.0, float(e["t"]) - t_start)) if e.get("final") else
                         max(0.0, float(e["t"]) - t_start), 2), float(e["loss"])] for e in rep["eval_curve"]]
    if not capped and rep.get("eval_loss_final") is not None:
        wall_curve[-1][1] = curve[-1][1] = float(rep["eval_loss_final"])   # the shards' checkpoints
    timeline: dict[str, list[list[float]]] = {}
    for x in lives:
        timeline.setdefault(x["learner"], []).append([round(x["trains_from"] - t_start, 2),
                                                     round(x["ended"] - t_start, 2)])
    from ddloco.compare.runner import cluster_bytes_per_token
    return {"system": system, "seed": seed, "learners": M, "steps": st.steps, "tokens": tokens,
            "wall_s": round(span, 2), "span_s": round(span, 2), "capped": capped,
            "eval_loss_final": None if capped else float(rep["eval_loss_final"]),
            "curve": curve, "wall_curve": wall_curve,
            "goodput": None,
            "global_downtime_s": round(_advances_downtime([t for t, _ in rep["merge_timeline"]], t_start, t_end,
                                                          st.gap_s), 2),
            "restarts": int(rep.get("learner_restarts", 0)),
            "tokens_lost": int(max(0.0, trained - sum(merged)) * st.per_batch),
            "bytes_per_token": cluster_bytes_per_token(rep), "faults": faults_done, "timeline": timeline,
            "extra": {"merges": rep["merges"], "goodput_up": rep["goodput"], "report": str(rep_path),
                      "merged_steps": rep["merged_steps"], "steps_trained": trained}}


# ------------------------------------------------------------------------------ figures
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


# ------------------------------------------------------------------------------ the command
def torchft_installed() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):
        return False


def meta_of(st: Setting, run: RunConfig) -> dict[str, Any]:
    """What ``ddloco.sim.replay`` needs of the setting (also in compare.json's meta)."""
    return {"learners": st.learners, "steps_per_learner": st.steps, "step_time_floor_ms": st.floor_ms,
            "factors": st.factors, "checkpoint_every": st.checkpoint_every,
            "sync_every_steps": run.algo.sync_every_steps, "cap_s": st.cap_s}


class SideBySide:
    """One `ddloco compare --chaos/--hetero`: per seed, the schedule, the target loss, every system
    (reused with --resume), then compare.json / compare.md / the plots."""

    def __init__(self, args: Any, argv: list[str], cfg: ConfigFile, run: RunConfig, per_batch: int,
                 steps: int, seeds: list[int], report: Path) -> None:
        from ddloco.chaos_plan import parse_chaos
        self.args, self.argv, self.cfg, self.run, self.report = args, argv, cfg, run, report
        self.seeds = seeds
        chaos = parse_chaos(args.chaos) if args.chaos else None
        hetero = parse_hetero(args.hetero) if args.hetero else None
        default = CHAOS_DEFAULT if chaos else HETERO_DEFAULT
        systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else list(default)
        bad = [s for s in systems if s not in SIDE_SYSTEMS]
        if bad or not systems:
            raise ConfigError(f"with --chaos/--hetero the systems are {', '.join(SIDE_SYSTEMS)}; got {bad or systems}")
        self.systems = systems
        floor = args.step_time_floor_ms if args.step_time_floor_ms is not None else 200.0
        if floor <= 0:
            raise ConfigError("--step-time-floor-ms must be > 0 with --chaos/--hetero (the emulated accelerator)")
        self.st = Setting(learners=args.learners, steps=steps, per_batch=per_batch, floor_ms=floor,
                          factors=hetero.factors(args.learners) if hetero else [1.0] * args.learners,
                          noise=hetero.noise if hetero else 0.0, chaos=chaos,
                          checkpoint_every=args.checkpoint_every, syncers=args.syncers, insecure=args.insecure,
                          wall_cap=args.wall_cap,
                          device=args.device if args.device != "auto" else "cpu", eval_every_s=args.eval_every_s,
                          stall_s=chaos.stall_s if chaos else 20.0, gap_s=max(1.0, 5 * floor / 1000.0))
        self.chaos, self.hetero = chaos, hetero
        self.skipped: dict[str, str] = {}
        self.missing: list[str] = []
        self.failures: list[str] = []
        self.results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        self.t_start = time.time()
        print(f"compare    side by side: {', '.join(systems)} | M={args.learners} | {steps} steps per learner at "
              f"{floor:g} ms (failure-free {self.st.nominal_s / 60:.1f} min) | chaos {chaos} | hetero "
              f"{hetero} | seeds {seeds} | report {report}", flush=True)

    def faults(self, seed: int) -> list[Fault]:
        if self.chaos is None:
            return []
        return plan_schedule(replace(self.chaos, seed=self.chaos.seed + seed), self.st.learners, self.st.nominal_s)

    def target(self, seed: int) -> float:
        """--target-loss, else DP's loss without failures at half the budget (in process, the same
        mathematics as DDP)."""
        if self.args.target_loss is not None:
            return float(self.args.target_loss)
        cached = self.report / "runs" / f"target-s{seed}.json"
        key = {"run_digest": self.run.digest(), "learners": self.st.learners, "steps": self.st.steps // 2}
        try:
            old = json.loads(cached.read_text())
            if old.get("key") == key:
                return float(old["target_loss"])
        except (OSError, ValueError, KeyError):
            pass
        loss = self._dp_half_budget(seed)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps({"key": key, "target_loss": loss}))
        return loss

    def _dp_half_budget(self, seed: int) -> float:
        from common.task import bind_task
        from ddloco.compare import systems
        from ddloco.compare.runner import apply_sets
        task, run = bind_task(apply_sets(self.run, {"task": {"seed": seed}}))
        res = systems.run_dp_emulated(task, run.algo, learners=self.st.learners, steps=max(1, self.st.steps // 2),
                                      seed=seed, eval_points=1, threads=1)
        return float(res.eval_loss_final)

    def identity(self, system: str, seed: int) -> dict[str, Any]:
        from dataclasses import asdict
        st = asdict(self.st)
        st["chaos"] = str(self.chaos)
        return {"system": system, "seed": seed, "setting": st, "run_digest": self.run.digest()}

    def one(self, system: str, seed: int, faults: list[Fault]) -> dict[str, Any] | None:
        from ddloco.compare.runner import apply_sets
        path = self.report / "runs" / f"{system}-s{seed}.json"
        if self.args.render_only and not path.exists():
            self.missing.append(f"{system} seed {seed}")
            print(f"missing    {system} seed {seed}: not run (--render-only)", flush=True)
            return None
        if (self.args.resume or self.args.render_only) and path.exists():
            try:
                old = json.loads(path.read_text())
                if old.get("identity") == self.identity(system, seed):
                    print(f"reused     {system} seed {seed} ({path})", flush=True)
                    self.derive(old, apply_sets(self.run, {"task": {"seed": seed}}), faults)
                    path.write_text(json.dumps(old, indent=1))   # with the figures as derived now
                    return old
            except (OSError, ValueError):
                pass
        run = apply_sets(self.run, {"task": {"seed": seed}})
        workdir = self.report / "runs" / f"{system}-s{seed}"
        t0 = time.time()
        if system in ELASTIC:
            res = run_elastic(system, run, self.st, seed=seed, workdir=workdir, faults=faults)
        elif system == "torchft":
            res = run_torchft(run, self.st, seed=seed, workdir=workdir, faults=faults)
        else:
            res = run_ours(system, replace(self.cfg, run=run), self.st, seed=seed, workdir=workdir, faults=faults)
            rep = json.loads(Path(res["extra"]["report"]).read_text())
            firsts = {}
            for x in sorted(rep["lives"], key=lambda x: x["started"]):
                if x["learner"] in firsts:   # a replacement: its start to its first step
                    res["extra"].setdefault("rejoins", []).append([x["started"], x["trains_from"]])
                firsts.setdefault(x["learner"], x)
        self.derive(res, run, faults)
        res["identity"] = self.identity(system, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
        hits = sum(1 for f in res["faults"] if f["hit"])
        print(f"[{time.time() - self.t_start:7.0f}s] {system:<20} seed {seed}: goodput {res['goodput']:.3f} "
              f"(predicted {res['goodput_predicted']:.3f}), span {res['span_s']:.0f}s, {hits} fault(s) hit, "
              f"{res['restarts']} restart(s), eval loss " + (f"{res['eval_loss_final']:.4f}" if res["eval_loss_final"]
                                                        is not None else f"- (capped at {res['span_s']:.0f}s)")
              + f" ({time.time() - t0:.0f}s)",
              flush=True)
        return res

    def derive(self, res: dict[str, Any], run: RunConfig, faults: list[Fault]) -> None:
        """The figures computed from a run's stored record (again for a reused run)."""
        from ddloco.sim.replay import predict_run
        res["schedule"] = [[f.at_s, f.kind, f.target] for f in faults]
        res["goodput"] = goodput_of(res, self.st)
        res["goodput_predicted"] = round(predict_run(res, meta_of(self.st, run))["goodput"], 4)

    def run_all(self) -> bool:
        for seed in self.seeds:
            faults = self.faults(seed)
            kills = sum(1 for f in faults if f.kind == "learner_kill" and f.at_s < self.st.nominal_s)
            print(f"schedule   seed {seed}: {kills} kill(s) within the failure-free duration "
                  f"({len(faults)} planned up to 4x it)", flush=True)
            target = self.target(seed)
            runs = []
            for system in self.systems:
                if system == "torchft" and not torchft_installed():
                    self.skipped[system] = "the optional torchft package is not installed (pip install torchft-nightly)"
                    continue
                try:
                    res = self.one(system, seed, faults)
                except KeyboardInterrupt:
                    print("interrupted: the finished runs are in DIR/runs (--resume goes on from them)",
                          file=sys.stderr, flush=True)
                    return False
                except Exception as e:
                    self.failures.append(f"{system} seed {seed}: {e}")
                    print(f"FAILED     {system} seed {seed}: {e}", file=sys.stderr, flush=True)
                    continue
                if res is not None:
                    runs.append(res)
            if runs:
                with_targets(runs, target)
                for r in runs:
                    self.results[r["system"]].append(r)
        return True

    def write(self) -> int:
        from common.exits import FAILURE, OK
        from common.files import write_atomic
        from ddloco.compare.summary import mean_ci
        systems: dict[str, Any] = {}
        for s, runs in self.results.items():
            if not runs:
                continue
            entry: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
            for key in (*KEYS, "goodput_predicted", "span_s"):
                vals = [r.get(key) for r in runs]
                nums = [float(v) for v in vals if v is not None]
                m, lo, hi = mean_ci(nums) if nums else (None, None, None)
                entry[key] = {"mean": m, "ci95": [lo, hi], "values": vals}
            entry["faults_hit"] = [sum(1 for f in r["faults"] if f["hit"]) for r in runs]
            systems[s] = entry
        meta = {**meta_of(self.st, self.run),
                "tokens": self.st.steps * self.st.learners * self.st.per_batch,
                "noise": self.st.noise, "chaos": str(self.chaos) if self.chaos else None,
                "hetero": str(self.hetero) if self.hetero else None,
                "seeds": self.seeds, "target_loss": {str(r["seed"]): r["target_loss"] for v in self.results.values()
                                                     for r in v},
                "skipped": self.skipped, "failures": self.failures, "not_run": self.missing,
                "command": "ddloco compare " + " ".join(a for a in self.argv if a not in ("--resume", "--render-only")),
                "wall_s": round(time.time() - self.t_start, 1)}
        write_atomic(self.report / "compare.json", json.dumps({"meta": meta, "systems": systems}, indent=1))
        md = _markdown(systems, meta)
        write_atomic(self.report / "compare.md", md)
        if systems:
            from ddloco.compare.failure_plots import write_plots
            write_plots(self.report, self.results, systems)
        print(md, flush=True)
        return FAILURE if self.failures else OK


def _fmt(entry: dict[str, Any], digits: int = 3) -> str:
    m, (lo, hi) = entry["mean"], entry["ci95"]
    if m is None:
        return "never (capped)" if entry.get("capped") else "never"
    missing = sum(1 for v in entry["values"] if v is None)
    text = f"{m:.{digits}f}" if lo == hi else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
    return text + (f" ({missing} of {len(entry['values'])} never)" if missing else "")


def _markdown(systems: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"# ddloco compare, side by side: M = {meta['learners']}, {meta['steps_per_learner']} steps per learner "
             f"at {meta['step_time_floor_ms']:g} ms, seeds {meta['seeds']}",
             "", f"chaos: {meta['chaos']}; hetero: {meta['hetero']} (factors {meta['factors']}); "
             f"checkpoint every {meta['checkpoint_every']} steps. Mean [95 % CI] over seeds.", "",
             "| system | goodput | predicted (sim) | global downtime s | wall s to target | eval loss at equal wall "
             "| eval loss at equal tokens | restarts | tokens lost | bytes/token | faults hit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, e in systems.items():
        lines.append(f"| {s} | {_fmt(e['goodput'])} | {_fmt(e['goodput_predicted'])} | {_fmt(e['global_downtime_s'], 1)} "
                     f"| {_fmt(e['wall_s_to_target'], 1)} | {_fmt(e['eval_loss_at_wall'], 4)} "
                     f"| {_fmt(e['eval_loss_final'], 4)} | {_fmt(e['restarts'], 1)} | {_fmt(e['tokens_lost'], 0)} "
                     f"| {_fmt(e['bytes_per_token'], 1)} | {e['faults_hit']} |")
    for s, why in meta["skipped"].items():
        lines.append(f"| {s} | skipped: {why} | | | | | | | | | |")
    if meta["failures"]:
        lines += ["", "Failed runs: " + "; ".join(meta["failures"])]
    if meta.get("not_run"):
        lines += ["", "Not run: " + "; ".join(meta["not_run"])]
    return "\n".join(lines) + "\n"
