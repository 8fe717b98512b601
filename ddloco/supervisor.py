"""The supervisor of `ddloco up`: the processes it started and how to start each one again.

The chaos harness kills processes and the supervisor restarts them at once (a learner by
promoting the hot spare when one is ready: a standby process that already imported torch and
built the model); a learner that crashed is started again (``restart_crashed``), a frozen one
killed and replaced (``replace_hung``).

Threads: the process lists and counters (``children``, ``spares``, ``spares_*``, ``forks``,
``hung_replaced``, ``crash_restarts``) are shared by `up`'s main loop, the hung-learner watchdog
thread (``watch_hung``) and the chaos harness's thread (the ``chaos.Targets`` methods); every
change of them, and every read while those threads run, holds ``lock`` (an RLock guarding the
process lists and their counters; the chaos harness holds it across a kill and its restart).
``last_beat`` belongs to the watchdog thread. ``halted`` is written by the main thread only
(True once the run ends), read by the others. The main thread sets ``fork_spares`` and
``monitor`` before the other threads start, and ``spares_wanted`` (a plain int the others read;
under ``lock`` at the end of the run). A restart on another thread reads the monitor's learner
table as it changes (a RuntimeError is caught).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from common import control
from common.exits import REFUSED as EXIT_REFUSED
from common.exits import USAGE as EXIT_USAGE
from common.keys import Keys
from ddloco.cluster import Child, ForkedChild, own_redis_url

SPARE_FAILURES_MAX = 3
CRASH_RESTARTS_MAX = 3


class Supervisor:
    """The processes ``up`` started and how to start each again: the chaos harness kills them and
    the supervisor restarts them at once (a learner by promoting the hot spare when one is
    ready, a standby process that already imported torch and built the model)."""

    def __init__(self, *, workdir: Path, learner_argv: Callable[[str, int], list[str]],
                 slots: dict[str, dict[str, Any]], steps: int, monitor: Any = None,
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
                  **own_redis_url(target)}
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
                                 **own_redis_url(target)})
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
