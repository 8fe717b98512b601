"""``ping`` and ``server_pid`` (health checks, the embedded server's start): one bounded try each,
None or False when nothing, no Redis, or a refusing Redis answers."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from common.redis_server import EmbeddedRedis, free_port, ping, server_pid

pytestmark = pytest.mark.timeout(60)


def test_ping_and_pid_answer_with_the_right_password_only() -> None:
    with EmbeddedRedis(password="s3cret") as srv:
        assert ping(srv.host, srv.port, password="s3cret")
        assert server_pid(srv.host, srv.port, password="s3cret") == srv.pid
        assert not ping(srv.host, srv.port, password="wrong")
        assert not ping(srv.host, srv.port)                       # NOAUTH
        assert server_pid(srv.host, srv.port, password="wrong") is None
    with EmbeddedRedis() as open_srv:
        assert ping(open_srv.host, open_srv.port) and server_pid(open_srv.host, open_srv.port) == open_srv.pid
        assert not ping(open_srv.host, open_srv.port, password="unexpected")   # AUTH refused


def test_nothing_listening_is_no_answer() -> None:
    port = free_port()
    assert not ping("127.0.0.1", port) and server_pid("127.0.0.1", port) is None


def test_a_silent_listener_costs_one_timeout_not_retries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)                      # the kernel accepts; nobody ever answers
        port = s.getsockname()[1]
        t0 = time.monotonic()
        assert not ping("127.0.0.1", port, timeout_s=0.3)
        assert server_pid("127.0.0.1", port, timeout_s=0.3) is None
        elapsed = time.monotonic() - t0
    assert elapsed < 1.5, f"two probes of 0.3 s took {elapsed:.2f} s: retried?"


def test_a_listener_that_is_not_redis_is_no_answer() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        stop = threading.Event()

        def serve() -> None:
            s.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                with conn:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            assert not ping("127.0.0.1", port, timeout_s=1.0)
            assert server_pid("127.0.0.1", port, timeout_s=1.0) is None
        finally:
            stop.set()
            t.join(5)


def test_the_container_health_check_of_redis_needs_the_right_password(tmp_path) -> None:
    import subprocess
    import sys

    def health(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "common.health", "redis", *args], capture_output=True,
                              text=True, timeout=30)
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("s3cret\n")
    bad.write_text("nope\n")
    with EmbeddedRedis(password="s3cret") as srv:
        ok = health("--port", str(srv.port), "--password-file", str(good))
        assert (ok.returncode, ok.stderr) == (0, "")
        refused = health("--port", str(srv.port), "--password-file", str(bad))
        assert refused.returncode == 1 and refused.stderr == f"unhealthy: no PONG from Redis at 127.0.0.1:{srv.port}\n"
        missing = health("--port", str(srv.port), "--password-file", str(tmp_path / "absent"))
        assert missing.returncode == 1 and missing.stderr.startswith("unhealthy: cannot read ")
        assert missing.stderr.count("\n") == 1
