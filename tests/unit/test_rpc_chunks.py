"""Assembling a fragment that a shard sent in chunks (common/rpc.py)."""
from __future__ import annotations

import random

import pytest
import torch
import zmq

from common import wire
from common.rpc import FragmentClient


def _chunks(value: torch.Tensor, chunk: int, *, version: int = 3, epoch: int = 1, fragment: int = 0):
    n = value.numel()
    return [wire.decode(wire.encode(kind=wire.FRAG, run="r", sender="shard0", fragment=fragment, epoch=epoch,
                                    version=version, values=value[off:off + chunk], codec="fp32", offset=off, of=n))
            for off in range(0, n, chunk)]


@pytest.fixture
def client():
    ctx = zmq.Context()
    c = FragmentClient(ctx, run_id="r", sender="me")
    yield c
    c.close()
    ctx.term()


def test_chunks_in_any_order_with_duplicates_assemble_to_the_exact_value(client):
    value = torch.randn(1000)
    parts = _chunks(value, 64)
    assert len(parts) == 16 and all(m.is_chunk for m in parts)
    shuffled = parts + parts[:5]
    random.Random(0).shuffle(shuffled)
    done = [m for m in (client._assemble(m) for m in shuffled) if m is not None]
    assert len(done) == 1
    whole = done[0]
    assert not whole.is_chunk and whole.numel == 1000 and whole.version == 3 and whole.epoch == 1
    assert torch.equal(whole.values(), value)


def test_an_assembled_value_is_not_decoded_a_second_time(client, monkeypatch):
    value = torch.randn(500)
    done = [m for m in (client._assemble(m) for m in _chunks(value, 128)) if m is not None]
    assert len(done) == 1

    def no_second_decode(*args, **kwargs):
        raise AssertionError("the assembled value was decoded again")
    monkeypatch.setattr(wire._quant(), "decode", no_second_decode)
    got = done[0].values()
    assert torch.equal(got, value) and got is done[0].values()
    assert done[0].payload_nbytes == 4 * 500                  # still counted as the fp32 bytes


def test_a_lost_chunk_is_filled_in_by_a_resend_without_starting_over(client):
    value = torch.randn(300)
    parts = _chunks(value, 100)
    assert client._assemble(parts[0]) is None and client._assemble(parts[2]) is None   # parts[1] lost
    again = _chunks(value, 100)                                                     # the re-ask's reply
    assert client._assemble(again[1]) is not None
    assert client.chunks == 3


def test_a_newer_version_replaces_an_unfinished_older_one_and_old_chunks_are_ignored(client):
    old, new = torch.randn(200), torch.randn(200)
    a, b = _chunks(old, 100, version=3), _chunks(new, 100, version=4)
    assert client._assemble(a[0]) is None
    assert client._assemble(b[0]) is None
    assert client._assemble(a[1]) is None              # version 3 is gone: its last chunk finishes nothing
    whole = client._assemble(b[1])
    assert whole is not None and whole.version == 4 and torch.equal(whole.values(), new)


def test_a_chunk_that_does_not_fit_its_value_is_malformed():
    frames = wire.encode(kind=wire.FRAG, run="r", sender="s", fragment=0, values=torch.zeros(10), codec="fp32",
                         offset=95, of=100)
    with pytest.raises(wire.HeaderError):
        wire.decode(frames)


def test_chunks_that_overlap_or_announce_another_size_are_malformed_not_assembled():
    value = torch.randn(200)
    ctx = zmq.Context()
    c = FragmentClient(ctx, run_id="r", sender="me", numels=[200])
    try:
        wrong = wire.decode(wire.encode(kind=wire.FRAG, run="r", sender="s", fragment=0, version=3,
                                        values=value[:100], codec="fp32", offset=0, of=10**12))
        assert c._assemble(wrong) is None and c.malformed == 1          # never allocated
        parts = _chunks(value, 100)
        overlap = wire.decode(wire.encode(kind=wire.FRAG, run="r", sender="s", fragment=0, epoch=1, version=3,
                                          values=value[50:150], codec="fp32", offset=50, of=200))
        assert c._assemble(parts[0]) is None and c._assemble(overlap) is None   # 100 + 100 values, a hole at 150-200
        assert c.malformed == 2
        assert c._assemble(parts[0]) is None
        assert torch.equal(c._assemble(parts[1]).values(), value)       # the proper chunks still assemble
    finally:
        c.close()
        ctx.term()
