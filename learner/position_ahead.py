"""A learner's data position written ahead of each step (docs/architecture.md, "Data position").

The heartbeat writes how many batches a learner id has trained on every ``heartbeat_interval_s``;
a SIGKILLed process's successor would train the batches since that write again. With per-step
writes the training thread records, before an inner step takes its batches, the position after
them (``position_ahead`` in the learner's hash; ``common.positions.resume_at`` takes the larger of
it and ``data_position``): whoever goes on under the id starts at the first batch no life of it
has taken, whatever killed the last one. A step killed half-way has taken its batches: they are
not trained again (the killed process's progress since its last answer is lost either way).

One Redis round trip per step, on the training thread, before the forward pass. ``auto`` keeps
the writes while one costs at most ``AUTO_SHARE`` of a step (a learner next to Redis: ~0.2 ms
against steps of tens of milliseconds and more), and goes back to the heartbeat's positions
(logged once) when Redis is far: a learner never waits on a far Redis at every step. A write
that fails (Redis away) is skipped for a while, doubling up to ``RETRY_MAX_S``: the learner
trains on, its successor may then repeat the batches since the last write.
"""
from __future__ import annotations

import time
from typing import Any

import redis

MODES = ("auto", "step", "heartbeat")
AUTO_SHARE = 0.02
"""``auto``: per-step writes while their EMA is at most this share of the step time."""
AUTO_SAMPLES = 20
"""Writes timed before ``auto`` may decide."""
TIMEOUT_S = 0.25
"""A write slower than this fails (Redis away or overloaded); the next is tried after a pause."""
RETRY_MIN_S, RETRY_MAX_S = 1.0, 16.0


class PositionAhead:
    """The training thread's writer of ``position_ahead`` (one Redis connection of its own, no
    retries: a lost Redis costs one ``TIMEOUT_S`` per pause, never a step stuck on reconnects)."""

    def __init__(self, mode: str, redis_url: str, key: str, log: Any) -> None:
        if mode not in MODES:
            raise ValueError(f"position writes must be one of {MODES}, got {mode!r}")
        self.mode, self.key, self.log = mode, key, log
        self.active = mode != "heartbeat"
        self._client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=TIMEOUT_S,
                                            socket_connect_timeout=TIMEOUT_S, retry_on_timeout=False,
                                            retry=None) if self.active else None
        self.written = 0
        self.failures = 0
        self.write_ema_s = 0.0
        self._retry_at = 0.0
        self._pause_s = RETRY_MIN_S

    def write(self, position: int, step_s: float) -> None:
        """Record ``position`` (the batches this id will have taken once the coming step has its
        own) before the step trains; ``step_s``: the learner's step time (EMA; 0 when unknown)."""
        if not self.active:
            return
        now = time.monotonic()
        if now < self._retry_at:
            return
        t0 = time.perf_counter()
        try:
            self._client.hset(self.key, "position_ahead", int(position))
        except redis.RedisError as e:
            self.failures += 1
            self._retry_at = now + self._pause_s
            self.log.warning("learner.position_write_failed", error=str(e), failures=self.failures,
                             retry_in_s=self._pause_s)
            self._pause_s = min(RETRY_MAX_S, 2 * self._pause_s)
            return
        took = time.perf_counter() - t0
        self._pause_s = RETRY_MIN_S
        self.write_ema_s = took if self.written == 0 else 0.9 * self.write_ema_s + 0.1 * took
        self.written += 1
        if (self.mode == "auto" and self.written >= AUTO_SAMPLES and step_s > 0
                and self.write_ema_s > AUTO_SHARE * step_s):
            self.active = False
            self.log.info("learner.position_writes_heartbeat", write_ms=round(1e3 * self.write_ema_s, 3),
                          step_ms=round(1e3 * step_s, 3), share=AUTO_SHARE)
            self.close()

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except redis.RedisError:
                pass
            self._client = None
            self.active = False
