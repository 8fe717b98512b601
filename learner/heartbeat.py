"""The learner's control thread: heartbeat and counters to Redis in one pipeline per interval,
the shards' endpoints and the run's token count read back (ALGORITHM §8, DESIGN "Control state").

Ownership: ``Heartbeat`` belongs to the control thread. It reads the training thread's published
``LearnerView`` (through ``counters``), and publishes two values the other threads read, each
replaced whole, never changed in place: ``shard_endpoints`` (for the network thread) and
``run_count`` (for the training thread's learning-rate schedule).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import redis

from common import control, tokens as run_count
from common.keys import Keys, token_share


class Heartbeat:
    """``run(stop)`` is the control thread's body; ``beat`` one interval's work."""

    def __init__(self, *, redis_client: Any, keys: Keys, learner_id: str, incarnation: str, ttl_s: float,
                 interval_s: float, counters: Callable[[], dict[str, Any]], tokens: Callable[[], int],
                 run_count_at_join: int, log: Any) -> None:
        """``counters``: the learner's hash fields now; ``tokens``: the tokens this learner has
        trained on (both read from what the training thread published)."""
        self.redis = redis_client
        self.keys = keys
        self.learner_id = learner_id
        self.incarnation = incarnation
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.counters = counters
        self.tokens = tokens
        self.log = log
        self.shard_endpoints: tuple[int, dict[int, str]] = (0, {})
        """(S, shard -> endpoint) as last read: published to the network thread."""
        self.run_count: tuple[int, int] = (run_count_at_join, 0)
        """(the run's token count as last read, our own tokens then): published to the training thread."""
        self._count_behind = False
        self._redis_ok = True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.beat()
                if not self._redis_ok:
                    self.log.info("learner.redis_back")
                self._redis_ok = True
            except redis.RedisError as e:
                if self._redis_ok:
                    self.log.warning("learner.redis_unavailable", error=str(e))
                self._redis_ok = False
            stop.wait(self.interval_s)

    def beat(self) -> None:
        shards, eps = control.shard_endpoints(self.redis, self.keys)
        self.shard_endpoints = (shards, eps)
        pipe = self.redis.pipeline(transaction=False)
        control.beat(pipe, self.keys, self.learner_id, self.counters(), self.ttl_s)
        ours = self.tokens()
        # epochs, fragment versions and the run's token count are the shards' to write (they
        # take our own count from our hash, a beat late): the total, with our tokens the shards
        # have not taken in yet; our view of it never goes back
        share_field = token_share(self.learner_id, self.incarnation)
        pipe.get(self.keys.tokens)
        pipe.hget(self.keys.token_shares, share_field)
        res = pipe.execute()
        total = run_count.parse_total(res[-2])     # not a count (a member wrote it): this beat skipped
        share = run_count.parse_share(share_field, res[-1] or 0) or 0
        if total is not None:
            self._note_run_count(total + max(0, ours - share), ours)

    def _note_run_count(self, total: int, ours: int) -> None:
        """The run's count as read with ``ours`` tokens of our own: our view goes on from what it
        had counted while the total is below it (Redis restarted empty, the shares not all back:
        logged when that starts and ends)."""
        seen = run_count.advance_seen(self.run_count, total, ours)
        behind = total < seen[0]
        if behind != self._count_behind:
            self._count_behind = behind
            (self.log.warning if behind else self.log.info)(
                "learner.run_count_behind" if behind else "learner.run_count_whole", total=total, counted=seen[0])
        self.run_count = seen
