"""`ddloco up`: a whole Decoupled DiLoCo cluster on this machine, as separate OS processes.

Order of events: embedded Redis (unless --redis-url) -> run config in Redis -> broker ->
S syncer shards -> M learners -> live progress, periodic evaluation of the global model ->
learners finish (--steps) or time runs out (--minutes) -> final evaluation -> shards stop
(checkpoint) -> broker -> Redis -> report. Ctrl-C stops everything it started the same way, and
the report's model is then the freshest complete one. A refused run leaves no work directory
(runs/<run-id>-<time>/) behind.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from common import control, tokens as run_count
from common import entries
import json

from common.config import ConfigError, ConfigFile, check_value, dump_toml, endpoint_problem, override
from common.keys import Keys
from common.lifecycle import die_with_parent, pid_alive
from common.exits import REFUSED as EXIT_REFUSED, USAGE as EXIT_USAGE
from common.security import redis_acl_rules
from ddloco.logs import print_digest
from ddloco.monitor import Monitor
from ddloco.report import check_report_dir, write_report


ROLE_ENV: dict[str, dict[str, str]] = {}
"""Extra environment of ``up``'s children by role (broker, shard, learner): their Redis URL with
the role's ACL user and password, kept off the command line. Set by ``run_up`` for its run."""


def _own_redis_url(learner_id: str) -> dict[str, str]:
    """A standby's order names the Redis URL of the learner it becomes (its own user), if it has one."""
    url = ROLE_ENV.get(learner_id, {}).get("DDLOCO_REDIS_URL")
    return {"redis_url": url} if url else {}


def learner_redis_users(admin_url: str, run_id: str, learner_ids: list[str],
                        say: Callable[[str], None], server: Any = None) -> dict[str, str]:
    """Per-learner Redis users (common/redis_acl.py) for ``learner_ids`` through the admin URL:
    ``{learner id: its Redis URL}``, and ``ROLE_ENV`` set so that each learner process (and a
    standby that becomes it) gets its own; ``server`` (an EmbeddedRedis) keeps them across its
    restarts. On a Redis < 7, or a URL that may not create users:
    {} and one warning line (the learners keep the role's user or the URL given)."""
    import redis
    from common import redis_acl
    admin = control.connect(admin_url)
    try:
        version = redis_acl.server_version(admin)
        if not redis_acl.has_selectors(version):
            say("warning    " + redis_acl.FALLBACK_WARNING.format(version=".".join(map(str, version))))
            return {}
        passwords = {lid: redis_acl.add_learner_user(admin, run_id, lid) for lid in learner_ids}
    except (redis.RedisError, ValueError) as e:
        say(f"warning    no per-learner Redis users ({e}); the learners use {control.redact(admin_url)}'s user")
        return {}
    finally:
        admin.close()
    urls = {}
    for lid, password in passwords.items():
        urls[lid] = redis_acl.user_url(admin_url, redis_acl.learner_user(lid), password)
        ROLE_ENV[lid] = {"DDLOCO_REDIS_URL": urls[lid]}
        if server is not None:   # in its config file too: a restarted embedded Redis keeps the user
            server.users[redis_acl.learner_user(lid)] = f"on >{password} {redis_acl.learner_rules(run_id, lid)}"
    return urls


def _role(name: str) -> str:
    return "broker" if name == "broker" else "shard" if name.startswith("shard") else "learner"


class Child:
    """A daemon process started by `up`, with its log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, *, append: bool = False,
                 stdin: bool = False) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab" if append else "wb")
        env = {**{k: v for k, v in os.environ.items() if k not in ("DDLOCO_TASK", "DDLOCO_TASK_ARGS")},
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",  # the task comes with the config file
               **ROLE_ENV.get(_role(name), {}), **ROLE_ENV.get(name, {})}   # a learner's own Redis user
        # own session: Ctrl-C reaches `up` only, which then stops each child once (SIGTERM);
        # the parent-death signal still stops children if `up` itself is killed
        parent = os.getpid()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     preexec_fn=lambda: die_with_parent(parent), start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def order(self, orders: dict[str, Any]) -> None:
        """A standby learner: become the learner ``orders`` names (one JSON line on its stdin)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(orders) + "\n").encode())
        self.proc.stdin.flush()

    def log_tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class ForkedProc:
    """What ``Child`` needs of a ``Popen``, for a learner forked by a standby factory (a child of
    the factory, not of ``up``): its pid comes in a reply file, its exit status in another (the
    factory reaps it); a factory that died takes its forks with it (parent-death signal)."""

    def __init__(self, factory: Child, reply: Path) -> None:
        self.factory = factory
        self.reply = reply
        self.returncode: int | None = None
        self.stdin = None
        self._pid: int | None = None
        self.lost = False
        """Its factory died before the fork, or before reporting how the fork ended."""

    @property
    def pid(self) -> int | None:
        if self._pid is None:
            try:
                self._pid = int(self.reply.read_text())
            except (OSError, ValueError):
                return None
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            self.returncode = int(Path(str(self.reply) + ".exit").read_text())
        except (OSError, ValueError):
            if not self.factory.alive():
                pid = self.pid
                if pid is None or not pid_alive(pid):
                    self.returncode = -signal.SIGKILL   # never forked, or gone with its factory
                    self.lost = True
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked learner {self.reply.stem}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGKILL and self.pid is None and self.poll() is None:
            # ordered, not forked yet (the factory is still booting): give the fork 2 s to appear
            deadline = time.monotonic() + 2.0
            while self.pid is None and self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        pid = self.pid
        if pid is not None and self.poll() is None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedChild(Child):
    """A learner forked by a standby factory (``learner --standby`` given a fork order)."""

    def __init__(self, name: str, factory: Child, orders: dict[str, Any], log_path: Path, reply: Path) -> None:
        self.name = name
        self.argv = factory.argv
        self.log_path = log_path
        self._log = open(log_path, "ab")
        reply.parent.mkdir(parents=True, exist_ok=True)
        self.proc = ForkedProc(factory, reply)  # type: ignore[assignment]
        factory.order({**orders, "fork": True, "log": str(log_path), "reply": str(reply)})

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        self._log.close()


