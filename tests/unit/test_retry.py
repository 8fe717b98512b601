"""``common.retry``: the one retry loop (attempt, give up at a deadline or a stop, wait on an Event)."""
from __future__ import annotations

import threading
import time

import pytest

from common import retry

pytestmark = pytest.mark.timeout(10)


def _attempts(results):
    calls = []

    def attempt():
        calls.append(time.monotonic())
        return results[len(calls) - 1] if len(calls) <= len(results) else None
    return attempt, calls


def test_the_first_answer_is_returned_and_progress_runs_between_tries_only():
    attempt, calls = _attempts([None, None, "up"])
    between = []
    assert retry.until(attempt, retry.Deadline.after(5.0), interval_s=0.001, between=lambda: between.append(1)) == "up"
    assert len(calls) == 3 and len(between) == 2


def test_a_passed_deadline_still_gets_one_attempt_and_no_wait():
    attempt, calls = _attempts([])
    between = []
    assert retry.until(attempt, retry.Deadline.after(0.0), interval_s=5.0, between=lambda: between.append(1)) is None
    assert len(calls) == 1 and between == []


def test_a_stop_ends_the_tries_after_the_current_one():
    stop = threading.Event()
    stop.set()
    attempt, calls = _attempts([])
    t0 = time.monotonic()
    assert retry.until(attempt, retry.Deadline.after(30.0), interval_s=5.0, stop=stop) is None
    assert len(calls) == 1 and time.monotonic() - t0 < 1.0


def test_the_wait_never_runs_past_the_deadline():
    attempt, calls = _attempts([])
    t0 = time.monotonic()
    assert retry.until(attempt, retry.Deadline.after(0.2), interval_s=30.0) is None
    assert len(calls) == 2 and time.monotonic() - t0 < 2.0     # once, then once more at the deadline


def test_an_attempt_may_give_itself_more_time():
    deadline = retry.Deadline.after(0.0)
    calls = []

    def attempt():
        calls.append(1)
        if len(calls) == 1:
            deadline.extend_to(time.monotonic() + 0.05)
        return "late" if len(calls) == 3 else None
    assert retry.until(attempt, deadline, interval_s=0.001) == "late"
    deadline.extend_to(0.0)                                      # never earlier
    assert deadline.at > 0.0
