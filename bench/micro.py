"""`ddloco bench`: micro benchmarks of the hot paths (codecs, wire framing, merge, broker).

Timings are medians over repeats on this machine; compare figures from one run only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from common import quant, wire
from common.merge import contribution_weights, merge_outer_gradients, outer_nesterov_step


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000.0


def bench_codec(numel: int, repeats: int) -> list[dict[str, Any]]:
    """Encode/decode time, payload size and max abs error of each codec on N(0,1) values."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for codec in quant.CODECS:
        frames = quant.encode(x, codec)
        err = float((quant.decode(frames, codec, numel) - x).abs().max())
        enc = _median_ms(lambda: quant.encode(x, codec), repeats)
        dec = _median_ms(lambda: quant.decode(frames, codec, numel), repeats)
        nbytes = quant.payload_nbytes(numel, codec)
        rows.append({"codec": codec, "numel": numel, "bytes": nbytes, "bits_per_value": 8 * nbytes / numel,
                     "encode_ms": enc, "decode_ms": dec, "encode_input_GB_per_s": numel * 4 / enc / 1e6,
                     "max_abs_error": err})
    return rows


def bench_wire(numel: int, repeats: int) -> list[dict[str, Any]]:
    """Full message encode (quantize + header + CRC) and decode (checks + CRC) of one fragment."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    rows = []
    for codec in ("fp32", "int4"):
        def enc() -> list[Any]:
            return wire.encode(kind=wire.UPDATE, run="bench", sender="b", fragment=0, values=x, codec=codec,
                               round=1, base=0, steps=24, tokens=24 * 1024)
        frames = [bytes(memoryview(f)) for f in enc()]
        rows.append({"codec": codec, "numel": numel, "message_bytes": wire.message_nbytes(frames),
                     "encode_ms": _median_ms(enc, repeats),
                     "decode_header_ms": _median_ms(lambda: wire.decode(frames), repeats),
                     "decode_values_ms": _median_ms(lambda: wire.decode(frames).values(), repeats)})
    return rows


def bench_merge(numel: int, repeats: int, learners: Sequence[int] = (2, 4, 8)) -> list[dict[str, Any]]:
    """Syncer merge of one fragment (24 tensors): weights, per-tensor RDA, outer Nesterov step."""
    per = numel // 24
    spans = tuple((i * per, (i + 1) * per, i == 0) for i in range(24))
    n = per * 24
    rows = []
    for m in learners:
        g = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
        theta, mom = torch.zeros(n), torch.zeros(n)

        def merge() -> None:
            w = contribution_weights([1024.0 * 24] * m, [24] * m)
            outer_nesterov_step(theta, mom, merge_outer_gradients(g, w, spans), lr=0.7, momentum_coef=0.9)
        rows.append({"learners": m, "numel": n, "merge_ms": _median_ms(merge, repeats)})
    return rows


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


def _broker_run(frames: list[Any], *, stalled: int, messages: int, keys_dir: str = "",
                wire_bytes: list[int] | None = None) -> tuple[int, float]:
    """One run: ``messages`` sent through a fresh broker to two live subscribers and ``stalled``
    subscribers that never read. Returns (messages both live subscribers got, seconds).
    ``keys_dir``: CURVE on every socket (the publisher is learner ``b``, the subscribers the
    monitor); ``wire_bytes`` gets the loopback bytes of the timed part appended."""
    import threading

    import zmq

    from broker.daemon import Broker, BrokerOptions
    from common.redis_server import free_port

    pub_ep, sub_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    stop, ready = threading.Event(), threading.Event()

    def forward() -> None:
        with Broker(BrokerOptions(xsub_bind=pub_ep, xpub_bind=sub_ep, stats_interval_s=1e9, keys_dir=keys_dir)) as b:
            ready.set()
            while not stop.is_set():
                b.poll_once(10)
    t = threading.Thread(target=forward, daemon=True)
    t.start()
    ready.wait(10)
    ctx = zmq.Context()
    sub_sec = pub_sec = None
    if keys_dir:
        from common.security import Security
        sub_sec, pub_sec = Security(keys_dir, "monitor"), Security(keys_dir, "b")
    try:
        subs = []
        for _ in range(2 + stalled):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.RCVHWM, 100)
            s.setsockopt(zmq.SUBSCRIBE, b"bench|")
            if sub_sec is not None:
                sub_sec.client(s, "broker")
            s.connect(sub_ep)
            subs.append(s)
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        if pub_sec is not None:
            pub_sec.client(pub, "broker")
        pub.connect(pub_ep)
        live = subs[:2]
        while True:  # slow joiner: send probes until both live subscriptions deliver
            pub.send_multipart(frames)
            if all(s.poll(50) for s in live):
                break
        for s in live:
            while s.poll(200):
                s.recv_multipart()
        got = [0, 0]
        last = [0.0, 0.0]
        done = [threading.Event(), threading.Event()]

        def read(i: int) -> None:  # a learner's network thread: reads all the time
            s = live[i]
            while got[i] < messages and s.poll(2000):
                s.recv_multipart(copy=False)
                got[i] += 1
                last[i] = time.perf_counter()
            done[i].set()
        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
        lo0 = _lo_bytes()
        t0 = time.perf_counter()
        for r in readers:
            r.start()
        for _ in range(messages):
            pub.send_multipart(frames, copy=False)
        for d in done:
            d.wait(60)
        t1 = max(last) if min(got) else time.perf_counter()  # the last arrival, not the idle wait after drops
        if wire_bytes is not None:
            wire_bytes.append(_lo_bytes() - lo0)
        for r in readers:
            r.join(5)
        return min(got), t1 - t0
    finally:
        ctx.destroy(linger=0)
        stop.set()
        t.join(5)


def bench_broker(numel: int, repeats: int, messages: int = 1000) -> list[dict[str, Any]]:
    """Broker throughput with int4 fragment messages to two live subscribers (reader threads),
    with and without a subscriber that never reads (a frozen learner): the live ones must not be
    slowed by it. The publisher floods as fast as it can, far above a run's rate (one fragment
    per learner step), so PUB/SUB may drop under this overload; ``delivered_to_live_min`` says
    how many arrived. Median of 5 runs per row, runs interleaved."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    frames = wire.encode(kind=wire.UPDATE, run="bench", sender="b", fragment=0, values=x, codec="int4",
                         round=1, base=0, steps=24, tokens=24 * 1024)
    size = wire.message_nbytes(frames)
    runs: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    for _ in range(5):
        for stalled in (0, 1):
            runs[stalled].append(_broker_run(frames, stalled=stalled, messages=messages))
    rows = []
    for stalled, rs in runs.items():
        delivered = min(n for n, _ in rs)
        dt = statistics.median(s for _, s in rs)
        rows.append({"stalled_subscribers": stalled, "messages": messages, "message_bytes": size,
                     "delivered_to_live_min": delivered, "seconds_median": dt,
                     "seconds_min": min(s for _, s in rs), "seconds_max": max(s for _, s in rs),
                     "MB_per_s_per_subscriber": messages * size / dt / 1e6})
    return rows


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
            runs: dict[bool, list[tuple[int, float, int]]] = {False: [], True: []}
            for _ in range(5):
                for curve in (False, True):
                    wb: list[int] = []
                    got, dt = _broker_run(frames, stalled=0, messages=messages, keys_dir=keys_dir if curve else "",
                                          wire_bytes=wb)
                    runs[curve].append((got, dt, wb[0]))
            for curve, rs in runs.items():
                dt = statistics.median(r[1] for r in rs)
                rows.append({"curve": curve, "numel": n, "message_bytes": size, "messages": messages,
                             "delivered_min": min(r[0] for r in rs), "seconds_median": dt,
                             "seconds_min": min(r[1] for r in rs), "seconds_max": max(r[1] for r in rs),
                             "messages_per_s": messages / dt,
                             "loopback_bytes_per_message": statistics.median(r[2] for r in rs) / messages / 3})
    return rows