def _write_state(workdir: Path, report: dict[str, Any], monitor: Monitor, syncers: int,
                 previous: dict[str, Any], token_shares: dict[str, int]) -> None:
    """What a later ``up --resume`` needs: learners' data positions, tokens (the total and every
    learner process's share of the run's count, common/tokens.py), the eval curve."""
    positions = dict(previous.get("data_positions", {}))
    for lid, h in monitor.learners.items():
        if "data_position" in h:
            positions[lid] = int(float(h["data_position"]))
    versions = monitor.final_versions or {}
    state = {"run_id": report["run_id"], "syncers": syncers, "tokens_total": report["tokens_total"],
             "token_shares": token_shares, "data_positions": positions, "versions_total": sum(versions.values()),
             "eval_curve": previous.get("eval_curve", []) + report["eval_curve"]}
    tmp = workdir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(workdir / STATE_FILE)


def _final_token_shares(r: Any, keys: Keys, previous: dict[str, Any]) -> dict[str, int]:
    """Every learner process's final share of the run's token count, earlier parts' included
    (read when all stopped; the earlier parts' alone if Redis cannot be read)."""
    import redis as redis_lib
    try:
        return run_count.merge_shares({}, r.hgetall(keys.token_shares))
    except redis_lib.RedisError:
        return run_count.merge_shares({}, previous.get("token_shares", {}))


def _refused(workdir: Path, problem: str) -> int:
    """The run's Redis refused it (before any daemon started): one line, exit 3, and the work
    directory just made for it removed (a refused run leaves nothing behind)."""
    import shutil
    print(f"ddloco up: {problem}", file=sys.stderr)
    shutil.rmtree(workdir, ignore_errors=True)
    return EXIT_REFUSED


def _adopt_freshest_model(monitor: Monitor, checkpoint_dir: str, run_id: str, task: Any,
                          say: Callable[[str], None]) -> None:
    """Ctrl-C: the freshest complete global model becomes the run's final one (the report's last
    loss, model.safetensors, state.json): the shards' checkpoints, written as they stopped, unless
    the last live evaluation holds more merges (a shard that did not stop in time)."""
    from ddloco.export import ExportError, from_checkpoints
    monitor.wait_evaluation()
    live = sum(monitor.versions.values())
    try:
        model, versions = from_checkpoints(checkpoint_dir, run_id, task=task)
    except (ExportError, OSError, ValueError) as e:  # ValueError: TaskError, ConfigError
        model, versions = None, {}
        say(f"final      checkpoints unreadable ({e})")
    if model is not None and sum(versions.values()) >= live:
        monitor.adopt_final(model, versions)
    else:
        monitor.final_versions = dict(monitor.versions)
        say(f"final      the last live evaluation (fragment versions {live}) is the final model")


def _ddloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddloco", *args]


def _stop_all(children: list[Child], timeout_s: float = 15.0) -> None:
    for c in children:
        c.terminate()
    deadline = time.monotonic() + timeout_s
    for c in children:
        c.wait(max(0.1, deadline - time.monotonic()))
    for c in children:
        c.kill()


SPARE_FAILURES_MAX = 3
CRASH_RESTARTS_MAX = 3


