"""The services job of `ddloco slurm submit`: Redis, the broker and the shards on one node.

    python -m ddloco.slurm.services --run-dir RUN_DIR     (what RUN_DIR/jobs/services.sbatch runs)

Steps: Redis (password and append-only file under RUN_DIR/redis, config 0600: no secret on a
command line), a Redis user per learner id that has a key (its URL in keys/secret/<id>.redis.env,
0600, read only by that learner's job), the broker, S shards (checkpoints in RUN_DIR/checkpoints),
then RUN_DIR/endpoints.env (once all are started), which learner jobs wait for. It then supervises: a daemon that exits
non-zero is started again (at most ``RESTARTS_MAX`` times a minute); a learner key added later
(`ddloco slurm add`) gets its Redis user within ``USERS_EVERY_S``. SIGTERM (scancel, preemption,
the end of the time limit) stops the shards first (they checkpoint), then the broker and Redis
(Slurm signals every process of the job at once; a daemon ignores the same signal passed on again
within ``common.lifecycle.DUPLICATE_SIGNAL_S``); a requeued services job continues from the
append-only file and the checkpoints.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from common.files import atomic_path, read_env_file
from ddloco.slurm.plan import SlurmPlan

RESTARTS_MAX = 5
USERS_EVERY_S = 2.0
STOP_TIMEOUT_S = 60.0


def _log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} services  {msg}", flush=True)


def _password_in(env: Path) -> str:
    """The password of the Redis URL in a learner's .redis.env ("" if none)."""
    try:
        url = read_env_file(env).get("DDLOCO_REDIS_URL", "")
    except OSError:
        return ""
    creds = url.split("://", 1)[-1].split("@", 1)
    return creds[0].split(":", 1)[1] if len(creds) == 2 and ":" in creds[0] else ""


def _write_private(path: Path, text: str) -> None:
    """``text`` to ``path`` atomically, readable by this user only (0600 from the start)."""
    with atomic_path(path) as tmp:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(text)


