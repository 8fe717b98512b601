"""learner/ownership.py: an owned object used from a thread that does not own it raises."""
from __future__ import annotations

import threading

import pytest

from learner import ownership
from learner.stats import LearnerStats

pytestmark = pytest.mark.timeout(30)


def _in_thread(fn) -> BaseException | None:
    err: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as e:
            err.append(e)
    t = threading.Thread(target=body, name="intruder")
    t.start()
    t.join(10)
    return err[0] if err else None


def test_a_claimed_object_raises_on_a_read_or_write_from_another_thread(monkeypatch) -> None:
    monkeypatch.setattr(ownership, "CHECKS", True)
    stats = ownership.owned(LearnerStats(), "stats")
    assert _in_thread(lambda: stats.steps) is None          # not claimed yet: anyone (set-up)
    ownership.claim(stats)
    stats.steps += 1                                        # the owner
    read = _in_thread(lambda: stats.steps)
    assert isinstance(read, ownership.ForeignThreadAccess)
    assert "stats.steps" in str(read) and "'intruder'" in str(read) and threading.current_thread().name in str(read)
    assert isinstance(_in_thread(lambda: setattr(stats, "tokens", 5)), ownership.ForeignThreadAccess)
    assert ownership.unwrapped(stats).steps == 1 and ownership.unwrapped(stats).tokens == 0


def test_without_checks_the_object_is_itself() -> None:
    stats = LearnerStats()
    assert ownership.owned(stats, "stats") is stats and not ownership.CHECKS