class Supervisor:
    """The processes ``up`` started and how to start each again: the chaos harness kills them and
    the supervisor restarts them at once (a learner by promoting the hot spare when one is
    ready, a standby process that already imported torch and built the model)."""

    def __init__(self, *, workdir: Path, learner_argv: Callable[[str, int], list[str]],
                 slots: dict[str, dict[str, Any]], steps: int, monitor: Monitor | None = None,
                 checkpoint_dir: str = "", run_id: str = "", shards: int = 1, redis_srv: Any = None) -> None:
        self.workdir = workdir
        self.learner_argv = learner_argv
        self.slots = slots
        self.steps = steps
        self.monitor = monitor
        self.checkpoint_dir = checkpoint_dir
        self.run_id = run_id
        self.shards = shards
        self.redis_srv = redis_srv
        self.children: list[Child] = []
        self.spares: list[Child] = []
        """Standby learner processes, oldest (most likely ready) first."""
        self.spares_wanted = 0
        self.spares_started = 0
        self.spares_used = 0
        self.spares_failed: list[str] = []
        """Standby processes that exited before they were used (the last lines of their logs): a
        spare that cannot start is not started again and again (each one costs an interpreter and
        a torch import), the pool is given up after SPARE_FAILURES_MAX."""
        self.fork_spares = True
        """The standby pool is one factory process that forks a prepared learner per failure
        (any number at once, none paying the imports); False: each standby becomes one learner."""
        self.forks = 0
        self.hung_replaced = 0
        self.crash_restarts: dict[str, int] = {}
        """Learner id -> times it was started again after exiting on its own with a failure."""
        self.last_beat: dict[str, tuple[int, float, str]] = {}
        """Learner id -> (pid, time, status) of the last heartbeat seen from that process."""
        self.halted = False
        """The run is ending: nothing is replaced any more."""
        self.lock = threading.RLock()

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def add(self, child: Child) -> Child:
        with self.lock:
            self.children.append(child)
        return child

    def learners(self) -> list[Child]:
        with self.lock:
            return [c for c in self.children if c.name in self.slots]

    def daemons(self) -> list[Child]:
        with self.lock:
            return [c for c in self.children if c.name not in self.slots]

    def all(self) -> list[Child]:
        with self.lock:
            return self.children + self.spares

    def start_spare(self) -> None:
        """Top the standby pool up to ``spares_wanted`` processes."""
        with self.lock:
            self._drop_dead_spares()
            while len(self.spares) < self.spares_wanted:
                self.spares_started += 1
                n = self.spares_started
                argv = self.learner_argv("standby", 0) + ["--standby"]
                self.spares.append(Child(f"spare-{n}", argv, self.log(f"spare-{n}"), stdin=True))

    def fork(self, target: str, steps: int, log_path: Path) -> ForkedChild:
        """Learner ``target`` as a fork of the standby factory (``self.spares[0]``)."""
        slot = self.slots[target]
        self.forks += 1
        orders = {"learner_id": target, "data_shard": slot["index"], "max_steps": steps,
                  "slowdown": slot.get("slowdown"), "metrics_port": slot.get("metrics_port"),
                  **_own_redis_url(target)}
        return ForkedChild(target, self.spares[0], orders, log_path,
                           self.workdir / "forks" / f"{target}-{self.forks}.pid")

    def _drop_dead_spares(self) -> None:
        """Forget spares that exited; count the ones that failed and give the pool up after
        SPARE_FAILURES_MAX of them (replacements then start cold, as without spares)."""
        for c in [c for c in self.spares if not c.alive()]:
            self.spares.remove(c)
            if c.proc.returncode not in (0, None):
                self.spares_failed.append(f"{c.name} exit {c.proc.returncode}: {c.log_tail(2)}")
                if len(self.spares_failed) >= SPARE_FAILURES_MAX and self.spares_wanted:
                    self.spares_wanted = 0
                    print(f"ddloco up: {len(self.spares_failed)} standby learners failed to start; no more "
                          f"spares (replacements start cold). Last: {self.spares_failed[-1]}",
                          file=sys.stderr, flush=True)
            c.kill()

    def _remaining_steps(self, lid: str) -> int:
        if not self.steps:
            return 0
        try:
            done = sum(int(float(h.get("steps", 0))) for h in self.monitor._lives_of(lid)) if self.monitor else 0
        except RuntimeError:  # the monitor is updating its table: the full budget errs on the safe side
            done = 0
        return max(1, self.steps - done)

    # ---- chaos.Targets
    def pid(self, target: str) -> int | None:
        with self.lock:
            for c in self.children:
                if c.name == target and c.alive():
                    return c.pid
        return None

    def restart(self, target: str) -> None:
        with self.lock:
            old = next(c for c in self.children if c.name == target)
            if old.wait(5.0) is None:  # the caller killed it: reap it first
                raise RuntimeError(f"{target} (pid {old.pid}) is still running; not restarted")
            self.children.remove(old)
            old.kill()  # reap, close its log
            if target in self.slots:
                slot = self.slots[target]
                steps = self._remaining_steps(target)
                self._drop_dead_spares()
                if self.spares and self.fork_spares:
                    self.spares_used += 1
                    self.children.append(self.fork(target, steps, old.log_path))
                    return
                if self.spares:
                    child = self.spares.pop(0)
                    self.spares_used += 1
                    child.order({"learner_id": target, "data_shard": slot["index"], "max_steps": steps,
                                 "slowdown": slot.get("slowdown"), "metrics_port": slot.get("metrics_port"),
                                 **_own_redis_url(target)})
                    child.name = target
                    self.children.append(child)
                    self.start_spare()
                    return
                argv = self.learner_argv(target, slot["index"])
                if self.steps:
                    argv[argv.index("--steps") + 1] = str(steps)
                self.children.append(Child(target, argv, old.log_path, append=True))
            else:
                self.children.append(Child(target, old.argv, old.log_path, append=True))

    def restart_crashed(self, say: Callable[[str], None]) -> list[str]:
        """Start again the learners that exited on their own with a failure (an exception, Redis
        gone for longer than a join waits), at most ``CRASH_RESTARTS_MAX`` times per learner; a
        refused learner (EXIT_USAGE, EXIT_REFUSED) would only be refused
        again, and a learner killed by a signal is the chaos harness's or the watchdog's to replace.
        Training goes on with the others either way. Returns the learner ids started again."""
        out = []
        with self.lock:
            if self.halted:
                return out
            for c in self.learners():
                code = c.proc.poll()
                lost = getattr(c.proc, "lost", False)   # a fork whose standby factory died
                if code is None or (not lost and (code <= 0 or code in (EXIT_USAGE, EXIT_REFUSED))):
                    continue
                n = self.crash_restarts.get(c.name, 0)
                if n >= CRASH_RESTARTS_MAX:
                    continue
                self.crash_restarts[c.name] = n + 1
                print(f"ddloco up: {c.name} exited with {code} ({c.log_tail(1)}); started again "
                      f"({n + 1}/{CRASH_RESTARTS_MAX})", file=sys.stderr, flush=True)
                self.restart(c.name)
                out.append(c.name)
                say(f"crashed    {c.name} exited with {code}: started again")
        return out

    def check(self, say: Callable[[str], None]) -> tuple[list[Child], list[Child]]:
        """One pass of ``up``'s loop: start again the learners that crashed (``restart_crashed``),
        then return the daemons that died and the learners supervised now, read after those
        restarts (a list read before them holds the dead processes: the run would end though
        their replacements run)."""
        self.restart_crashed(say)
        with self.lock:
            return [c for c in self.daemons() if not c.alive()], self.learners()

    def watch_hung(self, redis_url: str, keys: Keys, after_s: float, say: Callable[[str], None],
                   stop: threading.Event) -> None:
        """Thread body: every 0.5 s, ``replace_hung`` from the learners' entries in Redis. Lives
        until ``stop`` (processes it started get the parent-death signal when it ends)."""
        import redis as redis_lib
        r = control.connect(redis_url)
        while not stop.wait(0.5):
            if self.halted:
                continue
            try:
                self.replace_hung(control.all_learners(r, keys), after_s, say)
            except (redis_lib.RedisError, RuntimeError):
                pass  # Redis restarting (its entries come back), or a process that would not die

    def replace_hung(self, learners: dict[str, dict[str, str]], after_s: float,
                     say: Callable[[str], None]) -> list[str]:
        """Kill and replace learner processes that are alive but whose heartbeat stopped more
        than ``after_s`` ago while another learner's is fresh (the process is frozen, Redis is
        not down). The last heartbeat seen of each process is remembered, so a learner frozen
        when Redis restarted empty (its entry gone, never rewritten) is still replaced.
        Returns the learner ids replaced."""
        now = time.time()
        for lid, h in learners.items():
            if lid in self.slots and h.get("pid"):
                self.last_beat[lid] = (int(h["pid"]), float(h.get("updated_at") or 0), str(h.get("status")))
        fresh = [float(h.get("updated_at") or 0) for lid, h in learners.items() if lid in self.slots]
        if not fresh or max(fresh) < now - 2.0:
            return []
        out = []
        with self.lock:
            for c in self.learners():
                pid, seen, status = self.last_beat.get(c.name, (-1, 0.0, ""))
                if (c.alive() and pid == c.pid and seen and now - seen > after_s
                        and status in ("training", "blocked")):
                    c.proc.kill()
                    self.restart(c.name)
                    self.hung_replaced += 1
                    self.last_beat.pop(c.name, None)
                    out.append(c.name)
                    say(f"hung       {c.name} (pid {c.pid}): no heartbeat for {now - seen:.1f}s; killed and replaced")
        return out

    def checkpoint_path(self, shard: int) -> Path | None:
        if not self.checkpoint_dir:
            return None
        return Path(self.checkpoint_dir).absolute() / f"{self.run_id}-shard{shard}of{self.shards}.pt"

    def restart_redis(self) -> None:
        if self.redis_srv is None:
            raise RuntimeError("Redis is external (--redis-url): `up --chaos` restarts only its embedded Redis")
        pid = self.redis_srv.pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        self.redis_srv.restart_empty()