BENCHES = {"codec": bench_codec, "wire": bench_wire, "merge": bench_merge, "broker": bench_broker,
           "curve": bench_curve}


def _print_table(name: str, rows: list[dict[str, Any]]) -> None:
    print(f"## {name}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()]
        print("| " + " | ".join(cells) + " |")
    print()


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="ddloco bench", description="Micro benchmarks of the hot paths. "
                                 "Timings are medians on this machine; compare figures from one run only.")
    ap.add_argument("name", choices=[*BENCHES, "all"], help="which benchmark")
    ap.add_argument("--numel", type=int, default=1 << 20, help="elements per fragment (default 1,048,576)")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per figure (default 20)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, like a learner's helper)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(list(argv))
    if args.numel < 64 or args.repeats < 1 or args.threads < 1:
        ap.error("--numel must be >= 64, --repeats and --threads >= 1")
    torch.set_num_threads(args.threads)
    from common.log import configure_logging
    configure_logging(level="warning")  # results on stdout, nothing else
    names = list(BENCHES) if args.name == "all" else [args.name]
    out = {n: BENCHES[n](args.numel, args.repeats) for n in names}
    if args.json:
        print(json.dumps({"numel": args.numel, "threads": args.threads, "results": out}, indent=2))
    else:
        print(f"numel={args.numel:,} threads={args.threads} repeats={args.repeats} (medians)\n")
        for n, rows in out.items():
            _print_table(n, rows)
    return 0
