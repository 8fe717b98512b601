"""What a learner's other threads (control, ``/metrics`` scrapes) and its callers (tests, the
Python API) read of it: values the training thread publishes, frozen, replaced whole at every
step boundary and change of status (``LearnerView``, ``Bases``), with the network thread's
published counters (``NetworkReadings``).

``Published`` is a part of ``Learner`` (learner/core.py). ``_publish`` and the ``status``
setter run on the training thread; every other method here reads published values only and
may run on any thread.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any

from common import entries, metrics
from common.lifecycle import peak_rss_mb
from learner import ownership
from learner.stats import LearnerStats, LearnerSummary, LearnerView, heartbeat_fields, readings


class Published:
    """See the module docstring."""

    @property
    def status(self) -> str:
        """As last published (on the training thread: as set)."""
        return self._view.status

    @status.setter
    def status(self, value: str) -> None:
        """Training thread: a change of status is published at once."""
        self._status = value
        self._publish()

    def _publish(self) -> None:
        """Training thread: publish ``LearnerView`` and the bases (frozen copies)."""
        staging = getattr(self, "_staging", None)
        if staging is not None:      # a CUDA learner: what its copies cost (read, never waited on)
            for name, value in staging.readings().items():
                setattr(self._stats, name, value)
        self._view = LearnerView.of(self._status, ownership.unwrapped(self._stats), self.data_position)
        if self.receipt is not None:
            self._bases = self.receipt.published()

    @property
    def stats(self) -> LearnerStats:
        """The counters as last published (training and network thread): a copy."""
        net = self.net.published if self.net is not None else None
        return self._view.stats_with(net)

    @property
    def base_version(self) -> Any:
        return self._bases.versions if self._bases is not None else None

    @property
    def base_epoch(self) -> Any:
        return self._bases.epochs if self._bases is not None else None

    @property
    def base_values(self) -> Any:
        return self._bases.values if self._bases is not None else None

    def readings(self) -> list[metrics.Reading]:
        """What ``/metrics`` shows, read on the scrape's thread (from the published values)."""
        view = self._view
        return readings(self.stats, view.status, replaced=self._outbox.replaced, inbox=self._inbox.qsize(),
                        outbox=self._outbox.qsize())

    def _counters(self) -> dict[str, Any]:
        """The learner's hash in Redis (control thread, and at the end): from published values."""
        view = self._view   # one view: the tokens and the data position of the same step
        net = self.net
        stats = view.stats_with(net.published if net is not None else None)
        return {**heartbeat_fields(stats), "status": view.status, "started_at": self._process_started_at,
                "updated_at": time.time(), "incarnation": self.incarnation,
                "peer": "" if self._sharding == "fsdp" else getattr(net, "peer_endpoint", ""),
                "data_shard": self.options.data_shard, "data_stream": self.stream, "pid": os.getpid(),
                "host": socket.gethostname(), "data_position": view.data_position + view.stats.batches,
                "answers_replaced": self._outbox.replaced, "peak_rss_mb": peak_rss_mb(),
                "cpu_s": round(time.process_time(), 3), "bad_entries": entries.BAD_ENTRIES.total()}

    def _summary(self, *, versions: bool = True) -> LearnerSummary:
        return LearnerSummary(self.id, self.stats, self.receipt.versions() if versions else {})