def _broker_counters(r: Any, keys: Keys) -> dict[str, Any]:
    """The broker's security counters (its ``broker`` hash): refused CURVE handshakes
    (``auth_failures``, by reason) and published messages dropped by the role rules."""
    import redis as redis_lib
    try:
        h = r.hgetall(keys.broker)
    except redis_lib.RedisError:
        h = {}
    return entries.parse_broker_entry(h)


EXIT_DID_NOT_TRAIN = 4
"""`up`'s exit status when every process ended well but the result is not trustworthy: a fragment
never merged or stopped merging, or the final model is no better than the initial one."""
STATE_FILE = "state.json"
"""Written into a run's work directory at the end of ``up``: what ``up --resume`` continues from."""


DEFAULT_RUN_ID_PREFIX = "demo"


def new_run_id(prefix: str = DEFAULT_RUN_ID_PREFIX) -> str:
    """A run id for a run given none (``demo-1f9a3c``): unique, so that every run's work
    directory, Redis keys and ``--resume`` name are its own, and short enough to type."""
    return f"{prefix}-{secrets.token_hex(3)}"


def _stopped_run(d: Path) -> tuple[dict[str, Any] | None, str]:
    """The state of the stopped run in work directory ``d``, or None and why ``--resume`` cannot
    continue it (no directory, no readable state file, no shard checkpoints of its run id)."""
    if not d.is_dir():
        return None, "no such directory"
    try:
        state = json.loads((d / STATE_FILE).read_text())
    except (OSError, ValueError):
        state = None
    run_id = state.get("run_id") if isinstance(state, dict) else None
    if not isinstance(run_id, str):
        return None, f"no readable {STATE_FILE}: not a stopped `ddloco up` run, or it ended before writing it"
    if not any((d / "checkpoints").glob(f"{run_id}-shard*of*.pt")):
        return None, f"no shard checkpoints of run {run_id!r} in {d / 'checkpoints'}"
    return state, ""


def _describe_stopped(d: Path, state: dict[str, Any]) -> str:
    stopped = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((d / STATE_FILE).stat().st_mtime))
    return (f"--resume {d}   (stopped {stopped}, versions {state.get('versions_total', '?')}, "
            f"{int(state.get('tokens_total') or 0):,} tokens)")


def resolve_resume(arg: str, runs_dir: Path = Path("runs")) -> tuple[Path, dict[str, Any]]:
    """``--resume ARG``: the work directory of a stopped run and its state. ARG is a run id (the
    one directory under ``runs_dir`` whose state names it) or a work directory (a path, or a
    directory name under ``runs_dir``). ConfigError, before anything is created, when none or
    several match (listing them, and how to pick one)."""
    is_path = "/" in arg or os.sep in arg or Path(arg).is_dir()
    if is_path or (runs_dir / arg).is_dir():
        d = Path(arg) if is_path else runs_dir / arg
        state, why = _stopped_run(d)
        if state is None:
            raise ConfigError(f"--resume {arg}: {why}")
        return d, state
    found = [(d.parent, state) for d in runs_dir.glob(f"*/{STATE_FILE}")
             for state in [_stopped_run(d.parent)[0]] if state is not None and state["run_id"] == arg]
    found.sort(key=lambda ds: ((ds[0] / STATE_FILE).stat().st_mtime, ds[0].name))
    if not found:
        raise ConfigError(f"--resume {arg}: no stopped run {arg!r} with checkpoints under {runs_dir}/ "
                          f"(give its run id or its directory, {runs_dir}/<run-id>-<time>)")
    if len(found) > 1:
        raise ConfigError(f"--resume {arg}: {len(found)} stopped runs have run id {arg!r}; pick one by passing "
                          f"its directory:\n" + "\n".join(f"  {_describe_stopped(d, s)}" for d, s in found))
    return found[0]


def check_resume(previous: dict[str, Any], syncers: int) -> None:
    """A stopped run resumes only with its shard count (shard ownership is p % S)."""
    if previous.get("syncers") != syncers:
        raise ConfigError(f"--resume: the run had {previous.get('syncers')} syncers; shard ownership is "
                          f"p % S, so resume it with --syncers {previous.get('syncers')}")


