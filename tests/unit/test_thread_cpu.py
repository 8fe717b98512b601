"""common.thread_cpu: libzmq's I/O threads' CPU, read from /proc (a learner's ``io_cpu_s``)."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import zmq

from common import thread_cpu
from tests.conftest import wait_until
from common.thread_cpu import ZMQ_IO_PREFIX, ThreadCpu, threads_cpu_s

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")


def _busy_thread(name: str, seconds: float, hold: threading.Event | None = None) -> threading.Thread:
    """A thread named ``name`` that spends ``seconds`` of CPU, then (``hold``) waits for that event
    before it ends: on a loaded machine a reader may not look before a short-lived thread is gone."""
    def spin() -> None:
        if sys.platform.startswith("linux"):    # the name /proc shows (this Python does not set it)
            import ctypes
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        if hold is not None:
            hold.wait(60)
    t = threading.Thread(target=spin, daemon=True)   # a failed test never waits on a held one
    t.start()
    return t


def test_counts_only_the_threads_of_that_name_and_their_cpu() -> None:
    before = threads_cpu_s("ddloco-spin")
    assert before == 0.0                                  # no such thread yet
    t = _busy_thread("ddloco-spin", 0.3)
    other = _busy_thread("other-spin", 0.3)
    while t.is_alive():
        seen = threads_cpu_s("ddloco-spin")
        assert seen is not None and seen <= 0.3 + 0.05
        t.join(0.05)
    other.join()
    wait_until(lambda: threads_cpu_s("ddloco-spin") == 0.0, 10, what="the ended thread to be no longer counted")


def test_libzmq_io_threads_are_found_and_charged_for_the_bytes_they_move() -> None:
    ctx = zmq.Context()
    try:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        start = threads_cpu_s(ZMQ_IO_PREFIX)
        assert start is not None
        payload = b"x" * (8 << 20)
        end = time.monotonic() + 20
        while threads_cpu_s(ZMQ_IO_PREFIX) - start < 0.05:   # ticks of 10 ms: a few of them
            assert time.monotonic() < end, "libzmq's I/O threads moved 8 MB messages and charged no CPU"
            push.send(payload)
            assert len(pull.recv()) == len(payload)
        push.close(0)
        pull.close(0)
    finally:
        ctx.term()


def test_a_reader_remembers_its_threads_and_looks_again_when_one_ends_or_later(monkeypatch) -> None:
    reader = ThreadCpu("ddloco-memo")
    assert reader.seconds() == 0.0                        # none yet: listed again at each reading
    found = threading.Event()
    t = _busy_thread("ddloco-memo", 0.2, hold=found)
    wait_until(lambda: (reader.seconds() or 0.0) > 0.0, 10, what="the new thread to be found")
    found.set()
    other = _busy_thread("ddloco-memo", 0.2)              # found above: the reader keeps its list
    while other.is_alive():
        assert (reader.seconds() or 0.0) <= 0.2 + 0.05    # the second thread not listed within RESCAN_S
        other.join(0.05)
    t.join()
    monkeypatch.setattr(thread_cpu, "RESCAN_S", 0.0)
    wait_until(lambda: reader.seconds() == 0.0, 10, what="a listing without the ended thread")
    counted = threading.Event()
    u = _busy_thread("ddloco-memo", 0.3, hold=counted)
    wait_until(lambda: (reader.seconds() or 0.0) >= 0.1, 10, what="the new thread found at the next listing and counted")
    monkeypatch.setattr(thread_cpu, "RESCAN_S", 3600.0)
    counted.set()
    u.join()      # (the OS thread exits just after Python's join returns)
    wait_until(lambda: reader.seconds() == 0.0, 10, what="the ended thread's stat file to go and it to be dropped")