class Services:
    """The daemons of one services job and their restarts (main thread only)."""

    def __init__(self, plan: SlurmPlan, host: str) -> None:
        self.plan, self.host = plan, host
        self.root = plan.root
        self.password = (self.root / "keys" / "secret" / "redis.password").read_text().strip()
        self.admin_url = f"redis://:{self.password}@{host}:{plan.redis_port}/0"
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.restarts: dict[str, list[float]] = {}
        self.users_made: set[str] = set()

    # ------------------------------------------------------------------ start
    def start_redis(self) -> None:
        from common.redis_server import find_redis_server
        data = self.root / "redis"
        data.mkdir(mode=0o700, exist_ok=True)
        conf = data / "redis.conf"
        _write_private(conf, f"port {self.plan.redis_port}\nbind 0.0.0.0\nprotected-mode no\n"
                             f"requirepass {self.password}\ndir {data}\nappendonly yes\nappendfsync everysec\n"
                             f"save \"\"\nlogfile {self.root / 'logs' / 'redis.log'}\n")
        self._start("redis", [find_redis_server(), str(conf)])
        self._wait_redis()

    def _wait_redis(self, timeout_s: float = 60.0) -> None:
        import redis
        from common import control
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                control.connect(self.admin_url).ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline or self.procs["redis"].poll() is not None:
                    raise SystemExit(f"Redis did not start: see {self.root / 'logs' / 'redis.log'}") from None
                time.sleep(0.1)

    def make_learner_users(self) -> None:
        """A Redis user per learner id with a public key and no user yet (ids added later too). A
        user made before (its URL in keys/secret/<id>.redis.env) keeps its password: a Redis that
        restarted, or a requeued services job, lets the learners' URLs in again."""
        from common import control, redis_acl
        keys = self.root / "keys"
        ids = sorted(p.stem for p in (keys / "public" / "learner").glob("*.key"))
        new = [i for i in ids if i not in self.users_made]
        if not new:
            return
        admin = control.connect(self.admin_url)
        own = redis_acl.has_selectors(redis_acl.server_version(admin))
        for lid in new:
            env = keys / "secret" / f"{lid}.redis.env"
            url = self.admin_url   # Redis < 7: the learners share the admin's user (docs/SECURITY.md)
            if own:
                old = _password_in(env)
                password = redis_acl.add_learner_user(admin, self.plan.run_id, lid, password=old)
                url = redis_acl.user_url(self.admin_url, redis_acl.learner_user(lid), password)
            _write_private(env, f"DDLOCO_REDIS_URL={url}\n")
        admin.close()
        self.users_made.update(new)
        _log(f"Redis users for {', '.join(new)}" + ("" if own else " (Redis < 7.0: the admin's URL)"))

    def start_daemons(self) -> None:
        p, py = self.plan, sys.executable
        net = ["--run-id", p.run_id, "--log-format", "json"]
        pub, sub = f"tcp://{self.host}:{p.broker_port}", f"tcp://{self.host}:{p.broker_port + 1}"
        self._start("broker", [py, "-m", "ddloco", "broker", "--xsub", f"tcp://0.0.0.0:{p.broker_port}",
                               "--xpub", f"tcp://0.0.0.0:{p.broker_port + 1}", "--shards", str(p.shards), *net])
        task = ["--task", p.task, *sum((["--task-arg", a] for a in p.task_args), [])]
        for k in range(p.shards):
            self._start(f"shard{k}", [py, "-m", "ddloco", "syncer", *task, "--shard", str(k), "--shards", str(p.shards),
                                      "--broker-pub", pub, "--broker-sub", sub, "--rpc-bind",
                                      f"tcp://0.0.0.0:{p.shard_port + k}", "--advertise-host", self.host,
                                      "--checkpoint-dir", str(self.root / "checkpoints"), *net])
        _write_private(self.root / "endpoints.env",
                       f"DDLOCO_RUN_ID={p.run_id}\nDDLOCO_BROKER_PUB={pub}\nDDLOCO_BROKER_SUB={sub}\n"
                       f"DDLOCO_SERVICES_HOST={self.host}\nDDLOCO_SERVICES_JOB={os.environ.get('SLURM_JOB_ID', '')}\n")
        os.chmod(self.root / "endpoints.env", 0o644)   # no secret in it
        _log(f"endpoints.env written: broker {pub} {sub}, {p.shards} shard(s)")

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "logs" / f"{name}.log", "ab")
        env = {**os.environ, "DDLOCO_REDIS_URL": self.admin_url}
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL)
        self.argv[name] = argv
        _log(f"{name} started (pid {self.procs[name].pid})")

    # ------------------------------------------------------------------ supervise
    def supervise(self, stop: threading.Event) -> int:
        next_users = 0.0
        while not stop.wait(0.5):
            for name, proc in list(self.procs.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                if stop.wait(0.5):   # Slurm signalled the whole job: this daemon went first
                    return 0
                recent = [t for t in self.restarts.get(name, []) if t > time.monotonic() - 60]
                if rc in (0, 2) or len(recent) >= RESTARTS_MAX:
                    _log(f"{name} exited {rc}: the services job ends (see logs/{name}.log)")
                    return 1
                _log(f"{name} exited {rc}: starting it again")
                self.restarts[name] = [*recent, time.monotonic()]
                self._start(name, self.argv[name])
                if name == "redis":   # its ACL users are not in the append-only file: made again
                    self._wait_redis()
                    self.users_made.clear()
                    next_users = 0.0      # below, at once
            if time.monotonic() >= next_users:
                try:
                    self.make_learner_users()
                except Exception as e:  # noqa: BLE001  (Redis restarting: next time)
                    _log(f"learner users not made yet: {e}")
                next_users = time.monotonic() + USERS_EVERY_S
        return 0

    def stop(self) -> None:
        """Shards first (they checkpoint on SIGTERM), then the broker, then Redis."""
        for group in ([n for n in self.procs if n.startswith("shard")], ["broker"], ["redis"]):
            for name in group:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            for name in group:
                try:
                    self.procs[name].wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.procs[name].kill()
                    self.procs[name].wait()
        _log("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddloco.slurm.services", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--host", default="", help="the address learners reach this node at (default: its hostname)")
    args = ap.parse_args(argv)
    plan = SlurmPlan.load(args.run_dir)
    (plan.root / "logs").mkdir(exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    (plan.root / "endpoints.env").unlink(missing_ok=True)   # a requeued job: stale until this one listens
    services = Services(plan, args.host or socket.gethostname())
    try:
        services.start_redis()
        services.make_learner_users()
        services.start_daemons()
        rc = services.supervise(stop)
    finally:
        (plan.root / "endpoints.env").unlink(missing_ok=True)
        services.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