@dataclass(frozen=True)
class BrokerEndpoints:
    """Where `up`'s broker binds and where every child connects (learners publish to ``pub``,
    the broker's XSUB; everyone subscribes at ``sub``, its XPUB)."""

    xsub_bind: str
    xpub_bind: str
    pub: str
    sub: str


def broker_endpoints(pub: str = "", sub: str = "") -> BrokerEndpoints:
    """``--broker-pub`` / ``--broker-sub`` as given (a wildcard host, * or 0.0.0.0, is bound as
    given and reached on 127.0.0.1), each one not given a free port on 127.0.0.1. ConfigError
    naming the flag when a given TCP port is already in use, is 0 or *, or the endpoint cannot
    reach another process (inproc)."""
    from common.redis_server import free_port
    binds, connects = [], []
    for flag, given in (("--broker-pub", pub), ("--broker-sub", sub)):
        if not given:
            given = f"tcp://127.0.0.1:{free_port()}"
        else:
            check_value(flag, given, endpoint_problem)
            _check_bindable(flag, given)
        binds.append(given)
        # a wildcard bind is reached on the loopback address (children run on this machine)
        connects.append(re.sub(r"^tcp://(\*|0\.0\.0\.0):", "tcp://127.0.0.1:", given).replace("tcp://[::]:",
                                                                                               "tcp://[::1]:"))
    if binds[0] == binds[1]:
        raise ConfigError(f"--broker-pub and --broker-sub are both {binds[0]!r}: the broker needs two endpoints")
    return BrokerEndpoints(xsub_bind=binds[0], xpub_bind=binds[1], pub=connects[0], sub=connects[1])


def _check_bindable(flag: str, endpoint: str) -> None:
    """The broker of `up` can bind ``endpoint``: a fixed TCP port nobody listens on."""
    import errno
    import socket
    transport, _, address = endpoint.partition("://")
    if transport == "inproc":
        raise ConfigError(f"{flag} {endpoint!r}: inproc:// does not cross processes; `up` runs the broker as one "
                          f"(use tcp://127.0.0.1:PORT or ipc://PATH)")
    if transport != "tcp":
        return
    host, _, port = address.rpartition(":")
    if port in ("0", "*"):
        raise ConfigError(f"{flag} {endpoint!r}: give a fixed port (with port {port} the other processes "
                          f"would not know where to connect; leave the flag out for a free port)")
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    host = "" if host in ("*", "0.0.0.0") else host.strip("[]")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as ZeroMQ binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"{flag} {endpoint!r}: port {port} is already in use (another broker or "
                                  f"`ddloco up`?); choose another port or leave the flag out") from None
            # a host Python cannot bind (an interface name ZeroMQ resolves): the broker reports its own error


