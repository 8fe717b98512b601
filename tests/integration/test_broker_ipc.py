"""The broker daemon on ipc:// (a broker and its members on one host): real processes, real sockets."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq

from common import wire
from common.security import Security, create_keys
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)


def _broker(xsub: str, xpub: str, log: Path, *flags: str) -> subprocess.Popen:
    """``python -m broker`` binding ``xsub`` and ``xpub``; its output in ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "broker", "--xsub", xsub, "--xpub", xpub, "--log-format", "json",
                                 *flags], stdout=out, stderr=subprocess.STDOUT)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.kill()
        p.wait(10)


def _answer(sender: str) -> list[bytes]:
    return wire.encode(kind=wire.UPDATE, run="ipc", sender=sender, fragment=0, values=torch.zeros(8), codec="fp32",
                       round=0, base=0, steps=1, tokens=16)


def test_the_broker_daemon_on_ipc_forwards_a_learners_answer_with_curve_and_its_socket_files_are_its_users(tmp_path):
    """CURVE on ipc:// as on tcp://: only listed keys connect and the role rules hold (an answer
    from alice's key naming another sender is dropped, alice's own arrive); the socket files are
    read-write for the broker's user only."""
    keys, run = tmp_path / "keys", tmp_path / "run"
    create_keys(keys, learners=["alice"])
    run.mkdir(mode=0o700)
    proc = _broker(f"ipc://{run}/xsub", f"ipc://{run}/xpub", tmp_path / "broker.log", "--keys", str(keys),
                   "--shards", "1")
    ctx = zmq.Context()
    try:
        wait_until(lambda: (run / "xsub").exists() and (run / "xpub").exists() or proc.poll() is not None, 20,
                   what="the broker's ipc sockets")
        assert proc.poll() is None, (tmp_path / "broker.log").read_text()
        modes = {name: stat.S_IMODE(os.stat(run / name).st_mode) for name in ("xsub", "xpub")}
        assert modes == {"xsub": 0o600, "xpub": 0o600}, {k: oct(v) for k, v in modes.items()}
        sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        Security(str(keys), "monitor").client(sub, "broker")
        Security(str(keys), "alice").client(pub, "broker")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{run}/xpub")
        pub.connect(f"ipc://{run}/xsub")
        forged, own = _answer("bob"), _answer("alice")
        # a PUB drops what it sends before the subscription reached it: send until one arrives,
        # each of alice's own answers after a forged one (one publisher's messages keep their order)
        wait_until(lambda: pub.send_multipart(forged) or pub.send_multipart(own) or sub.poll(0), 20,
                   what="an answer through the broker")
        senders = []
        while sub.poll(300):
            senders.append(wire.decode(sub.recv_multipart()).sender)
        assert senders and set(senders) == {"alice"}, senders[:5]
    finally:
        ctx.destroy(linger=0)
        _stop(proc)


def test_a_broker_given_a_live_brokers_ipc_path_or_a_file_refuses_in_one_line_and_takes_nothing(tmp_path):
    """libzmq would unlink the path and bind anew: the first broker's members would be cut off,
    the file deleted. The broker refuses (exit 2) and the first one goes on forwarding."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "notes.txt").write_text("keep")
    xsub, xpub = f"ipc://{run}/xsub", f"ipc://{run}/xpub"
    first = _broker(xsub, xpub, tmp_path / "first.log", "--insecure")
    others = []
    ctx = zmq.Context()
    try:
        wait_until(lambda: (run / "xsub").exists() and (run / "xpub").exists() or first.poll() is not None, 20,
                   what="the first broker's ipc sockets")
        for i, (x_sub, x_pub, why) in enumerate([
                (xsub, f"ipc://{run}/other", f"broker.xsub_bind (--xsub) '{xsub}': a live process listens there "
                                              "(another broker?): stop it or choose another path"),
                (f"ipc://{run}/other", f"ipc://{run}/notes.txt", f"broker.xpub_bind (--xpub) 'ipc://{run}/notes.txt': "
                                                                  "a file that is not a socket is there (binding would "
                                                                  "delete it)")]):
            log = tmp_path / f"other{i}.log"
            others.append(_broker(x_sub, x_pub, log, "--insecure"))
            wait_until(lambda: others[-1].poll() is not None, 20, what=f"broker {i} to refuse its endpoint")
            lines = log.read_text().splitlines()
            assert others[-1].returncode == 2 and lines[-1] == f"ddloco broker: {why}", lines
        assert (run / "notes.txt").read_text() == "keep"
        sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(xpub)
        pub.connect(xsub)
        wait_until(lambda: pub.send_multipart(_answer("alice")) or sub.poll(0), 20,
                   what="an answer through the first broker")
    finally:
        ctx.destroy(linger=0)
        _stop(first, *others)
