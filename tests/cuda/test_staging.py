"""learner/staging.py: a CUDA learner's copies between its model and the host, on side streams.

The CPU case runs the same steps with a stand-in of the staging interface (a CPU learner has no
staging: ``staging_for`` gives None), so the test's own logic runs on every machine; the CUDA
case runs ``HostStaging`` and also checks the stream ordering (busy GPU work queued first keeps
the copies pending: the host did not wait, the GPU streams did)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from learner.staging import HostStaging, staging_for
from tests.cuda.devices import DEVICES, delay

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(60)]


class _HostCopies:
    """HostStaging's interface on the CPU: copies, and an event that is always complete."""

    class _Done:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    def to_host(self, value: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return value.clone(), self._Done()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.clone()


def _staging(device: torch.device) -> Any:
    staging = staging_for(device, grouped=False)
    if device.type == "cpu":
        assert staging is None          # a CPU learner keeps its plain path
        return _HostCopies()
    assert isinstance(staging, HostStaging) and staging.up is not staging.down
    return staging


def _sizes() -> list[int]:
    """Fragment sizes: tiny, odd, a block multiple, a few MB."""
    return [1, 7, 4096, 12_345, 1 << 20, (1 << 22) + 3] * 6


def _warm(dev: torch.device, stream: Any = None) -> None:
    """Fill the caching allocators (pinned host; device, per stream) with blocks of every size
    the test uses, so that no allocation in a checked call reaches the driver (cudaHostAlloc /
    cudaMalloc): the checks are about the copies' streams, not the driver."""
    if dev.type != "cuda":
        return
    with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(dev)):
        keep = [t for n in set(_sizes()) for _ in range(8)
                for t in (torch.empty(n, pin_memory=True), torch.empty(n, device=dev))]
    torch.cuda.synchronize(dev)
    del keep


@pytest.mark.parametrize("device", DEVICES)
def test_answers_reach_the_host_exactly_after_the_work_that_made_them(device):
    """to_host: a pinned copy, complete when its event says so, of the value as the training
    stream left it (the side stream waits for the gather; it never copies before it)."""
    dev = torch.device(device)
    staging = _staging(dev)
    _warm(dev)
    g = torch.Generator().manual_seed(3)
    sent = []
    for i, n in enumerate(_sizes()):
        expected = torch.randn(n, generator=g)
        expected[0] = float("inf") if i % 3 == 0 else -0.0
        source = expected.pin_memory() if dev.type == "cuda" else expected
        value = torch.zeros(n, device=dev)
        busy = i % 12 == 0
        if busy:
            delay(dev)                          # the training stream is busy...
        value.copy_(source, non_blocking=True)  # ...and only then writes the value
        host, done = staging.to_host(value)
        if dev.type == "cuda":
            assert host.is_pinned() and host.device.type == "cpu"
            if busy:                            # returned at once: the copy waits behind the busy work
                assert not done.query()
        del value                               # freed by Python: its memory must not be reused early
        sent.append((expected, host, done))
    for expected, host, done in sent:
        done.synchronize()
        assert done.query()
        assert torch.equal(host, expected) and host.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_merges_reach_the_device_and_the_training_stream_waits_for_them_on_the_gpu(device):
    """to_device: the value on the device; the caller does not wait (the copy is still pending
    behind busy work on the side stream when it returns), yet an op queued next on the training
    stream reads the copied values, for pinned and pageable host values."""
    dev = torch.device(device)
    staging = _staging(dev)
    _warm(dev, staging.down if dev.type == "cuda" else None)
    g = torch.Generator().manual_seed(4)
    results = []
    for i, n in enumerate(_sizes()):
        host = torch.randn(n, generator=g)
        if i % 2 == 0 and dev.type == "cuda":
            host = host.pin_memory()
        busy = i % 12 == 0
        if busy:                                # the copy's stream is busy
            delay(dev, staging.down if dev.type == "cuda" else None)
        value = staging.to_device(host)
        if dev.type == "cuda":
            assert value.device.type == "cuda"
            if busy:                            # the host did not wait for the copy
                assert not staging.down.query()
        doubled = value * 2 + 1                 # on the training stream, right away
        results.append((host, doubled))
    for host, doubled in results:
        assert torch.equal(doubled.cpu(), host * 2 + 1)


