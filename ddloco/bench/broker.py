"""`ddloco bench broker` and `ddloco bench curve`: the broker path's throughput.

``broker``: one publisher floods int4 answers to two live subscribers (reader threads, as a
learner's network thread reads) through each relay of ``RELAY_SHAPES`` on each transport, the
direct PUB -> SUB socket (no hop) measured in the same rounds as the baseline. ``curve``: the
broker path (the broker on a thread of this process) with and without CurveZMQ.

Every relay under test runs until its block ends and is stopped by this process (``_relay``).
Rates count what arrived (PUB/SUB drops under the flood), over the time from the first send to
the last arrival.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from common import wire


def _lo_bytes() -> int:
    """Bytes received on the loopback interface so far (Linux), 0 where unknown."""
    try:
        for line in open("/proc/net/dev"):
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    except OSError:
        pass
    return 0


STRAGGLER_IDLE_S = 2.0
"""A live subscriber stops waiting for the rest of a run's messages after this long without one
(the broker or its socket dropped them under the flood). That wait is never timed."""


@dataclass(frozen=True)
class BrokerRun:
    """One timed run of the broker path."""

    sent: int
    """Messages published."""
    delivered: tuple[int, ...]
    """Messages each live subscriber received (at most ``sent``; PUB/SUB drops under a flood)."""
    seconds: float | None
    """From the first send to the last message a live subscriber received; None when none arrived.
    The idle wait for messages that never came (``STRAGGLER_IDLE_S``) is not in it."""


def receive_until_idle(sock: Any, expected: int, idle_timeout_s: float) -> tuple[int, float | None]:
    """Read ``sock`` until ``expected`` messages arrived or none came for ``idle_timeout_s``: (messages
    received, ``time.perf_counter()`` at the last arrival, None if none). The idle wait ends the read
    but is not part of the time returned."""
    got, last = 0, None
    while got < expected and sock.poll(int(idle_timeout_s * 1000)):
        sock.recv_multipart(copy=False)
        got += 1
        last = time.perf_counter()
    return got, last


def summarize_broker_runs(runs: Sequence[BrokerRun], message_bytes: int) -> dict[str, Any]:
    """Delivered counts, timings and rates of ``runs``: every rate counts the messages a subscriber
    actually received over the time from the first send to the last arrival (messages dropped are
    reported as delivered counts, never as throughput)."""
    timed = [r for r in runs if r.seconds]
    rates = [statistics.fmean(r.delivered) / r.seconds for r in timed]   # messages/s per live subscriber
    seconds = [r.seconds for r in timed]
    return {"delivered_to_live_min": min(min(r.delivered) for r in runs),
            "delivered_to_live_median": statistics.median(statistics.fmean(r.delivered) for r in runs),
            "seconds_median": statistics.median(seconds) if seconds else None,
            "seconds_min": min(seconds) if seconds else None, "seconds_max": max(seconds) if seconds else None,
            "messages_per_s_per_subscriber": statistics.median(rates) if rates else None,
            "MB_per_s_per_subscriber": statistics.median(rates) * message_bytes / 1e6 if rates else None,
            "straggler_wait_s": STRAGGLER_IDLE_S}


RELAY_SHAPES = ("process", "thread", "proxy", "direct")
"""How messages go from the publisher to the subscribers in ``bench broker``: the broker daemon as
its own process (as deployed), the broker on a thread of the bench process (it shares the GIL with
the publisher and the readers), libzmq's own forwarder (``zmq.proxy``, C, in its own process with
the broker's high-water marks: what the hop costs without our loop), or a direct PUB -> SUB socket
(the physical baseline: no hop)."""

PROXY_PROGRAM = """
import sys, zmq
xsub_ep, xpub_ep, hwm = sys.argv[1], sys.argv[2], int(sys.argv[3])
ctx = zmq.Context()
xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
for s in (xsub, xpub):
    s.setsockopt(zmq.SNDHWM, hwm)
    s.setsockopt(zmq.RCVHWM, hwm)
