"""What one listed member's traffic costs the others, in resident memory (docs/SECURITY.md):

    python -m ddloco.bench.member_limits --json                      # this checkout
    python -m ddloco.bench.member_limits --root DIR --json           # another checkout's daemons (a before)

Four attacks by one member holding a listed learner key, each against real processes with CURVE:
- ``subscriptions``: 10^5 distinct subscriptions from one SUB; the broker's RSS and that of a
  publisher connected to it (where the broker forwards subscriptions: every learner and shard),
  and whether a fresh connection with that key is refused afterwards (the broker's eviction);
- ``frames``: 16 valid-looking answers of 32 MiB from one learner while the shard subscribed to
  them does not read; the broker's peak and final RSS (frames of 128 MiB and more never reached
  the broker's loop on this 2-core host, limit or not, so the cost is shown with 32 MiB frames);
- ``peer``: a client that never reads asks a learner's peer endpoint for its state in a loop (the
  learner's real network thread, serving a 16 MiB state); the learner's RSS;
- ``flood``: 20,000 answers/s from one learner; the broker's RSS and the rate it forwards.

Functions return plain dicts, so `ddloco fuzz --insider` or a test can reuse them; ``main`` runs
them all (``--only NAME`` one). The daemons run from ``--root`` (default: this checkout), with
the broker's limits passed when that checkout has them (``broker/limits.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import zmq

from common.lifecycle import stop_processes

HERE = Path(__file__).resolve().parents[2]
"""The checkout this file is in (ddloco/bench/member_limits.py: two levels up)."""
RUN = "bench"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root)}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stage:
    """Keys, a broker process and a victim publisher (a PUB holding a learner key), from ``root``."""

    def __init__(self, root: Path, keys: str, max_message_mb: float = 4.0) -> None:
        sys.path.insert(0, str(root))
        from common.security import Security, create_keys
        create_keys(keys, learners=["alice", "mallory", "victim", "greedy"], shards=2)
        self.keys, self.root, self.security = keys, root, Security
        self.pub, self.sub = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
        limits = (root / "broker" / "limits.py").exists()
        extra = ["--shards", "2", "--fragments", "24", "--max-message-mb", str(max_message_mb)] if limits else []
        self.limits = limits
        self.broker = subprocess.Popen([sys.executable, "-m", "broker", "--keys", keys, "--xsub", self.pub,
                                        "--xpub", self.sub, "--log-level", os.environ.get("BENCH_BROKER_LOG", "error"), *extra], env=_env(root))
        victim = (f"import zmq,time\nfrom common.security import Security\nc=zmq.Context()\ns=c.socket(zmq.PUB)\n"
                  f"Security({keys!r},'victim').client(s,'broker')\ns.connect({self.pub!r})\ntime.sleep(3600)\n")
        self.victim = subprocess.Popen([sys.executable, "-c", victim], env=_env(root))
        self.ctx = zmq.Context()
        self._wait_up()

    def socket(self, kind: int, name: str, endpoint: str, **opts: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        for k, v in opts.items():
            s.setsockopt(getattr(zmq, k), v)
        self.security(self.keys, name).client(s, "broker")
        s.connect(endpoint)
        return s

    def _wait_up(self) -> None:
        from common import wire
        import torch
        sub = self.socket(zmq.SUB, "monitor", self.sub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        pub = self.socket(zmq.PUB, "alice", self.pub)
        deadline = time.monotonic() + 30
        while not sub.poll(100):
            if time.monotonic() > deadline:
                raise RuntimeError("the broker did not forward within 30 s")
            pub.send_multipart(wire.encode(kind=wire.UPDATE, run=RUN, sender="alice", fragment=0,
                                           values=torch.zeros(8), codec="fp32", round=0, base=0, steps=1, tokens=1))
        sub.close(linger=0)
        pub.close(linger=0)
        time.sleep(1.0)   # settle before the baseline

    def close(self) -> None:
        stop_processes((self.broker, self.victim), 10.0)
        self.ctx.destroy(linger=0)


def _sampled(pid: int, seconds: float, action: Callable[[], None] | None = None) -> float:
    """Peak RSS of ``pid`` over ``seconds`` (``action`` called between samples)."""
    peak, end = rss_mb(pid), time.monotonic() + seconds
    while time.monotonic() < end:
        if action is not None:
            action()
        else:
            time.sleep(0.05)
        peak = max(peak, rss_mb(pid))
    return peak


def attack_subscriptions(st: Stage, n: int = 100_000) -> dict[str, Any]:
    b0, v0 = rss_mb(st.broker.pid), rss_mb(st.victim.pid)
    sub = st.socket(zmq.SUB, "greedy", st.sub, SNDHWM=0)   # its own key: a broker may ban it
    for i in range(n):
        sub.setsockopt(zmq.SUBSCRIBE, f"{RUN}|upd.{i:08d}".encode())
    peak = _sampled(st.broker.pid, 10.0)
    out = {"subscriptions": n, "broker_mb": [round(b0, 1), round(rss_mb(st.broker.pid), 1)],
           "broker_peak_mb": round(peak, 1), "publisher_mb": [round(v0, 1), round(rss_mb(st.victim.pid), 1)]}
    sub.close(linger=0)
    time.sleep(2.0)
    out["broker_mb_after_disconnect"] = round(rss_mb(st.broker.pid), 1)
    out["key_refused_after"] = not _forwarded_to(st, "greedy")
    return out


def _forwarded_to(st: Stage, name: str, seconds: float = 3.0) -> bool:
    """Whether a fresh subscriber holding ``name``'s key receives what alice publishes."""
    from common import wire
    import torch
    sub = st.socket(zmq.SUB, name, st.sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    pub = st.socket(zmq.PUB, "alice", st.pub)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pub.send_multipart(wire.encode(kind=wire.UPDATE, run=RUN, sender="alice", fragment=0,
                                           values=torch.zeros(8), codec="fp32", round=0, base=0, steps=1, tokens=1))
            if sub.poll(100):
                return True
        return False
    finally:
        sub.close(linger=0)
        pub.close(linger=0)


def _probe(pub: zmq.Socket, sub: zmq.Socket, sender: str) -> None:
    """Publish small valid answers until ``sub`` gets one (the path is up), then drain it."""
    from common import wire
    import torch
    deadline = time.monotonic() + 30
    while not sub.poll(100):
        if time.monotonic() > deadline:
            raise RuntimeError("the broker did not forward within 30 s")
        pub.send_multipart(wire.encode(kind=wire.UPDATE, run=RUN, sender=sender, fragment=0,
                                       values=torch.zeros(8), codec="fp32", round=0, base=0, steps=1, tokens=1))
    while sub.poll(200):
        sub.recv_multipart()


def attack_frames(st: Stage, mib: int = 32, count: int = 16) -> dict[str, Any]:
    """``count`` valid-looking answers of ``mib`` MiB each from one learner, while the shard that
    subscribes to them does not read (frozen): what the broker holds."""
    from common import wire
    import torch
    b0 = rss_mb(st.broker.pid)
    pub = st.socket(zmq.PUB, "mallory", st.pub)
    shard = st.socket(zmq.SUB, "shard0", st.sub)
    shard.setsockopt(zmq.SUBSCRIBE, f"{RUN}|upd.".encode())
    _probe(pub, shard, "mallory")     # the subscription has reached the publisher: it sends
    shard.setsockopt(zmq.RCVHWM, 1)
    big = wire.encode(kind=wire.UPDATE, run=RUN, sender="mallory", fragment=0, values=torch.zeros((mib << 20) // 4),
                      codec="fp32", round=0, base=0, steps=1, tokens=1)
    for _ in range(count):
        pub.send_multipart(big, copy=False)
    peak = _sampled(st.broker.pid, 4.0 + count * mib / 32)
    final = rss_mb(st.broker.pid)
    got = 0
    while shard.poll(1000):
        shard.recv_multipart()
        got += 1
    pub.close(linger=0)
    shard.close(linger=0)
    return {"frame_mib": mib, "frames": count, "broker_mb": [round(b0, 1), round(final, 1)],
            "broker_peak_mb": round(peak, 1), "forwarded": got}


def attack_flood(st: Stage, rate: int = 20_000, seconds: float = 10.0) -> dict[str, Any]:
    from common import wire
    import torch
    b0 = rss_mb(st.broker.pid)
    shard = st.socket(zmq.SUB, "shard0", st.sub, RCVHWM=1_000_000)
    shard.setsockopt(zmq.SUBSCRIBE, f"{RUN}|upd.".encode())
    pub = st.socket(zmq.PUB, "mallory", st.pub, SNDHWM=1_000_000)
    _probe(pub, shard, "mallory")
    frames = wire.encode(kind=wire.UPDATE, run=RUN, sender="mallory", fragment=0, values=torch.zeros(1024),
                         codec="int8", round=0, base=0, steps=1, tokens=1)
    sent, got, peak = 0, 0, b0
    start = time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        while sent < rate * (now - start):
            pub.send_multipart(frames)
            sent += 1
        while shard.poll(0):
            shard.recv_multipart()
            got += 1
        peak = max(peak, rss_mb(st.broker.pid))
    while shard.poll(500):
        shard.recv_multipart()
        got += 1
    elapsed = time.monotonic() - start
    shard.close(linger=0)
    pub.close(linger=0)
    return {"sent_per_s": round(sent / elapsed), "forwarded_per_s": round(got / elapsed),
            "broker_mb": [round(b0, 1), round(rss_mb(st.broker.pid), 1)], "broker_peak_mb": round(peak, 1)}


def attack_peer(st: Stage, seconds: float = 60.0, state_mib: int = 16) -> dict[str, Any]:
    from common import wire
    with tempfile.TemporaryDirectory() as d:
        ready = Path(d) / "endpoint"
        harness = subprocess.Popen([sys.executable, __file__, "peer-harness", st.keys, st.pub, st.sub,
                                    str(state_mib), str(ready)], env=_env(st.root))
        try:
            deadline = time.monotonic() + 60
            while not (ready.exists() and ready.read_text()):
                if time.monotonic() > deadline or harness.poll() is not None:
                    raise RuntimeError("the peer harness did not start")
                time.sleep(0.1)
            time.sleep(1.0)
            l0 = rss_mb(harness.pid)
            asker = st.security(st.keys, "mallory")
            sock = st.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)        # reads nothing: libzmq stops taking from TCP at once
            asker.client(sock, "alice")
            sock.connect(ready.read_text())
            peak, asks = l0, 0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                sock.send_multipart(wire.encode_peer_ask("mallory"))
                asks += 1
                peak = max(peak, rss_mb(harness.pid))
                time.sleep(0.2)
            out = {"seconds": seconds, "state_mib": state_mib, "asks": asks,
                   "learner_mb": [round(l0, 1), round(rss_mb(harness.pid), 1)], "learner_peak_mb": round(peak, 1)}
            sock.close(linger=0)
            return out
        finally:
            stop_processes([harness], 10.0)


def peer_harness(keys: str, broker_pub: str, broker_sub: str, state_mib: str, ready: str) -> None:
    """A learner's real network thread whose training thread only answers state requests with a
    fresh snapshot of ``state_mib`` MiB (as a learner does: a copy at its next step boundary)."""
    import queue
    import threading
    import torch
    from common.config import Endpoints
    from learner.core import LearnerStats
    from learner.network import NetworkThread, Outbox, PeerState, PeerStateWanted
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox = Outbox()
    nt = NetworkThread(learner_id="alice", endpoints=Endpoints(run_id=RUN, broker_pub=broker_pub, broker_sub=broker_sub,
                                                               keys_dir=keys),
                       codec="fp32", numels=[8], inbox=inbox, outbox=outbox, stats=LearnerStats(),
                       shard_endpoints=lambda: (0, {}), stop=threading.Event())
    threading.Thread(target=nt.run, daemon=True).start()
    while not nt.peer_endpoint:
        time.sleep(0.05)
    Path(ready).write_text(nt.peer_endpoint)
    values = torch.randn((int(state_mib) << 20) // 4)
    while True:
        item = inbox.get()
        if isinstance(item, PeerStateWanted):
            outbox.put(PeerState(item.identity, item.requester, {"model": {"w": values.clone()},
                                                                 "optimizer": {"state": {}}, "versions": [0]}))


ATTACKS: dict[str, Callable[..., dict[str, Any]]] = {
    "subscriptions": attack_subscriptions, "frames": attack_frames, "peer": attack_peer, "flood": attack_flood}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["peer-harness"]:
        peer_harness(*argv[1:6])
        return 0
    ap = argparse.ArgumentParser(prog="python -m ddloco.bench.member_limits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(HERE), help="checkout whose daemons run (default: this one)")
    ap.add_argument("--only", choices=list(ATTACKS), action="append", help="run only these attacks")
    ap.add_argument("--peer-seconds", type=float, default=60.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {"root": args.root}
    with tempfile.TemporaryDirectory() as d:
        st = Stage(Path(args.root).resolve(), str(Path(d) / "keys"))
        out["limits"] = st.limits
        try:
            for name in args.only or list(ATTACKS):
                kw = {"seconds": args.peer_seconds} if name == "peer" else {}
                out[name] = ATTACKS[name](st, **kw)
                if not args.json:
                    print(name, out[name], flush=True)
        finally:
            st.close()
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
