"""Copies between a CUDA learner's model and the host, off its training stream (issue 7).

On a GPU the training thread must not wait for the PCIe: an answered snapshot is gathered on the
device (device-to-device copies), then copied into pinned host memory on a side stream, with an
event the network thread queries (never waits on) before it computes the delta and quantizes. A
merged value goes the other way: the network thread copies it into pinned memory as soon as it is
decoded and starts its copy to the device on a third stream (``prefetch``); the training thread
adopts the device value, its stream waiting for that copy on the GPU, not on the host (a value
that was not prefetched is copied on a second side stream, ``to_device``). The snapshot the
learner keeps to carry its uncontributed steps (ALGORITHM §6) stays on the device, so applying a
merge reads nothing back; it costs GPU memory, up to one fp32 copy of the fragments answered and
not merged yet. Pinned memory comes from
PyTorch's caching host allocator, which keeps it for reuse: a few blocks of the largest fragment,
taken at join (``warm``), serve the copies of fragments of its size class; the learner's bases stay
in ordinary memory (a merge on a round the learner did not answer pins its base on the training
thread, ``to_device``: counted in ``pin_ms``).

On a CPU learner there is nothing to stage: ``staging_for`` returns None and the learner keeps
its plain path (host tensors throughout). A torchrun group keeps the plain path too (its ranks
exchange host values over the group's collectives).

Ownership: a ``HostStaging`` belongs to the training thread (it alone calls ``to_host`` and
``to_device``); the network thread only queries the event ``to_host`` returned with an answer.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

WARM_BLOCKS = 4
"""Pinned blocks of the largest fragment taken at join (``HostStaging.warm``): answers copied to
the host and merged values on their way to the device, at most a few of each in flight."""
WARM_MAX_BYTES = 1 << 30
"""At most this much pinned memory is taken at join (a model of a few large fragments gets fewer
blocks: its copies pin the rest as they go)."""

PENDING_MAX = 4096
"""Copies whose timing events are still waiting to be read: beyond this many, the oldest are
dropped uncounted (a device that never completes work would otherwise grow the list)."""


@dataclass(frozen=True)
class Prefetched:
    """A merged value on its way to the device: the copy was queued by the network thread on
    the staging's ``ahead`` stream between ``start`` and ``end``; ``pinned`` is its host source."""

    value: torch.Tensor
    start: Any
    end: Any
    pinned: torch.Tensor


