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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape,transport", [("process", "ipc"), ("direct", "tcp")])
def test_a_run_through_the_broker_daemon_or_a_direct_socket_delivers_every_message(shape: str, transport: str) -> None:
    """The deployed shape (the broker daemon as its own process, here on ipc://) and the physical
    baseline (a direct PUB -> SUB socket) relay a short flood of small int4 answers to both live
    subscribers: real processes and sockets."""
    import torch

    from common import wire
    from ddloco.bench.broker import _broker_run
    frames = wire.encode(kind=wire.UPDATE, run="bench", sender="b", fragment=0, values=torch.randn(500),
                         codec="int4", round=1, base=0, steps=1, tokens=1)
    run = _broker_run(frames, stalled=0, messages=50, shape=shape, transport=transport)
    assert run.delivered == (50, 50) and run.seconds and run.seconds > 0
