"""The runs of `ddloco compare --chaos/--hetero`, one system each on its real engine with the
schedule injected: the elastic jobs under torchrun (``run_elastic``), torchft's replica groups
(``run_torchft``), our cluster under `ddloco up` (``run_ours``); each returns the run's record
(ddloco/compare/failures.py lists the systems and figures).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.config import ConfigFile, RunConfig, override
from ddloco.chaos_plan import Fault
from ddloco.compare.side_setting import BOOT_ALLOWANCE_S, Setting, _advances_downtime, _free_port

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


def _torchrun(argv: list[str], env: dict[str, str], log_path: Path, injector: _Injector, done: threading.Event,
              cap_s: float) -> tuple[int, bool]:
    """torchrun with the injector started; (exit code, whether it was stopped at the cap)."""
    t_launch = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        injector.start()
        try:
            while True:
                try:
                    return proc.wait(timeout=0.2), False
                except subprocess.TimeoutExpired:
                    first = injector.t_start
                    if (first is not None and time.time() - first > cap_s) or time.time() - t_launch > cap_s + 300:
                        os.killpg(proc.pid, signal.SIGKILL)
                        return proc.wait(), True
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            done.set()
            injector.join(5)


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
    rc, capped = _torchrun(argv, env, workdir / "torchrun.log", injector, done, st.cap_s)
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


def ours_run(system: str, run: RunConfig, learners: int) -> RunConfig:
    """The run config of one of our variants (lock-step as `ddloco compare` makes it; K = 1 without
    the grace window)."""
    from ddloco.compare.settings import system_run
    if system == "decoupled_k1":
        return replace(run, algo=replace(run.algo, quorum=1, grace_enabled=False))
    return system_run(system, run, learners)


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
    from ddloco.compare.settings import cluster_bytes_per_token
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
