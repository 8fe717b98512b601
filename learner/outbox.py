"""The training thread's outbox to the network thread (learner/network.py).

Thread-safe by its lock ``_answers_lock`` (it guards the waiting answers, the pipe's file
descriptors and ``replaced``); every other piece of it is a ``queue.SimpleQueue``.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Any

from learner.messages import Answer


class Outbox:
    """Training (and control) thread -> network thread, thread-safe.

    Bounded where it matters: at most one unsent ``Answer`` per fragment. A newer answer for a
    fragment replaces an older one still waiting (its round would merge without it anyway, and the
    newer snapshot holds every step the older one did); ``replaced`` counts them. Every ``put``
    writes a byte to a pipe whose read end the network thread polls with its sockets, so it
    sleeps until there is something to send (no timed polling)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: dict[int, Answer] = {}
        self._answers_lock = threading.Lock()
        self.replaced = 0
        self.fd, self._wfd = -1, -1
        self._pid = 0
        self.own_pipe()

    def own_pipe(self) -> None:
        """A pipe of this process: after a fork (the standby factory forks prepared learners) the
        inherited one is shared with the parent and its other forks; call before the network thread."""
        if self._pid == os.getpid():
            return
        with self._answers_lock:
            for fd in (self.fd, self._wfd):
                if fd >= 0:
                    os.close(fd)
            self.fd, self._wfd = os.pipe()
            os.set_blocking(self.fd, False)
            os.set_blocking(self._wfd, False)
            self._pid = os.getpid()

    def put(self, item: Any) -> None:
        if isinstance(item, Answer):
            with self._answers_lock:
                if self._answers.pop(item.fragment, None) is not None:
                    self.replaced += 1
                self._answers[item.fragment] = item
        else:
            self._q.put(item)
        with self._answers_lock:
            if self._wfd < 0:
                return                       # closed: nobody reads any more (never write to a reused fd)
            try:
                os.write(self._wfd, b"\0")
            except (BlockingIOError, OSError):   # the pipe is full: a wake-up is pending anyway
                pass

    def get_nowait(self) -> Any:
        """Requests first, then the oldest waiting answer; ``queue.Empty`` when nothing waits."""
        try:
            return self._q.get_nowait()
        except queue.Empty:
            pass
        with self._answers_lock:
            if not self._answers:
                raise queue.Empty
            return self._answers.pop(next(iter(self._answers)))

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except OSError:   # BlockingIOError: drained
            pass

    def qsize(self) -> int:
        with self._answers_lock:
            return self._q.qsize() + len(self._answers)

    def close(self) -> None:
        """After the network thread ended."""
        with self._answers_lock:
            fds, self.fd, self._wfd = (self.fd, self._wfd), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
