"""Copies between a CUDA learner's model and the host, off its training stream (issue 7).

On a GPU the training thread must not wait for the PCIe: an answered snapshot is gathered on the
device (device-to-device copies), then copied into pinned host memory on a side stream, with an
event the network thread queries (never waits on) before it computes the delta and quantizes. A
merged value goes the other way: the training thread copies it into pinned memory (a host memcpy),
then it goes onto the device on a second side stream, and the training stream waits for that copy
on the GPU, not on the host. The snapshot the learner keeps to carry its uncontributed steps
(ALGORITHM §6) stays on the device, so applying a merge reads nothing back; it costs GPU memory,
up to one fp32 copy of the fragments answered and not merged yet. Pinned memory comes from
PyTorch's caching host allocator, which keeps it for reuse.

On a CPU learner there is nothing to stage: ``staging_for`` returns None and the learner keeps
its plain path (host tensors throughout). A torchrun group keeps the plain path too (its ranks
exchange host values over the group's collectives).

Ownership: a ``HostStaging`` belongs to the training thread (it alone calls ``to_host`` and
``to_device``); the network thread only queries the event ``to_host`` returned with an answer.
"""
from __future__ import annotations

from typing import Any

import torch


class HostStaging:
    """Device↔host copies of fragment values for one CUDA device, on a side stream."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"host staging is for a CUDA device, got {device}")
        self.device = device
        self.up = torch.cuda.Stream(device)      # device -> host (answers)
        self.down = torch.cuda.Stream(device)    # host -> device (merges), not queued behind answers

    def to_host(self, value: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(a pinned host copy of the device tensor ``value``, the event after which it is
        complete). ``value`` must not be written until then (the learner never writes a snapshot)."""
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        self.up.wait_stream(torch.cuda.current_stream(self.device))   # after the gather
        with torch.cuda.stream(self.up):
            host.copy_(value, non_blocking=True)
            done = torch.cuda.Event(blocking=True)   # a waiter sleeps instead of spinning
            done.record(self.up)
        value.record_stream(self.up)           # its memory is not reused before the copy ends
        return host, done

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device; the training stream waits for the copy on the GPU (the calling
        thread does not)."""
        pinned = host if host.is_pinned() else host.pin_memory()
        with torch.cuda.stream(self.down):
            value = pinned.to(self.device, non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.down)
        value.record_stream(current)           # allocated on the side stream, used on the training one
        return value


def staging_for(device: torch.device, *, grouped: bool) -> HostStaging | None:
    """The learner's staging: on a CUDA device outside a torchrun group, else None (plain path)."""
    if device.type != "cuda" or grouped:
        return None
    return HostStaging(device)