@pytest.mark.parametrize("device", DEVICES)
def test_a_round_trip_through_the_host_is_exact_for_a_models_fragments(device):
    """A model's fragments gathered on its device, to the host, back, scattered into another
    copy of the model: the copy equals the model bit for bit."""
    from common.fragments import gather, model_plan, scatter, state_tensors
    dev = torch.device(device)
    staging = _staging(dev)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 33)).to(dev)
    model(torch.randn(16, 64, device=dev))     # running stats move off their initial values
    other = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 33)).to(dev)
    tensors, theirs = state_tensors(model), state_tensors(other)
    plan = model_plan(model, (), 5)
    answers = [staging.to_host(gather(tensors, f, device=dev)) for f in plan]
    for f, (host, done) in zip(plan, answers):
        done.synchronize()
        scatter(theirs, f, staging.to_device(host))
    for name, t in tensors.items():
        assert theirs[name].device.type == dev.type and torch.equal(theirs[name].cpu(), t.cpu()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_prefetched_merge_is_adopted_exactly_and_the_training_stream_need_not_wait():
    """The network thread starts a merged value's copy (``prefetch``) as soon as it is decoded;
    the training thread adopts it later: exact values, and once the copy ended, no stream wait."""
    import threading
    dev = torch.device("cuda", 0)
    staging = HostStaging(dev)
    hosts = [torch.randn(1 << 20) for _ in range(6)]
    pre: list[Any] = []
    t = threading.Thread(target=lambda: pre.extend(staging.prefetch(h) for h in hosts))   # the network thread
    t.start()
    t.join()
    for p in pre:
        p.end.synchronize()             # long ended by the time a step boundary applies it
    values = [staging.to_device(p) for p in pre]
    for h, v in zip(hosts, values):
        assert torch.equal((v * 2).cpu(), h * 2)
    torch.cuda.synchronize(dev)
    r = staging.readings()
    assert r["h2d_copies"] == 6 and r["stream_waits"] == 0 and r["h2d_ms"] > 0
    # a copy adopted while still queued behind GPU work: the training stream waits, counted
    with torch.cuda.stream(staging.ahead):
        torch.cuda._sleep(50_000_000)
    late = staging.prefetch(hosts[0])
    v = staging.to_device(late)
    assert torch.equal(v.cpu(), hosts[0])
    torch.cuda.synchronize(dev)
    assert staging.readings()["stream_waits"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_prefetch_leaves_its_source_in_ordinary_memory_and_warmed_blocks_serve_the_copies():
    """The merged value the network thread decoded stays in ordinary memory (it becomes the
    learner's base): only its copy to the device goes through a pinned block, taken from the
    blocks ``warm`` left in PyTorch's cache. Each copy's pinning time is counted."""
    dev = torch.device("cuda", 0)
    staging = HostStaging(dev)
    assert staging.warm(1 << 20, blocks=2) is None
    allocs = torch.cuda.host_memory_stats().get("num_host_alloc")
    hosts = [torch.randn(1 << 20) for _ in range(4)]
    for h in hosts:
        pre = staging.prefetch(h)
        assert not h.is_pinned() and pre.pinned.is_pinned() and pre.pinned.data_ptr() != h.data_ptr()
        assert torch.equal(staging.to_device(pre).cpu(), h)
    sent, done = staging.to_host(torch.ones(1 << 20, device=dev))
    done.synchronize()
    assert sent.is_pinned() and torch.equal(sent, torch.ones(1 << 20))
    r = staging.readings()
    assert r["pin_ms_net"] > 0 and r["h2d_copies"] == 4
    if allocs is not None:   # the warmed blocks served every copy: nothing pinned anew
        assert torch.cuda.host_memory_stats()["num_host_alloc"] == allocs