class HostStaging:
    """Device↔host copies of fragment values for one CUDA device, on a side stream."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"host staging is for a CUDA device, got {device}")
        self.device = device
        self.up = torch.cuda.Stream(device)      # device -> host (answers)
        self.down = torch.cuda.Stream(device)    # host -> device (merges), not queued behind answers
        self.ahead = torch.cuda.Stream(device)   # host -> device, queued by the network thread (prefetch)
        self._init_counters()

    def _init_counters(self) -> None:
        """What the copies cost, read from CUDA events once they completed (never waited on):
        GPU milliseconds of each direction, and how often and how long the training stream
        reached a merged value before its copy had ended (it then waits on the GPU)."""
        self.d2h_copies = self.h2d_copies = self.stream_waits = 0
        self.d2h_ms = self.h2d_ms = self.stream_wait_ms = 0.0
        self.pin_ms = self.pin_ms_net = 0.0   # wall ms taking pinned memory: training thread, network thread
        self._pending: deque[tuple[str, Any, Any, Any]] = deque()

    def to_host(self, value: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(a pinned host copy of the device tensor ``value``, the event after which it is
        complete). ``value`` must not be written until then (the learner never writes a snapshot)."""
        started = time.perf_counter()
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        self.pin_ms += (time.perf_counter() - started) * 1e3
        self.up.wait_stream(torch.cuda.current_stream(self.device))   # after the gather
        with torch.cuda.stream(self.up):
            start = _timed_event(self.up)
            host.copy_(value, non_blocking=True)
            done = torch.cuda.Event(blocking=True, enable_timing=True)   # a waiter sleeps instead of spinning
            done.record(self.up)
        value.record_stream(self.up)           # its memory is not reused before the copy ends
        self._track("d2h", start, done, None)
        return host, done

    def prefetch(self, host: torch.Tensor) -> Prefetched:
        """Network thread: start copying the merged value ``host`` to the device as soon as it is
        decoded, so that it is there when the training thread applies it (``to_device``): the
        host copy into pinned memory and the transfer cost the training thread nothing, and its
        stream finds the copy ended. Touches none of the training thread's state."""
        started = time.perf_counter()
        pinned = host if host.is_pinned() else self.pinned_like(host)
        self.pin_ms_net += (time.perf_counter() - started) * 1e3
        if pinned is not host:
            pinned.copy_(host)
        with torch.cuda.device(self.device), torch.cuda.stream(self.ahead):
            start = _timed_event(self.ahead)
            value = pinned.to(self.device, non_blocking=True)
            end = _timed_event(self.ahead)
        return Prefetched(value, start, end, pinned)

    @staticmethod
    def pinned_like(t: torch.Tensor) -> torch.Tensor:
        """Pinned host memory of ``t``'s shape (a merged value's source for its copy to the device;
        released once the training thread adopted it, so a few blocks serve every copy)."""
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    def warm(self, numel: int, *, blocks: int = WARM_BLOCKS) -> str | None:
        """Take pinned blocks of ``numel`` float32 values (the largest fragment) and give them back:
        PyTorch's caching host allocator keeps them, so the copies of answers and merges (fragments
        of one power-of-two size class: balanced fragments, as a rule) reuse them instead of
        pinning new memory at a step boundary (tens of ms of the training thread's CPU for a
        fragment of 10^8 bytes: the pages are zeroed and locked). At most ``WARM_BLOCKS``, no more
        than ``blocks`` (the fragments), and ``WARM_MAX_BYTES`` in all (the allocator rounds a
        block up to a power of two). Returns None, or why pinning failed (the copies then pin as
        they go)."""
        size = 1 << max(0, (4 * numel - 1).bit_length())
        count = min(WARM_BLOCKS, blocks, WARM_MAX_BYTES // size)
        if numel <= 0 or count <= 0:
            return None
        try:
            taken = [torch.empty(numel, dtype=torch.float32, pin_memory=True) for _ in range(count)]
        except RuntimeError as e:
            return str(e)
        del taken
        return None

    def to_device(self, host: torch.Tensor | Prefetched) -> torch.Tensor:
        """``host`` on the device; the training stream waits for the copy on the GPU (the calling
        thread does not). A ``Prefetched`` value is adopted: the stream waits for its copy's end
        (ended long ago, as a rule: counted in ``stream_waits`` when not)."""
        if isinstance(host, Prefetched):
            current = torch.cuda.current_stream(self.device)
            reached = _timed_event(current)
            current.wait_event(host.end)
            host.value.record_stream(current)  # allocated on the ahead stream, used on the training one
            self._track("h2d", host.start, host.end, reached)
            return host.value
        started = time.perf_counter()   # a merge on a round this learner did not answer: its base
        pinned = host if host.is_pinned() else host.pin_memory()
        self.pin_ms += (time.perf_counter() - started) * 1e3
        with torch.cuda.stream(self.down):
            start = _timed_event(self.down)
            value = pinned.to(self.device, non_blocking=True)
            end = _timed_event(self.down)
        current = torch.cuda.current_stream(self.device)
        reached = _timed_event(current)        # when the training stream gets here, on the GPU
        current.wait_stream(self.down)
        value.record_stream(current)           # allocated on the side stream, used on the training one
        self._track("h2d", start, end, reached)
        return value

    def _track(self, kind: str, start: Any, end: Any, reached: Any) -> None:
        self._pending.append((kind, start, end, reached))
        if len(self._pending) > PENDING_MAX:
            self._pending.popleft()
        self.poll()

    def poll(self) -> None:
        """Count the copies whose events completed (``query``: never waits), oldest first."""
        while self._pending:
            kind, start, end, reached = self._pending[0]
            if not end.query() or (reached is not None and not reached.query()):
                return
            self._pending.popleft()
            ms = start.elapsed_time(end)
            if kind == "d2h":
                self.d2h_copies, self.d2h_ms = self.d2h_copies + 1, self.d2h_ms + ms
                continue
            self.h2d_copies, self.h2d_ms = self.h2d_copies + 1, self.h2d_ms + ms
            waited = reached.elapsed_time(end)     # > 0: the copy ended after the stream got there
            if waited > 0:
                self.stream_waits, self.stream_wait_ms = self.stream_waits + 1, self.stream_wait_ms + waited

    def readings(self) -> dict[str, float]:
        """The counters above, and the device's peak allocated memory (MiB), for the learner's stats."""
        self.poll()
        return {"d2h_copies": self.d2h_copies, "d2h_ms": round(self.d2h_ms, 3), "h2d_copies": self.h2d_copies,
                "h2d_ms": round(self.h2d_ms, 3), "stream_waits": self.stream_waits,
                "stream_wait_ms": round(self.stream_wait_ms, 3), "pin_ms": round(self.pin_ms, 3),
                "pin_ms_net": round(self.pin_ms_net, 3),
                "gpu_peak_mb": round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)}


def _timed_event(stream: Any) -> Any:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


def staging_for(device: torch.device, *, grouped: bool) -> HostStaging | None:
    """The learner's staging: on a CUDA device outside a torchrun group, else None (plain path)."""
    if device.type != "cuda" or grouped:
        return None
    return HostStaging(device)
