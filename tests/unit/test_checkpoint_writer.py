"""The shard's checkpoint writer: off the event loop, newest snapshot wins, nothing lost at stop."""
from __future__ import annotations

import threading

from syncer.shard import LatestWriter
from tests.conftest import wait_until


def test_writes_off_the_caller_thread_skips_superseded_snapshots_and_close_waits():
    written: list[tuple[int, str]] = []
    release = threading.Event()

    def write(item: int) -> None:
        if item == 0:
            release.wait(10)       # a slow disk: the first write blocks
        written.append((item, threading.current_thread().name))

    w = LatestWriter(write, name="ckpt-writer")
    w.submit(0)
    wait_until(lambda: w._busy, 5, what="first write in progress")
    for item in (1, 2, 3):         # submitted while the disk is busy: only the newest matters
        w.submit(item)
    release.set()
    w.close()                      # returns once nothing is pending or being written
    assert [i for i, _ in written] == [0, 3]
    assert {name for _, name in written} == {"ckpt-writer"}


def test_a_failing_write_does_not_stop_the_writer():
    seen: list[int] = []

    def write(item: int) -> None:
        seen.append(item)
        if item == 1:
            raise RuntimeError("disk gone")

    w = LatestWriter(write, name="w")
    w.submit(1)
    w.close()
    w.submit(2)
    w.close()
    assert seen == [1, 2]