def run_up(cfg: ConfigFile, *, external_redis: bool, step_time_floor_ms: float | None = None,
           slowdowns: list[float] | None = None, quiet: bool = False, resume: Path | None = None,
           chaos: Any = None, extra: tuple[int, float, float] | None = None, insecure: bool = False,
           tensorboard: str | None = None, broker_pub: str = "", broker_sub: str = "") -> int:
    """A whole cluster until the learners' step budget or the time cap; ``resume`` is the work
    directory of a stopped run to continue (same run id, shard checkpoints, learner positions);
    ``tensorboard`` a directory for the eval loss's TensorBoard event files; ``broker_pub`` /
    ``broker_sub`` the broker's endpoints (empty: free ports on 127.0.0.1)."""
    from common.redis_server import EmbeddedRedis, free_port
    from common.fragments import model_plan, state_tensors
    from common.wire import max_frame_bytes
    from common.task import bind_task, build_model, check_task
    up = cfg.up
    broker = broker_endpoints(broker_pub, broker_sub)   # a port in use: refused before anything starts
    # every refusal (task cannot load, P does not fit, bad batch or loss) before anything starts
    task, run = bind_task(cfg.run)
    model = build_model(task, run.task.seed)
    plan = model_plan(model, task.embedding_names, run.algo.fragments)
    check_task(task, model, seed=run.task.seed)
    cfg = replace(cfg, run=run)
    previous: dict[str, Any] = json.loads((resume / STATE_FILE).read_text()) if resume is not None else {}
    if resume is not None:
        check_resume(previous, up.syncers)
    if up.report_dir:   # the last refusal: it creates the directory
        check_report_dir(Path(up.report_dir))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = Path("runs") / f"{cfg.endpoints.run_id}-{stamp}"
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, flush=True))
    stop = threading.Event()
    stop_chaos = threading.Event()
    prev_handlers = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    redis_srv = None
    sup: Supervisor | None = None
    extras: list[Child] = []
    scalars: Any = None  # the TensorBoardLog of --tensorboard
    t_start = time.time()
    try:
        ROLE_ENV.clear()
        if not external_redis:
            users: dict[str, str] = {}
            password = ""
            if not insecure:  # a random password, and an ACL user per role limited to this run's keys
                password = secrets.token_urlsafe(24)
                role_pw = {role: secrets.token_urlsafe(24) for role in ("broker", "shard", "learner")}
                users = {role: f"on >{pw} {redis_acl_rules(cfg.endpoints.run_id)}" for role, pw in role_pw.items()}
            redis_srv = EmbeddedRedis(log_dir=str(workdir / "logs"), password=password, users=users).start()
            if users and redis_srv.has_selectors:   # the learners get users of their own: the role's reads only
                from common.redis_acl import reader_rules
                redis_srv.add_user("learner", f"on >{role_pw['learner']} {reader_rules(cfg.endpoints.run_id)}")
            for role in users:
                ROLE_ENV[role] = {"DDLOCO_REDIS_URL": redis_srv.user_url(role, role_pw[role])}
            say(f"redis      embedded at redis://{redis_srv.host}:{redis_srv.port}/0 (no persistence"
                + (", a password and an ACL user per role" if password else ", no password") + ")")
        redis_url = redis_srv.url if redis_srv else cfg.endpoints.redis_url
        # no password in files: the daemons get the URL that has it in their environment
        shown_url = f"redis://{redis_srv.host}:{redis_srv.port}/0" if redis_srv else control.redact(redis_url)
        if redis_srv is None and shown_url != redis_url:
            for role in ("broker", "shard", "learner"):
                ROLE_ENV[role] = {"DDLOCO_REDIS_URL": redis_url}
        endpoints = override(cfg.endpoints, redis_url=shown_url, broker_pub=broker.pub, broker_sub=broker.sub)
        ckpt_dir = (resume / "checkpoints") if resume is not None else (workdir / "checkpoints")
        syncer = override(cfg.syncer, checkpoint_dir=str(ckpt_dir), shards=up.syncers)
        cfg = replace(cfg, endpoints=endpoints, syncer=syncer)
        cfg_path = workdir / "config.toml"
        cfg_path.write_text(dump_toml(cfg))
        r = control.connect(redis_url)
        keys = Keys(endpoints.run_id)
        if external_redis and r.exists(keys.config):
            return _refused(workdir, f"run {endpoints.run_id!r} already exists in {control.redact(redis_url)}; "
                                     f"choose another --run-id")
        try:
            control.publish_run_config(r, keys, cfg.run)
        except control.ConfigMismatch as e:
            return _refused(workdir, f"{e}; choose another --run-id")
        for lid, pos in previous.get("data_positions", {}).items():  # learners resume their data streams
            r.hset(keys.learner(lid), "data_position", int(pos))
        run_count.record(r, keys, previous.get("token_shares", {}))  # the LR schedule's count goes on
        if resume is not None:
            say(f"resume     {resume}: checkpoints of {up.syncers} shards, versions {previous.get('versions_total')}, "
                f"{previous.get('tokens_total', 0):,} tokens so far")
        n_values = sum(t.numel() for t in state_tensors(model).values())
        say(f"run        {endpoints.run_id}: task {run.task.name} ({n_values:,} values), {up.learners} learners, "
            f"{up.syncers} shards, "
            f"P={cfg.run.algo.fragments} H={cfg.run.algo.sync_every_steps} tau={cfg.run.algo.tau} "
            f"K={cfg.run.algo.quorum} codec={cfg.run.algo.uplink_codec}; logs in {workdir}/logs")

        log = lambda name: workdir / "logs" / f"{name}.log"  # noqa: E731
        common_args = ["--config", str(cfg_path), "--log-format", "json"]
        threads = max(1, (os.cpu_count() or 1) // up.learners)
        slow = slowdowns or []
        learner_ids = [f"learner-{i}" for i in range(up.learners)]
        slots = {lid: {"index": i, "slowdown": slow[i % len(slow)] if slow else None}
                 for i, lid in enumerate(learner_ids)}
        # every daemon's /metrics on a free loopback port; a restarted process (or the spare that
        # replaces a learner) serves on its slot's port again
        metrics_ports = {name: free_port() for name in ("broker", *(f"shard{k}" for k in range(up.syncers)),
                                                        *learner_ids, *(f"extra-{j}" for j in range(extra[0] if extra else 0)))}
        metrics_urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in metrics_ports.items()}
        for lid in learner_ids:
            slots[lid]["metrics_port"] = metrics_ports[lid]

        def metrics_args(name: str) -> list[str]:
            return ["--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_ports[name])] if name in metrics_ports else []
        if insecure:
            common_args.append("--insecure")
            say("security   --insecure: no CURVE on ZeroMQ sockets" + ("" if redis_srv is None else
                ", Redis without a password") + " (anyone who reaches the ports can join)")
        else:  # secure by default: a key pair per member, CURVE on every socket, the allow list of this run
            from common.security import create_keys
            keys_dir = (resume / "keys") if resume is not None and (resume / "keys").is_dir() else workdir / "keys"
            create_keys(keys_dir, learners=learner_ids + [f"extra-{j}" for j in range(extra[0] if extra else 0)],
                        shards=up.syncers, monitors=["monitor"])
            endpoints = override(endpoints, keys_dir=str(keys_dir.absolute()))
            cfg = replace(cfg, endpoints=endpoints)
            cfg_path.write_text(dump_toml(cfg))
            say(f"security   CURVE keys in {keys_dir}" + ("" if redis_srv is None else
                "; embedded Redis with a random password (in each daemon's environment)"))
            if redis_srv is not None or shown_url != redis_url:   # a Redis with a password: a user per learner
                own = learner_redis_users(redis_url, endpoints.run_id,
                                          learner_ids + [f"extra-{j}" for j in range(extra[0] if extra else 0)],
                                          say, server=redis_srv)
                if own:
                    say(f"redis      a Redis user per learner ({len(own)}): each writes only its own keys")
        access = workdir / "access.env"   # what an operator's own commands need (status, export, chaos, fuzz)
        with open(os.open(access, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(f"DDLOCO_REDIS_URL={redis_url}\n" + (f"DDLOCO_KEYS={endpoints.keys_dir}\n" if endpoints.keys_dir
                                                         else "DDLOCO_INSECURE=1\n"))
        say(f"access     {access} (mode 0600): `set -a; . {access}; set +a`, then e.g. "
            f"`ddloco status --config {cfg_path}`")

        def learner_argv(lid: str, index: int) -> list[str]:
            argv = _ddloco("learner", *common_args, "--learner-id", lid, "--data-shard", str(index),
                           "--threads", str(threads), "--steps", str(up.steps))
            if slots.get(lid, {}).get("slowdown"):
                argv += ["--slowdown", str(slots[lid]["slowdown"])]
            if step_time_floor_ms:
                argv += ["--step-time-floor-ms", str(step_time_floor_ms)]
            argv += metrics_args(lid)
            return argv
        resumed_state = None
        if resume is not None:
            # the model the stopped run ended with, read before any daemon starts: the resumed
            # run's first evaluation (learners forked from the factory may merge within seconds)
            from ddloco.export import ExportError, from_checkpoints
            try:
                resumed_state = from_checkpoints(syncer.checkpoint_dir, endpoints.run_id, task=task)
            except (ExportError, OSError, ValueError) as e:
                say(f"resume     checkpoints unreadable ({e}); the first evaluation asks the shards")
        sup = Supervisor(workdir=workdir, learner_argv=learner_argv, slots=slots, steps=up.steps,
                         checkpoint_dir=syncer.checkpoint_dir, run_id=endpoints.run_id, shards=up.syncers,
                         redis_srv=redis_srv)
        from learner.core import resolve_device   # a process that set CUDA up cannot be forked
        sup.fork_spares = hasattr(os, "fork") and resolve_device(cfg.learner.device).type == "cpu"
        sup.add(Child("broker", _ddloco("broker", *common_args, "--xsub", broker.xsub_bind,
                                        "--xpub", broker.xpub_bind, "--run-id", endpoints.run_id,
                                        "--shards", str(up.syncers), "--fragments", str(len(plan)),
                                        "--max-message-mb", str(max_frame_bytes(max(f.numel for f in plan)) / (1 << 20)),
                                        *metrics_args("broker")),
                      log("broker")))
        for k in range(up.syncers):
            sup.add(Child(f"shard{k}", _ddloco("syncer", *common_args, "--shard", str(k), "--shards", str(up.syncers),
                                               *metrics_args(f"shard{k}")),
                          log(f"syncer-{k}")))
        if sup.fork_spares:
            # one process imports torch, builds the model and warms AdamW up (~5 s of CPU), and
            # every learner is a fork of it: a start, and any restart, without paying that again
            sup.spares_wanted = 1
            sup.start_spare()
            for lid in learner_ids:
                sup.add(sup.fork(lid, up.steps, log(lid)))
        else:
            for i, lid in enumerate(learner_ids):
                sup.add(Child(lid, learner_argv(lid, i), log(lid)))
        say(f"started    broker (publish {broker.pub}, subscribe {broker.sub}), {up.syncers} syncer(s), "
            f"{up.learners} learner(s): " + " ".join(f"{c.name}={c.pid or 'fork'}" for c in sup.all()))
        (workdir / "metrics.json").write_text(json.dumps(metrics_urls, indent=2))
        say(f"metrics    Prometheus /metrics on 127.0.0.1 ({workdir / 'metrics.json'}): "
            + " ".join(f"{name}:{port}" for name, port in metrics_ports.items()))

        monitor = Monitor(cfg, r, keys, task, learner_ids=list(learner_ids), say=say)
        sup.monitor = monitor
        if resume is not None:
            monitor.resumed = True
            monitor.token_offset = int(previous.get("tokens_total", 0))
        if tensorboard:
            from ddloco.tensorboard_log import EVAL_LOSS_TAG, TensorBoardLog
            scalars = TensorBoardLog(tensorboard)
            monitor.on_eval = scalars.add_eval
            say(f"tensorboard {EVAL_LOSS_TAG} vs tokens in {tensorboard} (`tensorboard --logdir {tensorboard}`)")
        monitor.evaluate(initial=True, state=resumed_state)
        watchdog = None
        if up.replace_hung_s > 0:
            watchdog = threading.Thread(target=sup.watch_hung, name="hung-watchdog", daemon=True,
                                        args=(redis_url, keys, up.replace_hung_s, say, stop_chaos))
            watchdog.start()
        chaos_runner = None
        if chaos is not None and (chaos.learner_mtbf_s > 0 or chaos.stalls):
            # hot spares replace a killed learner in well under a second: one factory that forks
            # a prepared copy per failure (a burst of failures drained a pool of 3 standby
            # processes, whose replacements then took 10-30 s to boot on a loaded machine)
            sup.spares_wanted = 1 if sup.fork_spares else 3
            sup.start_spare()

        def start_chaos() -> Any:
            """Once every learner trains: the schedule covers the rest of the run."""
            from ddloco.chaos import ChaosRunner, plan_faults
            now = time.time()
            faults = plan_faults(chaos, duration_s=max(1.0, deadline - now), learners=learner_ids, shards=up.syncers)
            say(f"chaos      {len(faults)} faults over the next {(deadline - now) / 60:.1f} min ({chaos}): "
                + ", ".join(f"{k} {sum(1 for f in faults if f.kind == k)}" for k in
                            dict.fromkeys(f.kind for f in faults)))
            runner = ChaosRunner(faults, sup, redis_url=redis_url, keys=keys, t0=now, say=say,
                                 stop=stop_chaos, stall_s=chaos.stall_s)
            runner.report_t0 = now - monitor.t0
            runner.start()
            return runner
        extras: list[Child] = []
        extra_state = "waiting" if extra and extra[0] > 0 else "none"
        deadline = t_start + up.minutes * 60
        interrupted = timed_out = False
        failure = ""
        while True:
            if stop.wait(1.0):
                interrupted = True
                say("interrupted: stopping everything")
                break
            monitor.tick()
            now = time.time()
            if chaos is not None and chaos_runner is None and (
                    all(monitor.learners.get(lid, {}).get("status") == "training" for lid in learner_ids)
                    or now - t_start > 120):
                chaos_runner = start_chaos()
            if extra_state == "waiting" and now - t_start >= extra[1]:
                for j in range(extra[0]):
                    lid = f"extra-{j}"
                    extras.append(Child(lid, learner_argv(lid, up.learners + j), log(lid)))
                    monitor.add_learner(lid)
                extra_state = "running"
                monitor.mark("extra_start", f"{extra[0]} learners")
                say(f"extra      {extra[0]} temporary learner(s) started for {extra[2]:g}s")
            elif extra_state == "running" and now - t_start >= extra[1] + extra[2]:
                _stop_all(extras)
                extra_state = "done"
                monitor.mark("extra_stop", f"{extra[0]} learners")
                say(f"extra      temporary learner(s) stopped")
            dead, learners = sup.check(say)
            if dead:
                failure = f"{dead[0].name} exited with {dead[0].proc.returncode}:\n{dead[0].log_tail()}"
                break
            if all(not c.alive() for c in learners):
                break
            if now >= deadline:
                timed_out = True
                say(f"time cap of {up.minutes} min reached: stopping learners")
                break
        sup.halted = True        # no more replacements; the watchdog thread lives on (parent-death signal)
        if chaos_runner is not None:
            chaos_runner.halt()  # no more faults; its thread lives on until everything stopped
        _stop_all(extras)
        with sup.lock:
            learners = sup.learners()
            spares, sup.spares, sup.spares_wanted = sup.spares, [], 0
        _stop_all(learners)
        _stop_all(spares)   # after the learners: a standby factory reports its forks' exit status
        daemons = sup.daemons()
        bad = [c for c in learners if c.proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM)]
        for c in bad:   # an error, so printed even with --quiet
            print(f"ddloco up: {c.name} exited with {c.proc.returncode}: {c.log_tail(3)}", file=sys.stderr, flush=True)
        monitor.last_eval = time.time()   # no new periodic evaluation now; one still running ends first
        monitor.tick()
        monitor.check_fragments()
        monitor.wait_evaluation(60.0)
        if not failure and not interrupted:
            monitor.evaluate(final=True)
        _stop_all(daemons)
        token_shares = _final_token_shares(r, keys, previous)
        if not failure and not interrupted:
            # merges of the learners' last answers may land after that evaluation: the shards'
            # checkpoints (written when they stop) hold the run's true final model
            from ddloco.export import ExportError, from_checkpoints
            try:
                monitor.adopt_final(*from_checkpoints(syncer.checkpoint_dir, endpoints.run_id, task=task))
            except (ExportError, OSError, ValueError) as e:  # ValueError: TaskError, ConfigError
                say(f"final      checkpoints unreadable ({e}); the report keeps the live evaluation")
            monitor.recalibrate_final()   # Task.recalibrate_bn_batches: the report's final model, re-estimated
        if interrupted:
            _adopt_freshest_model(monitor, syncer.checkpoint_dir, endpoints.run_id, task, say)
        wall_s = time.time() - t_start
        report = monitor.report(wall_s=wall_s, interrupted=interrupted, timed_out=timed_out, failure=failure,
                                learner_exit_codes={c.name: c.proc.returncode for c in learners})
        if chaos_runner is not None:
            res = chaos_runner.results()
            report.update(res)
            report["chaos"] = str(chaos)
            report["versions_regressed"] = report.get("versions_regressed", 0) + res["shard_versions_regressed"]
            report["spares_used"] = sup.spares_used
            report["spares_failed"] = sup.spares_failed
            for e in res["chaos_events"]:   # on the report's clock (the monitor's)
                e["t"] = round(e["t"] + chaos_runner.report_t0, 3)
                monitor.marks.append((e["t"], e["kind"], e["target"]))
        report["hung_replaced"] = sup.hung_replaced
        report["crash_restarts"] = dict(sup.crash_restarts)
        report["metrics_endpoints"] = metrics_urls
        report["security"] = {"curve": not insecure,
                              "redis_auth": bool(redis_srv.password) if redis_srv is not None else shown_url != redis_url,
                              "redis_tls": redis_url.startswith("rediss://")}
        report.update(_broker_counters(r, keys))
        if extra is not None and extra[0] > 0:
            report["extra_learners"] = monitor.extra_effect(extra)
        if redis_srv is not None:
            redis_srv.stop()
            redis_srv = None
        report["processes_left"] = [c.name for c in sup.all() + extras if c.alive()]
        report["checkpoint_dir"] = syncer.checkpoint_dir
        if resume is not None:
            report["resumed_from"] = str(resume)
            report["eval_curve_before"] = previous.get("eval_curve", [])
        # the state lives next to the checkpoints it describes (a resumed run keeps the first
        # part's directory), so the next --resume finds both, however many parts came before
        _write_state(resume if resume is not None else workdir, report, monitor, up.syncers, previous, token_shares)
        if up.report_dir:
            write_report(Path(up.report_dir), report, monitor)
            say(f"report     {Path(up.report_dir) / 'report.json'} (+ eval_loss.png, merges.png, timeline.png)")
            if monitor.final_versions is not None:
                from ddloco.export import save_state
                path = save_state(monitor.model, Path(up.report_dir) / "model.safetensors")
                say(f"model      {path}: the final global model (load_state_dict into task.model(), strict)")
        say(f"state      checkpoints in {syncer.checkpoint_dir}: `ddloco up --resume {resume or workdir}` continues "
            f"this run, `ddloco export --checkpoint-dir {syncer.checkpoint_dir} --out model.safetensors` exports it")
        say(monitor.summary_line(report))
        print_digest(workdir / "logs", say)   # the daemons' warnings (and errors, even under --quiet)
        if failure:
            print(f"ddloco up: {failure}", file=sys.stderr)
            return 1
        if interrupted:
            return 130
        if bad:
            return 1
        problems = monitor.problems(report)
        for line in problems:   # loud, and in the exit status: a run that did not work never reads as success
            print(f"ddloco up: the run did not train as it should: {line}", file=sys.stderr, flush=True)
        return EXIT_DID_NOT_TRAIN if problems else 0
    finally:
        if sup is not None:
            _stop_all(sup.all(), timeout_s=5.0)
        _stop_all(extras, timeout_s=5.0)
        stop_chaos.set()  # after the processes it restarted are stopped (their parent-death signal)
        if redis_srv is not None:
            redis_srv.stop()
        if scalars is not None:
            scalars.close()
        ROLE_ENV.clear()
        for s, h in prev_handlers.items():
            signal.signal(s, h)