xsub.bind(xsub_ep)
xpub.bind(xpub_ep)
zmq.proxy(xsub, xpub)
"""
"""The ``proxy`` relay: ``python -c PROXY_PROGRAM XSUB XPUB HWM``, until it is terminated."""


@contextlib.contextmanager
def _relay(shape: str, transport: str, keys_dir: str = "") -> Iterator[tuple[str, str, bool]]:
    """(the publisher's endpoint, the subscribers' endpoint, whether the publisher binds) of a
    relay of ``shape`` (``RELAY_SHAPES``) on ``transport`` (tcp on 127.0.0.1, or ipc in a fresh
    private directory), running until the block ends."""
    import sys
    import tempfile

    from broker.daemon import BrokerOptions
    from common.redis_server import free_port
    with tempfile.TemporaryDirectory(prefix="ddloco-ipc-") as tmp:
        if transport == "ipc":
            pub_ep, sub_ep = f"ipc://{tmp}/xsub", f"ipc://{tmp}/xpub"
        else:
            pub_ep, sub_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        if shape == "direct":
            yield pub_ep, pub_ep, True
        elif shape == "thread":
            with _broker_thread(pub_ep, sub_ep, keys_dir):
                yield pub_ep, sub_ep, False
        else:
            if shape == "proxy" and keys_dir:
                raise ValueError("bench broker: the zmq.proxy relay has no CURVE")
            if shape == "process":
                cmd = [sys.executable, "-m", "ddloco", "broker", "--xsub", pub_ep, "--xpub", sub_ep, "--log-level",
                       "warning", *(["--keys", keys_dir, "--shards", "1"] if keys_dir else ["--insecure"])]
            else:
                cmd = [sys.executable, "-c", PROXY_PROGRAM, pub_ep, sub_ep, str(BrokerOptions.hwm_messages)]
            with _relay_process(cmd, f"{tmp}/relay.log"):
                yield pub_ep, sub_ep, False


@contextlib.contextmanager
def _relay_process(cmd: list[str], log_path: str) -> Iterator[None]:
    """``cmd`` running (its output in ``log_path``) until the block ends, then terminated."""
    import subprocess
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield
        except RuntimeError as e:          # it never relayed: say what the relay said
            raise RuntimeError(f"{e}; the relay's log ends: {open(log_path).read()[-500:]}") from None
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def _broker_thread(pub_ep: str, sub_ep: str, keys_dir: str) -> Iterator[None]:
    """The broker (``broker.daemon.Broker``) forwarding on a thread of this process until the block ends."""
    import threading

    from broker.daemon import Broker, BrokerOptions
    stop, ready = threading.Event(), threading.Event()

    def forward() -> None:
        with Broker(BrokerOptions(xsub_bind=pub_ep, xpub_bind=sub_ep, stats_interval_s=1e9, keys_dir=keys_dir)) as b:
            ready.set()
            while not stop.is_set():
                b.poll_once(10)
    t = threading.Thread(target=forward, daemon=True)
    t.start()
    ready.wait(10)
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def _broker_run(frames: list[Any], *, stalled: int, messages: int, keys_dir: str = "",
                wire_bytes: list[int] | None = None, idle_timeout_s: float = STRAGGLER_IDLE_S,
                shape: str = "thread", transport: str = "tcp") -> BrokerRun:
    """One run: ``messages`` sent through a fresh relay (``_relay``: ``shape`` on ``transport``) to
    two live subscribers and ``stalled`` subscribers that never read. ``keys_dir``: CURVE on every
    socket (the publisher is learner ``b``, the subscribers the monitor); ``wire_bytes`` gets the
    loopback bytes of the run appended."""
    import zmq
    with _relay(shape, transport, keys_dir) as (pub_ep, sub_ep, pub_binds):
        ctx = zmq.Context()
        sub_sec = pub_sec = None
        if keys_dir:
            from common.security import Security
            sub_sec, pub_sec = Security(keys_dir, "monitor"), Security(keys_dir, "b")
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 10_000)
            if pub_sec is not None:
                pub_sec.client(pub, "broker")
            pub.bind(pub_ep) if pub_binds else pub.connect(pub_ep)
            subs = []
            for _ in range(2 + stalled):
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.RCVHWM, 100)
                s.setsockopt(zmq.SUBSCRIBE, b"bench|")
                if sub_sec is not None:
                    sub_sec.client(s, "broker")
                s.connect(sub_ep)
                subs.append(s)
            return _timed_flood(pub, subs[:2], frames, messages, wire_bytes, idle_timeout_s)
        finally:
            ctx.destroy(linger=0)


def _timed_flood(pub: Any, live: list[Any], frames: list[Any], messages: int, wire_bytes: list[int] | None,
                 idle_timeout_s: float) -> BrokerRun:
    """Probes until both ``live`` subscribers deliver (a relay starting, a slow joiner; at most 30 s),
    then ``messages`` sent as fast as the publisher can, read by one thread per subscriber."""
    import threading
    deadline = time.monotonic() + 30
    while True:
        pub.send_multipart(frames)
        if all(s.poll(50) for s in live):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("bench broker: the relay delivered nothing within 30 s")
    for s in live:
        while s.poll(200):
            s.recv_multipart()
    received: list[tuple[int, float | None]] = [(0, None), (0, None)]

    def read(i: int) -> None:  # a learner's network thread: reads all the time
        received[i] = receive_until_idle(live[i], messages, idle_timeout_s)
    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for r in readers:
        r.start()
    lo0 = _lo_bytes()
    t0 = time.perf_counter()   # the first send
    for _ in range(messages):
        pub.send_multipart(frames, copy=False)
    for r in readers:
        r.join(60 + idle_timeout_s)
    if wire_bytes is not None:
        wire_bytes.append(_lo_bytes() - lo0)
    arrivals = [last for _, last in received if last is not None]
    return BrokerRun(sent=messages, delivered=tuple(n for n, _ in received),
                     seconds=max(arrivals) - t0 if arrivals else None)


SMALL_MESSAGE_VALUES = 13_000
"""An int4 answer of about 7 kB (the small fragments of a small model), beside ``--numel``'s."""


