"""The learner's outbox: answers bounded per fragment, a wake-up the network thread can poll."""
from __future__ import annotations

import os
import queue
import select

import pytest
import torch

from learner.network import Answer, Fetch, Outbox


def _answer(fragment: int, round: int) -> Answer:
    x = torch.zeros(4)
    return Answer(fragment=fragment, epoch=1, round=round, attempt=0, base=0, base_values=x, snapshot=x,
                  steps=1, tokens=1)


def test_a_newer_answer_replaces_the_unsent_older_one_of_its_fragment_and_is_counted() -> None:
    box = Outbox()
    try:
        assert not select.select([box.fd], [], [], 0)[0]
        box.put(_answer(0, 1))
        assert select.select([box.fd], [], [], 0)[0]          # the network thread would wake now
        box.drain_wakeups()
        assert not select.select([box.fd], [], [], 0)[0]
        box.put(_answer(1, 1))
        box.put(_answer(0, 2))                                 # replaces round 1 of fragment 0
        box.put(Fetch((3,)))
        assert box.replaced == 1 and box.qsize() == 3
        got = [box.get_nowait() for _ in range(3)]
        assert isinstance(got[0], Fetch)                       # requests go first
        assert [(a.fragment, a.round) for a in got[1:]] == [(1, 1), (0, 2)]
        with pytest.raises(queue.Empty):
            box.get_nowait()
    finally:
        box.close()
    box.put(_answer(0, 3))                                     # after close: kept, no write to a stale fd
    assert box.qsize() == 1


def test_a_forked_process_gets_a_pipe_of_its_own() -> None:
    box = Outbox()
    try:
        box._pid = -1                                          # as seen from a fork of the creator
        box.own_pipe()
        assert box._pid == os.getpid() and box.fd >= 0
        box.put(_answer(0, 1))
        assert select.select([box.fd], [], [], 0)[0]
    finally:
        box.close()
