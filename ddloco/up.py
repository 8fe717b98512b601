"""`ddloco up`: a whole Decoupled DiLoCo cluster on this machine, as separate OS processes.

Order of events: embedded Redis (unless --redis-url) -> run config in Redis -> broker ->
S syncer shards -> M learners -> live progress, periodic evaluation of the global model ->
learners finish (--steps) or time runs out (--minutes) -> final evaluation -> shards stop
(checkpoint) -> broker -> Redis -> report. Ctrl-C stops everything it started the same way, and
the report's model is then the freshest complete one. A refused run leaves no work directory
(runs/<run-id>-<time>/) behind.

Modules: ``ddloco.up_plan`` (what to start: a pure plan), ``ddloco.cluster`` (the processes:
start, stop), ``ddloco.supervisor`` (their restarts), ``ddloco.resume`` (the state a stopped run
leaves for ``--resume``); this one runs the order of events above, one method per step.

Threads: the run's own state (``_UpRun``'s attributes) belongs to `up`'s main thread; a signal
handler only sets ``stop``. The hung-learner watchdog and the chaos harness run on threads of
their own and act only through the ``Supervisor`` (under its lock); the monitor evaluates on a
thread of its own (``ddloco/monitor.py`` says what it owns).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common import control, tokens as run_count
import json

from common.config import ConfigFile, dump_toml, override
from common import exits
from common.exits import FAILURE as EXIT_FAILURE, OK as EXIT_OK, REFUSED as EXIT_REFUSED
from common.keys import Keys
from ddloco.cluster import ROLE_ENV, Child, broker_endpoints, learner_redis_users, start_embedded_redis, stop_children
from ddloco.logs import print_digest
from ddloco.monitor import Monitor
from ddloco.report import add_chaos_results, broker_counters, check_report_dir, write_report
from ddloco.resume import (STATE_FILE, adopt_freshest_model, check_resume, final_token_shares, read_resumed_model,
                           write_state)
from ddloco.resume import new_run_id, resolve_resume  # noqa: F401 (`ddloco up`'s command line imports them here)
from ddloco.supervisor import Supervisor
from ddloco.up_plan import UpPlan, forks_learners, plan_up
from ddloco.up_dashboard import SCAVENGERS, page_snapshot, step_extra, write_report_html
from ddloco.up_tracking import Trackers

EXIT_DID_NOT_TRAIN = exits.DID_NOT_TRAIN
"""`up`'s exit status when every process ended well but the result is not trustworthy: a fragment
never merged or stopped merging, or the final model is no better than the initial one."""
EXIT_INTERRUPTED = 130
"""`up`'s exit status after Ctrl-C (or SIGTERM), as a shell reports SIGINT."""


def _refused(workdir: Path, problem: str) -> int:
    """The run's Redis refused it (before any daemon started): one line, exit 3, and the work
    directory just made for it removed (a refused run leaves nothing behind)."""
    import shutil
    print(f"ddloco up: {problem}", file=sys.stderr)
    shutil.rmtree(workdir, ignore_errors=True)
    return EXIT_REFUSED


@dataclass(frozen=True)
class _Ending:
    """Why `up`'s loop ended: every learner finished (all False), Ctrl-C, the time cap, a daemon died."""

    interrupted: bool = False
    timed_out: bool = False
    failure: str = ""

    @property
    def completed(self) -> bool:
        return not self.failure and not self.interrupted


