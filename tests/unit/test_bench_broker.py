"""`ddloco bench broker`: what it times and what its rates count."""
from __future__ import annotations

import time

import pytest
import zmq

from ddloco.bench.broker import BrokerRun, receive_until_idle, summarize_broker_runs

pytestmark = pytest.mark.timeout(30)


def test_the_wait_for_messages_that_never_come_is_not_timed():
    ctx = zmq.Context()
    try:
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        pub.bind("inproc://bench-idle")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect("inproc://bench-idle")
        while True:   # slow joiner: probes until the subscription delivers
            pub.send(b"probe")
            if sub.poll(50):
                break
        while sub.poll(100):
            sub.recv()
        first_send = time.perf_counter()
        for _ in range(10):   # 10 of the 30 expected: 20 were "dropped"
            pub.send(b"x" * 100)
        got, last = receive_until_idle(sub, expected=30, idle_timeout_s=0.5)
        returned = time.perf_counter()
    finally:
        ctx.destroy(linger=0)
    assert got == 10
    assert returned - first_send >= 0.5, "the read should wait out the idle timeout for the missing 20"
    assert last is not None and last - first_send < 0.25, f"timed {last - first_send:.3f}s: the idle wait was counted"


def test_rates_count_the_messages_delivered_over_first_send_to_last_arrival():
    size = 1_000_000
    runs = [BrokerRun(sent=1000, delivered=(500, 300), seconds=0.5),   # a flood that lost messages
            BrokerRun(sent=1000, delivered=(0, 0), seconds=None)]      # nothing arrived: not timed
    s = summarize_broker_runs(runs, size)
    assert s["delivered_to_live_min"] == 0 and s["delivered_to_live_median"] == 200
    assert s["seconds_median"] == s["seconds_min"] == s["seconds_max"] == 0.5
    assert s["messages_per_s_per_subscriber"] == 800.0, s   # (500 + 300) / 2 delivered in 0.5 s, not 1000 / 0.5
    assert s["MB_per_s_per_subscriber"] == 800.0
    assert summarize_broker_runs([runs[1]], size)["MB_per_s_per_subscriber"] is None


@pytest.mark.timeout(90)
def test_a_short_bench_relays_every_message_through_each_relay_on_tcp_and_ipc():
    """A short ``bench broker`` (50 small answers, one round): the broker daemon as its own process,
    on a thread, zmq.proxy and the direct socket relay every message to both live subscribers on
    loopback tcp and on ipc (real processes and sockets); each ratio is taken against its own
    baseline (the direct socket on the same transport, the same relay on tcp)."""
    from ddloco.bench.broker import RELAY_SHAPES, SMALL_MESSAGE_VALUES, bench_broker
    rows = bench_broker(SMALL_MESSAGE_VALUES, 1, messages=50, transports=("tcp", "ipc"), runs=1)
    cases = [(r["shape"], r["transport"], r["stalled_subscribers"]) for r in rows]
    assert cases == [(s, t, 0) for t in ("tcp", "ipc") for s in RELAY_SHAPES] + [("process", "tcp", 1)], cases
    assert set(RELAY_SHAPES) == {"process", "thread", "proxy", "direct"}, RELAY_SHAPES
    for r in rows:
        assert r["delivered_to_live_min"] == 50 and r["message_bytes"] < 8000, r
        assert r["vs_direct"] > 0 and r["vs_direct_range"][0] <= r["vs_direct"] <= r["vs_direct_range"][1], r
        assert (r["vs_tcp"] is None) == (r["transport"] == "tcp"), r
        assert r["vs_tcp_range"] is None or r["vs_tcp_range"][0] <= r["vs_tcp"] <= r["vs_tcp_range"][1], r
    assert [r["vs_direct"] for r in rows if r["shape"] == "direct"] == [1.0, 1.0]
