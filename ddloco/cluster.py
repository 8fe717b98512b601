"""The processes of `ddloco up` (its cluster): how each daemon is started, told, stopped.

``Child`` is one daemon process started by `up` with its log file; ``ForkedChild`` a learner
forked by a standby factory (``learner --standby``); ``stop_children`` stops a list of them
(``common.lifecycle.stop_processes``, then their logs closed); ``broker_endpoints`` where the
broker binds. ``ROLE_ENV`` is each role's (and learner's) Redis URL for the children's environment.

Threads: ``ROLE_ENV`` is written by `up`'s main thread before any child starts (and cleared after
all stopped); the supervisor's threads (its loop, the hung-learner watchdog, the chaos harness)
only read it. A ``Child`` is owned by the thread that holds ``Supervisor.lock`` while it uses it
(``ddloco/supervisor.py``).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from common import control
from common.config import ConfigError, check_value, endpoint_problem
from common.lifecycle import die_with_parent, pid_alive, stop_processes

ROLE_ENV: dict[str, dict[str, str]] = {}
"""Extra environment of ``up``'s children by role (broker, shard, learner): their Redis URL with
the role's ACL user and password, kept off the command line. Set by ``run_up`` for its run."""


def own_redis_url(learner_id: str) -> dict[str, str]:
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




def start_embedded_redis(run_id: str, *, log_dir: Path, insecure: bool, say: Callable[[str], None]) -> Any:
    """`up`'s embedded Redis (an ``EmbeddedRedis``, started); unless ``insecure`` a random password
    and an ACL user per role limited to this run's keys, each role's URL in ``ROLE_ENV``."""
    from common.redis_server import EmbeddedRedis
    from common.security import redis_acl_rules
    users: dict[str, str] = {}
    password = ""
    if not insecure:
        password = secrets.token_urlsafe(24)
        role_pw = {role: secrets.token_urlsafe(24) for role in ("broker", "shard", "learner")}
        users = {role: f"on >{pw} {redis_acl_rules(run_id)}" for role, pw in role_pw.items()}
    redis_srv = EmbeddedRedis(log_dir=str(log_dir), password=password, users=users).start()
    if users and redis_srv.has_selectors:   # the learners get users of their own: the role's reads only
        from common.redis_acl import reader_rules
        redis_srv.add_user("learner", f"on >{role_pw['learner']} {reader_rules(run_id)}")
    for role in users:
        ROLE_ENV[role] = {"DDLOCO_REDIS_URL": redis_srv.user_url(role, role_pw[role])}
    say(f"redis      embedded at redis://{redis_srv.host}:{redis_srv.port}/0 (no persistence"
        + (", a password and an ACL user per role" if password else ", no password") + ")")
    return redis_srv

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

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

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


def ddloco_argv(*args: str) -> list[str]:
    """The command line of ``python -m ddloco ARGS`` with this interpreter."""
    return [sys.executable, "-m", "ddloco", *args]


def stop_children(children: list[Child], timeout_s: float = 15.0) -> None:
    """SIGTERM every child still running, give them ``timeout_s`` together, then SIGKILL what is
    left (a fork: waited for at most 5 s), and close their logs."""
    stop_processes([c.proc for c in children], timeout_s, kill_wait_s=5.0)
    for c in children:
        c.kill()


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
    """The broker of `up` can bind ``endpoint``: a fixed TCP port nobody listens on, or an ipc://
    path the broker may bind (``broker.ipc.bind_problem``)."""
    import errno
    import socket
    transport, _, address = endpoint.partition("://")
    if transport == "inproc":
        raise ConfigError(f"{flag} {endpoint!r}: inproc:// does not cross processes; `up` runs the broker as one "
                          f"(use tcp://127.0.0.1:PORT or ipc://PATH)")
    if transport == "ipc":   # a free path whose directory exists (a live broker's path or a file: refused)
        from broker.ipc import bind_problem
        check_value(flag, endpoint, bind_problem)
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