def bench_broker(numel: int, repeats: int, messages: int = 1000, transports: Sequence[str] = ("tcp",),
                 runs: int = 5) -> list[dict[str, Any]]:
    """Relay throughput of int4 answers (``numel`` values, about 557 kB at the default, and
    ``SMALL_MESSAGE_VALUES``, about 7 kB) from one publisher to two live subscribers (reader
    threads), through each relay of ``RELAY_SHAPES`` (the broker daemon as its own process, as
    deployed; the broker on a thread of this process; ``zmq.proxy``; a direct PUB -> SUB socket, the
    baseline) on each of ``transports`` (tcp on loopback, ipc); and through the process broker with
    a third subscriber that never reads (a frozen learner: the live ones must not slow down). The
    publisher floods as fast as it can, far above a run's rate, so PUB/SUB may drop under this
    overload: ``delivered_to_live_min`` says how many arrived and rates count only those, over the
    time from the first send to the last arrival. At 7 kB the Python readers, not the relay, bound
    the rate, and every relay drops part of the flood (its queues hold 300 messages per
    subscriber; the direct socket's the whole flood). ``runs`` runs per row, interleaved;
    ``vs_direct`` = the row's rate ÷ the direct socket's on its transport in the same round,
    ``vs_tcp`` (ipc rows, with tcp measured too) = the row's rate ÷ the same relay's on tcp in the
    same round (each the median and range over rounds; None where it does not apply)."""
    rows = []
    for n in sorted({numel, SMALL_MESSAGE_VALUES}, reverse=True):
        x = torch.randn(n, generator=torch.Generator().manual_seed(2))
        frames = wire.encode(kind=wire.UPDATE, run="bench", sender="b", fragment=0, values=x, codec="int4",
                             round=1, base=0, steps=24, tokens=24 * 1024)
        size = wire.message_nbytes(frames)
        cases = [(shape, transport, 0) for transport in transports for shape in RELAY_SHAPES] + \
                [("process", transports[0], 1)]
        results: dict[tuple[str, str, int], list[BrokerRun]] = {c: [] for c in cases}
        for _ in range(runs):
            for shape, transport, stalled in cases:
                results[(shape, transport, stalled)].append(
                    _broker_run(frames, stalled=stalled, messages=messages, shape=shape, transport=transport))
        for (shape, transport, stalled), rs in results.items():
            tcp = results.get((shape, "tcp", stalled), []) if transport != "tcp" else []
            rows.append({"shape": shape, "transport": transport, "stalled_subscribers": stalled, "numel": n,
                         "messages": messages, "message_bytes": size, **summarize_broker_runs(rs, size),
                         **_ratio("vs_direct", rs, results[("direct", transport, 0)]), **_ratio("vs_tcp", rs, tcp)})
    return rows


