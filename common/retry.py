"""Trying again until something succeeds or a deadline passes: the project's one retry loop.

    deadline = retry.Deadline.after(10.0)
    pid = retry.until(lambda: server_pid(host, port), deadline, interval_s=0.02)
    if pid is None: ...   # gave up: the caller says why, in one line

The waits between attempts happen on an ``Event`` (a ``stop`` event cuts them short), never in a
``time.sleep`` loop, and never past the deadline. A connection to Redis is retried by redis-py's
own ``Retry`` (``common.control.connect``); this is for everything else: a server that is not up
yet, a port someone else holds, a lease a crashed process still holds, a key not written yet.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

T = TypeVar("T")


@dataclass
class Deadline:
    """A moment on the monotonic clock; an attempt may move it later (``extend_to``)."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        return cls(time.monotonic() + seconds)

    def remaining_s(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def extend_to(self, at: float) -> None:
        """Give up no earlier than ``at`` (monotonic)."""
        self.at = max(self.at, at)


def until(attempt: Callable[[], T | None], deadline: Deadline, *, interval_s: float,
          stop: threading.Event | None = None, between: Callable[[], None] | None = None) -> T | None:
    """Call ``attempt`` until it returns something other than None, and return that; None once
    the ``deadline`` has passed or ``stop`` is set after an attempt (there is always one).
    Between two attempts, ``between`` runs (a progress message) and the loop waits
    ``interval_s`` (at most what is left of the deadline) on ``stop``."""
    pause = stop if stop is not None else threading.Event()
    while True:
        result = attempt()
        if result is not None:
            return result
        if deadline.passed() or pause.is_set():
            return None
        if between is not None:
            between()
        pause.wait(min(interval_s, deadline.remaining_s()))