class _UpRun:
    """One `up` run. The constructor makes every refusal that needs nothing started; ``run`` then
    goes through the order of events of the module docstring."""

    def __init__(self, cfg: ConfigFile, *, external_redis: bool, step_time_floor_ms: float | None,
                 slowdowns: list[float] | None, quiet: bool, resume: Path | None, chaos: Any,
                 extra: tuple[int, float, float] | None, insecure: bool, tensorboard: str | None,
                 broker_pub: str, broker_sub: str, wandb: str | None = None, wandb_name: str | None = None,
                 dashboard: Any = None, chaos_faults: list[Any] | None = None) -> None:
        from common.fragments import model_plan
        from common.task import bind_task, build_model, check_task
        self.up = up = cfg.up
        self.broker = broker_endpoints(broker_pub, broker_sub)   # a port in use: refused before anything starts
        # every refusal (task cannot load, P does not fit, bad batch or loss) before anything starts
        self.task, run = bind_task(cfg.run)
        self.model = build_model(self.task, run.task.seed)
        self.fragments = model_plan(self.model, self.task.embedding_names, run.algo.fragments)
        check_task(self.task, self.model, seed=run.task.seed)
        self.cfg = replace(cfg, run=run)
        self.previous: dict[str, Any] = json.loads((resume / STATE_FILE).read_text()) if resume is not None else {}
        if resume is not None:
            check_resume(self.previous, up.syncers)
        if up.report_dir:   # the last refusal but one: it creates the directory
            check_report_dir(Path(up.report_dir))
        # --tensorboard, --wandb: a wandb run that cannot start is refused here
        self.trackers = Trackers(tensorboard=tensorboard, wandb=wandb, wandb_name=wandb_name or self.cfg.endpoints.run_id,
                                 wandb_config={"run_id": self.cfg.endpoints.run_id, "learners": up.learners,
                                               "syncers": up.syncers, **self.cfg.run.to_dict()})
        self.external_redis, self.step_time_floor_ms, self.slowdowns = external_redis, step_time_floor_ms, slowdowns
        self.quiet, self.resume, self.chaos, self.extra, self.chaos_faults = quiet, resume, chaos, extra, chaos_faults
        self.insecure, self.dashboard = insecure, dashboard   # dashboard: an up_dashboard.UpDashboard or None
        self.redis_srv: Any = None
        self.sup: Supervisor | None = None
        self.extras: list[Child] = []
        self.chaos_runner: Any = None
        self.resumed_state: Any = None

    def run(self) -> int:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.workdir = Path("runs") / f"{self.cfg.endpoints.run_id}-{stamp}"
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.say = (lambda *a: None) if self.quiet else (lambda msg: print(msg, flush=True))
        self.stop = threading.Event()
        self.stop_chaos = threading.Event()
        prev_handlers = {s: signal.signal(s, lambda *_: self.stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        self.t_start = time.time()
        rc = EXIT_FAILURE
        try:
            rc = self._run()
            return rc
        finally:
            self._clean_up(prev_handlers, rc)

    def _run(self) -> int:
        ROLE_ENV.clear()
        if not self.external_redis:
            self.redis_srv = start_embedded_redis(self.cfg.endpoints.run_id, log_dir=self.workdir / "logs",
                                                  insecure=self.insecure, say=self.say)
        self._configure()
        refused = self._publish_run()
        if refused is not None:
            return refused
        self._plan()
        self._secure()
        self._write_access()
        self._start_processes()
        self._start_monitor()
        if self.dashboard is not None:   # the page (and the operator's actions, carried out in _supervise)
            self.dashboard.start_in(self)
        ending = self._supervise()
        learners, daemons, bad = self._stop_learners()
        self.page_snapshot = page_snapshot(self)   # report.html's views, read while Redis still runs
        self._final_model(ending, daemons)
        report = self._report(ending, learners)
        self._save(report)
        return self._exit_status(ending, bad, report)

    def _log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def _configure(self) -> None:
        """The run's config as the daemons read it (config.toml): its Redis, broker, checkpoints."""
        redis_srv = self.redis_srv
        self.redis_url = redis_srv.url if redis_srv else self.cfg.endpoints.redis_url
        # no password in files: the daemons get the URL that has it in their environment
        self.shown_url = f"redis://{redis_srv.host}:{redis_srv.port}/0" if redis_srv else control.redact(self.redis_url)
        if redis_srv is None and self.shown_url != self.redis_url:
            for role in ("broker", "shard", "learner"):
                ROLE_ENV[role] = {"DDLOCO_REDIS_URL": self.redis_url}
        endpoints = override(self.cfg.endpoints, redis_url=self.shown_url, broker_pub=self.broker.pub,
                             broker_sub=self.broker.sub)
        ckpt_dir = (self.resume / "checkpoints") if self.resume is not None else (self.workdir / "checkpoints")
        syncer = override(self.cfg.syncer, checkpoint_dir=str(ckpt_dir), shards=self.up.syncers)
        self.cfg = replace(self.cfg, endpoints=endpoints, syncer=syncer)
        self.cfg_path = self.workdir / "config.toml"
        self.cfg_path.write_text(dump_toml(self.cfg))

    def _publish_run(self) -> int | None:
        """The run config into Redis (the learners resume their data streams and the LR schedule's
        count goes on); the exit status of a refusal, else None."""
        from common.fragments import state_tensors
        run_id, up, previous = self.cfg.endpoints.run_id, self.up, self.previous
        r = self.r = control.connect(self.redis_url)
        keys = self.keys = Keys(run_id)
        if self.external_redis and r.exists(keys.config):
            return _refused(self.workdir, f"run {run_id!r} already exists in {control.redact(self.redis_url)}; "
                                          f"choose another --run-id")
        try:
            control.publish_run_config(r, keys, self.cfg.run)
        except control.ConfigMismatch as e:
            return _refused(self.workdir, f"{e}; choose another --run-id")
        for lid, pos in previous.get("data_positions", {}).items():  # learners resume their data streams
            r.hset(keys.learner(lid), "data_position", int(pos))
        run_count.record(r, keys, previous.get("token_shares", {}))  # the LR schedule's count goes on
        if self.resume is not None:
            self.say(f"resume     {self.resume}: checkpoints of {up.syncers} shards, versions "
                     f"{previous.get('versions_total')}, {previous.get('tokens_total', 0):,} tokens so far")
        n_values = sum(t.numel() for t in state_tensors(self.model).values())
        algo = self.cfg.run.algo
        self.say(f"run        {run_id}: task {self.cfg.run.task.name} ({n_values:,} values), {up.learners} learners, "
                 f"{up.syncers} shards, "
                 f"P={algo.fragments} H={algo.sync_every_steps} tau={algo.tau} "
                 f"K={algo.quorum} codec={algo.uplink_codec}; logs in {self.workdir}/logs")
        return None

    def _plan(self) -> None:
        # every daemon's /metrics on a free loopback port; a restarted process (or the spare that
        # replaces a learner) serves on its slot's port again
        from common.redis_server import free_port
        self.plan: UpPlan = plan_up(
            learners=self.up.learners, syncers=self.up.syncers, steps=self.up.steps,
            config_path=str(self.cfg_path), insecure=self.insecure, port=free_port, cpu_count=os.cpu_count() or 1,
            slowdowns=self.slowdowns, extra_learners=(self.extra[0] if self.extra else 0) + (SCAVENGERS if self.dashboard else 0),
            step_time_floor_ms=self.step_time_floor_ms, learner_threads=self.up.learner_threads)

    def _secure(self) -> None:
        """Secure by default: a key pair per member, CURVE on every socket, the allow list of this
        run; a Redis with a password gets a user per learner."""
        if self.insecure:
            self.say("security   --insecure: no CURVE on ZeroMQ sockets" + ("" if self.redis_srv is None else
                     ", Redis without a password") + " (anyone who reaches the ports can join)")
            return
        from common.security import create_keys
        resume = self.resume
        keys_dir = (resume / "keys") if resume is not None and (resume / "keys").is_dir() else self.workdir / "keys"
        members = list(self.plan.learner_ids + self.plan.extra_ids)
        create_keys(keys_dir, learners=members, shards=self.up.syncers, monitors=["monitor"])
        self.cfg = replace(self.cfg, endpoints=override(self.cfg.endpoints, keys_dir=str(keys_dir.absolute())))
        self.cfg_path.write_text(dump_toml(self.cfg))
        self.say(f"security   CURVE keys in {keys_dir}" + ("" if self.redis_srv is None else
                 "; embedded Redis with a random password (in each daemon's environment)"))
        if self.redis_srv is not None or self.shown_url != self.redis_url:   # a Redis with a password
            own = learner_redis_users(self.redis_url, self.cfg.endpoints.run_id, members, self.say,
                                      server=self.redis_srv)
            if own:
                self.say(f"redis      a Redis user per learner ({len(own)}): each writes only its own keys")

    def _write_access(self) -> None:
        access = self.workdir / "access.env"   # what an operator's own commands need (status, export, chaos, fuzz)
        keys_dir = self.cfg.endpoints.keys_dir
        with open(os.open(access, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(f"DDLOCO_REDIS_URL={self.redis_url}\n" + (f"DDLOCO_KEYS={keys_dir}\n" if keys_dir
                     else "DDLOCO_INSECURE=1\n") + (self.dashboard.access_line() if self.dashboard else ""))
        self.say(f"access     {access} (mode 0600): `set -a; . {access}; set +a`, then e.g. "
                 f"`ddloco status --config {self.cfg_path}`")

    def _start_processes(self) -> None:
        """The broker, the shards, the learners (forks of one standby factory where possible)."""
        from common.wire import max_frame_bytes
        from learner.core import resolve_device   # a process that set CUDA up cannot be forked
        plan, up, broker = self.plan, self.up, self.broker
        if self.resume is not None:
            self.resumed_state = read_resumed_model(self.cfg.syncer.checkpoint_dir, self.cfg.endpoints.run_id,
                                                    self.task, self.say)
        sup = self.sup = Supervisor(workdir=self.workdir, learner_argv=plan.learner_argv, slots=dict(plan.slots),
                                    steps=up.steps, checkpoint_dir=self.cfg.syncer.checkpoint_dir,
                                    run_id=self.cfg.endpoints.run_id, shards=up.syncers, redis_srv=self.redis_srv)
        import torch
        sup.fork_spares = forks_learners(has_fork=hasattr(os, "fork"),
                                         device=resolve_device(self.cfg.learner.device).type,
                                         cuda_visible=torch.cuda.is_available())
        max_message_mb = max_frame_bytes(max(f.numel for f in self.fragments)) / (1 << 20)
        sup.add(Child("broker", plan.broker_argv(xsub_bind=broker.xsub_bind, xpub_bind=broker.xpub_bind,
                                                 run_id=self.cfg.endpoints.run_id, fragments=len(self.fragments),
                                                 max_message_mb=max_message_mb), self._log("broker")))
        for k in range(up.syncers):
            sup.add(Child(f"shard{k}", plan.shard_argv(k), self._log(f"syncer-{k}")))
        if sup.fork_spares:
            # one process imports torch, builds the model and warms AdamW up (~5 s of CPU), and
            # every learner is a fork of it: a start, and any restart, without paying that again
            sup.spares_wanted = 1
            sup.start_spare()
            for lid in plan.learner_ids:
                sup.add(sup.fork(lid, up.steps, self._log(lid)))
        else:
            for i, lid in enumerate(plan.learner_ids):
                sup.add(Child(lid, plan.learner_argv(lid, i), self._log(lid)))
        self.say(f"started    broker (publish {broker.pub}, subscribe {broker.sub}), {up.syncers} syncer(s), "
                 f"{up.learners} learner(s): " + " ".join(f"{c.name}={c.pid or 'fork'}" for c in sup.all()))
        (self.workdir / "metrics.json").write_text(json.dumps(plan.metrics_urls, indent=2))
        self.say(f"metrics    Prometheus /metrics on 127.0.0.1 ({self.workdir / 'metrics.json'}): "
                 + " ".join(f"{name}:{port}" for name, port in plan.metrics_ports.items()))

    def _start_monitor(self) -> None:
        """The monitor's first evaluation, the hung-learner watchdog, the chaos harness's spares."""
        sup = self.sup
        assert sup is not None
        monitor = self.monitor = Monitor(self.cfg, self.r, self.keys, self.task,
                                         learner_ids=list(self.plan.learner_ids), say=self.say)
        sup.monitor = monitor
        if self.resume is not None:
            monitor.resumed = True
            monitor.token_offset = int(self.previous.get("tokens_total", 0))
        self.trackers.attach(monitor, self.say)
        monitor.evaluate(initial=True, state=self.resumed_state)
        if self.up.replace_hung_s > 0:
            threading.Thread(target=sup.watch_hung, name="hung-watchdog", daemon=True,
                             args=(self.redis_url, self.keys, self.up.replace_hung_s, self.say,
                                   self.stop_chaos)).start()
        chaos = self.chaos
        if chaos is not None and (chaos.learner_mtbf_s > 0 or chaos.stalls):
            # hot spares replace a killed learner in well under a second: one factory that forks
            # a prepared copy per failure (a burst of failures drained a pool of 3 standby
            # processes, whose replacements then took 10-30 s to boot on a loaded machine)
            sup.spares_wanted = 1 if sup.fork_spares else 3
            sup.start_spare()

    def _start_chaos(self) -> Any:
        """Once every learner trains: the schedule covers the rest of the run."""
        from ddloco.chaos import ChaosRunner, plan_faults
        chaos, now = self.chaos, time.time()
        faults = list(self.chaos_faults or plan_faults(chaos, duration_s=max(1.0, self.deadline - now),
                                                       learners=list(self.plan.learner_ids), shards=self.up.syncers))
        self.say(f"chaos      {len(faults)} faults over the next {(self.deadline - now) / 60:.1f} min ({chaos}): "
                 + ", ".join(f"{k} {sum(1 for f in faults if f.kind == k)}" for k in
                             dict.fromkeys(f.kind for f in faults)))
        runner = ChaosRunner(faults, self.sup, redis_url=self.redis_url, keys=self.keys, t0=now, say=self.say,
                             stop=self.stop_chaos, stall_s=chaos.stall_s)
        runner.report_t0 = now - self.monitor.t0
        runner.start()
        return runner

    def _start_extra(self, lid: str, index: int) -> Child:
        self.monitor.add_learner(lid)
        return Child(lid, self.plan.learner_argv(lid, index), self._log(lid))

    def _supervise(self) -> _Ending:
        """`up`'s loop, once a second: progress, the chaos harness once every learner trains,
        --extra, restarts; until every learner ended, a daemon died, the time cap or Ctrl-C."""
        sup, monitor, learner_ids = self.sup, self.monitor, self.plan.learner_ids
        assert sup is not None
        self.extra_state = "waiting" if self.extra and self.extra[0] > 0 else "none"
        self.deadline = self.t_start + self.up.minutes * 60
        while True:
            if self.stop.wait(1.0):
                self.say("interrupted: stopping everything")
                return _Ending(interrupted=True)
            monitor.tick()
            now = time.time()
            if self.chaos is not None and self.chaos_runner is None and (
                    all(monitor.learners.get(lid, {}).get("status") == "training" for lid in learner_ids)
                    or now - self.t_start > 120):
                self.chaos_runner = self._start_chaos()
            step_extra(self, now)
            if self.dashboard is not None:
                self.dashboard.tick(now, self.say)
            dead, learners = sup.check(self.say)
            if dead:
                return _Ending(failure=f"{dead[0].name} exited with {dead[0].proc.returncode}:\n{dead[0].log_tail()}")
            if all(not c.alive() for c in learners):
                return _Ending()
            if now >= self.deadline or (self.dashboard is not None and self.dashboard.stop_asked.is_set()):
                self.say(f"time cap of {self.up.minutes} min reached: stopping learners" if now >= self.deadline
                         else "stop asked from the dashboard: stopping learners (as at the time cap)")
                return _Ending(timed_out=True)

    def _stop_learners(self) -> tuple[list[Child], list[Child], list[Child]]:
        """No more replacements or faults; the learners stop, then the spares. Returns the
        learners, the daemons (still running) and the learners that ended badly."""
        sup = self.sup
        assert sup is not None
        sup.halted = True        # no more replacements; the watchdog thread lives on (parent-death signal)
        if self.chaos_runner is not None:
            self.chaos_runner.halt()  # no more faults; its thread lives on until everything stopped
        stop_children(self.extras)
        if self.dashboard is not None:
            self.dashboard.close()
        with sup.lock:
            learners = sup.learners()
            spares, sup.spares, sup.spares_wanted = sup.spares, [], 0
        stop_children(learners)
        stop_children(spares)   # after the learners: a standby factory reports its forks' exit status
        daemons = sup.daemons()
        bad = [c for c in learners if c.proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM)]
        for c in bad:   # an error, so printed even with --quiet
            print(f"ddloco up: {c.name} exited with {c.proc.returncode}: {c.log_tail(3)}", file=sys.stderr, flush=True)
        return learners, daemons, bad

    def _final_model(self, ending: _Ending, daemons: list[Child]) -> None:
        """The final evaluation, the daemons stopped, and the run's final model: the shards'
        checkpoints (or on Ctrl-C the freshest complete model)."""
        monitor, checkpoint_dir, run_id = self.monitor, self.cfg.syncer.checkpoint_dir, self.cfg.endpoints.run_id
        monitor.last_eval = time.time()   # no new periodic evaluation now; one still running ends first
        monitor.tick()
        monitor.check_fragments()
        monitor.wait_evaluation(60.0)
        if ending.completed:
            monitor.evaluate(final=True)
        stop_children(daemons)
        self.token_shares = final_token_shares(self.r, self.keys, self.previous)
        if ending.completed:
            # merges of the learners' last answers may land after that evaluation: the shards'
            # checkpoints (written when they stop) hold the run's true final model
            from ddloco.export import ExportError, from_checkpoints
            try:
                monitor.adopt_final(*from_checkpoints(checkpoint_dir, run_id, task=self.task))
            except (ExportError, OSError, ValueError) as e:  # ValueError: TaskError, ConfigError
                self.say(f"final      checkpoints unreadable ({e}); the report keeps the live evaluation")
            monitor.recalibrate_final()   # Task.recalibrate_bn_batches: the report's final model, re-estimated
        if ending.interrupted:
            adopt_freshest_model(monitor, checkpoint_dir, run_id, self.task, self.say)

    def _report(self, ending: _Ending, learners: list[Child]) -> dict[str, Any]:
        sup, monitor = self.sup, self.monitor
        assert sup is not None
        report = monitor.report(wall_s=time.time() - self.t_start, interrupted=ending.interrupted,
                                timed_out=ending.timed_out, failure=ending.failure,
                                learner_exit_codes={c.name: c.proc.returncode for c in learners})
        if self.chaos_runner is not None:
            add_chaos_results(report, self.chaos_runner, sup, chaos=self.chaos, marks=monitor.marks)
        report["hung_replaced"] = sup.hung_replaced
        report["crash_restarts"] = dict(sup.crash_restarts)
        report["metrics_endpoints"] = self.plan.metrics_urls
        report["security"] = {"curve": not self.insecure,
                              "redis_auth": (bool(self.redis_srv.password) if self.redis_srv is not None
                                             else self.shown_url != self.redis_url),
                              "redis_tls": self.redis_url.startswith("rediss://")}
        report.update(broker_counters(self.r, self.keys))
        if self.extra is not None and self.extra[0] > 0:
            report["extra_learners"] = monitor.extra_effect(self.extra)
        if self.redis_srv is not None:
            self.redis_srv.stop()
            self.redis_srv = None
        report["processes_left"] = [c.name for c in sup.all() + self.extras if c.alive()]
        report["checkpoint_dir"] = self.cfg.syncer.checkpoint_dir
        if self.resume is not None:
            report["resumed_from"] = str(self.resume)
            report["eval_curve_before"] = self.previous.get("eval_curve", [])
        return report

    def _save(self, report: dict[str, Any]) -> None:
        """state.json for --resume, the report and the final model, the closing lines."""
        monitor, say, resume, workdir = self.monitor, self.say, self.resume, self.workdir
        checkpoint_dir = self.cfg.syncer.checkpoint_dir
        # the state lives next to the checkpoints it describes (a resumed run keeps the first
        # part's directory), so the next --resume finds both, however many parts came before
        write_state(resume if resume is not None else workdir, report, monitor, self.up.syncers, self.previous,
                    self.token_shares)
        self.trackers.add_report(report)
        if self.up.report_dir:
            report_dir = Path(self.up.report_dir)
            write_report(report_dir, report, monitor)
            write_report_html(report_dir / "report.html", self, report)
            say(f"report     {report_dir / 'report.json'} (+ report.html, eval_loss.png, merges.png, timeline.png)")
            if monitor.final_versions is not None:
                from ddloco.export import save_state
                path = save_state(monitor.model, report_dir / "model.safetensors")
                say(f"model      {path}: the final global model (load_state_dict into task.model(), strict)")
                self._save_task_format(report_dir / "hf")
        say(f"state      checkpoints in {checkpoint_dir}: `ddloco up --resume {resume or workdir}` continues "
            f"this run, `ddloco export --checkpoint-dir {checkpoint_dir} --out model.safetensors` exports it")
        say(monitor.summary_line(report))
        print_digest(workdir / "logs", say)   # the daemons' warnings (and errors, even under --quiet)

    def _save_task_format(self, out_dir: Path) -> None:
        """The final model in the task's own format (``Task.save``: for ``--task hf`` a directory
        ``from_pretrained`` opens); a task without ``save`` has none."""
        from ddloco.export import save_for_report
        if save_for_report(self.monitor.model, self.task, out_dir):
            self.say(f"model      {out_dir}: the final global model in the task's own format (Task.save)")

    def _exit_status(self, ending: _Ending, bad: list[Child], report: dict[str, Any]) -> int:
        if ending.failure:
            print(f"ddloco up: {ending.failure}", file=sys.stderr)
            return EXIT_FAILURE
        if ending.interrupted:
            return EXIT_INTERRUPTED
        if bad:
            return EXIT_FAILURE
        problems = self.monitor.problems(report)
        for line in problems:   # loud, and in the exit status: a run that did not work never reads as success
            print(f"ddloco up: the run did not train as it should: {line}", file=sys.stderr, flush=True)
        return EXIT_DID_NOT_TRAIN if problems else EXIT_OK

    def _clean_up(self, prev_handlers: dict[int, Any], rc: int) -> None:
        """Whatever is still running stops, even after an exception; the signal handlers come back."""
        if self.sup is not None:
            stop_children(self.sup.all(), timeout_s=5.0)
        stop_children(self.extras, timeout_s=5.0)
        self.stop_chaos.set()  # after the processes it restarted are stopped (their parent-death signal)
        if self.redis_srv is not None:
            self.redis_srv.stop()
        self.trackers.close(rc)
        ROLE_ENV.clear()
        for s, h in prev_handlers.items():
            signal.signal(s, h)


def run_up(cfg: ConfigFile, *, external_redis: bool, step_time_floor_ms: float | None = None,
           slowdowns: list[float] | None = None, quiet: bool = False, resume: Path | None = None,
           chaos: Any = None, extra: tuple[int, float, float] | None = None, insecure: bool = False,
           tensorboard: str | None = None, broker_pub: str = "", broker_sub: str = "", wandb: str | None = None,
           wandb_name: str | None = None, dashboard: Any = None, chaos_faults: list[Any] | None = None) -> int:
    """A whole cluster until the learners' step budget or the time cap; ``resume`` is the work
    directory of a stopped run to continue (same run id, shard checkpoints, learner positions);
    ``tensorboard`` a directory for the eval loss's TensorBoard event files; ``wandb`` a wandb
    project to log the run's figures to (``wandb_name`` its run's name; None: the run id); ``broker_pub`` / ``broker_sub``
    the broker's endpoints (empty: free ports); ``chaos_faults`` a whole schedule instead of one drawn from ``chaos``."""
    return _UpRun(cfg, external_redis=external_redis, step_time_floor_ms=step_time_floor_ms, slowdowns=slowdowns,
                  quiet=quiet, resume=resume, chaos=chaos, extra=extra, insecure=insecure, tensorboard=tensorboard, wandb=wandb,
                  broker_pub=broker_pub, broker_sub=broker_sub, wandb_name=wandb_name, dashboard=dashboard,
                  chaos_faults=chaos_faults).run()