def _rate(run: BrokerRun) -> float:
    """Messages per second per live subscriber (0 when none arrived)."""
    return statistics.fmean(run.delivered) / run.seconds if run.seconds else 0.0


def _ratio(name: str, runs: Sequence[BrokerRun], baseline: Sequence[BrokerRun]) -> dict[str, Any]:
    """{``name``: the rate of ``runs`` ÷ that of ``baseline``, the median over rounds (the i-th run
    of each was measured in the same round), ``name``_range: [lowest, highest]}; None for both
    without a round where both delivered."""
    ratios = [_rate(r) / _rate(b) for r, b in zip(runs, baseline) if _rate(r) and _rate(b)]
    return {name: statistics.median(ratios) if ratios else None,
            f"{name}_range": [min(ratios), max(ratios)] if ratios else None}


def bench_curve(numel: int, repeats: int, messages: int = 1000) -> list[dict[str, Any]]:
    """The broker path (publisher -> broker -> 2 live subscribers) with and without CurveZMQ on
    every socket and the broker's role check: time and loopback bytes for ``messages`` int4
    answers of ``numel`` values, and of 7,520-value ones (``ddloco up``'s tiny demo model).
    Median of 5 runs per row, runs interleaved."""
    import tempfile
    from common.security import create_keys
    rows = []
    with tempfile.TemporaryDirectory() as keys_dir:
        create_keys(keys_dir, learners=["b"])
        for n in sorted({numel, 7520}):
            x = torch.randn(n, generator=torch.Generator().manual_seed(2))
            frames = wire.encode(kind=wire.UPDATE, run="bench", sender="b", fragment=0, values=x, codec="int4",
                                 round=1, base=0, steps=24, tokens=24 * 1024)
            size = wire.message_nbytes(frames)
            runs: dict[bool, list[tuple[BrokerRun, int]]] = {False: [], True: []}
            for _ in range(5):
                for curve in (False, True):
                    wb: list[int] = []
                    run = _broker_run(frames, stalled=0, messages=messages, keys_dir=keys_dir if curve else "",
                                      wire_bytes=wb)
                    runs[curve].append((run, wb[0]))
            for curve, rs in runs.items():
                summary = summarize_broker_runs([r for r, _ in rs], size)
                rows.append({"curve": curve, "numel": n, "message_bytes": size, "messages": messages,
                             "delivered_min": summary["delivered_to_live_min"],
                             "seconds_median": summary["seconds_median"], "seconds_min": summary["seconds_min"],
                             "seconds_max": summary["seconds_max"],
                             "messages_per_s": summary["messages_per_s_per_subscriber"],
                             "loopback_bytes_per_message": statistics.median(b for _, b in rs) / messages / 3})
    return rows
