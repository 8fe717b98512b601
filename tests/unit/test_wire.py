"""The wire protocol: encode/decode are exact inverses; malformed input raises typed errors."""
from __future__ import annotations

import msgpack
import pytest
import torch

from common import wire


def _upd(**kw):
    args = dict(kind=wire.UPDATE, run="r1", sender="l0", fragment=3, values=torch.linspace(-1, 1, 130),
                codec="int4", round=7, attempt=1, base=5, steps=12, tokens=4096)
    args.update(kw)
    return wire.encode(**args)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
def test_round_trip_keeps_every_header_field_and_payload(codec):
    values = torch.randn(1000)
    frames = _upd(values=values, codec=codec)
    msg = wire.decode(frames, expect_run="r1")
    assert (msg.kind, msg.run, msg.sender, msg.fragment, msg.round, msg.attempt, msg.base, msg.steps,
            msg.tokens, msg.codec, msg.numel) == ("upd", "r1", "l0", 3, 7, 1, 5, 12, 4096, codec, 1000)
    tol = {"fp32": 0.0, "bf16": 0.02, "int8": 0.03, "int4": 0.5}[codec]
    assert (msg.values() - values).abs().max() <= tol


def test_topic_is_fixed_width_per_fragment_and_prefix_matches_one_fragment():
    assert wire.topic("r1", wire.FRAG, 7) == b"r1|frag.0007"
    assert not wire.topic("r1", wire.FRAG, 17).startswith(wire.topic("r1", wire.FRAG, 1))
    assert wire.topic("r1", wire.FRAG, 17).startswith(wire.topic_prefix("r1", wire.FRAG))


def test_message_without_payload_round_trips():
    msg = wire.decode(wire.encode(kind=wire.OPEN, run="r", sender="shard0", fragment=2, round=4, version=9))
    assert (msg.kind, msg.round, msg.version, msg.payload, msg.numel) == ("open", 4, 9, (), 0)


def _header(frames):
    return msgpack.unpackb(frames[1])


def _with_header(frames, **changes):
    h = _header(frames)
    h.update(changes)
    return [frames[0], msgpack.packb(h), *frames[2:]]


@pytest.mark.parametrize("mutate, error", [
    (lambda f: f[:1], wire.FrameError),
    (lambda f: [f[0], b"\xc1\xc1"], wire.HeaderError),
    (lambda f: [f[0], msgpack.packb([1, 2])], wire.HeaderError),
    (lambda f: _with_header(f, v=2), wire.ProtocolVersionError),
    (lambda f: _with_header(f, steps="12"), wire.HeaderError),
    (lambda f: _with_header(f, kind="boom"), wire.HeaderError),
    (lambda f: _with_header(f, frag=4), wire.HeaderError),          # topic no longer matches
    (lambda f: _with_header(f, crc=_header(f)["crc"] ^ 1), wire.PayloadError),
    (lambda f: f[:-1], wire.PayloadError),                            # a payload frame lost
    (lambda f: [*f[:2], bytes(f[2])[:-1], f[3]], wire.PayloadError),  # truncated frame
    (lambda f: _with_header(f, numel=131), wire.PayloadError),
    (lambda f: _with_header(f, codec="int3"), wire.PayloadError),
    (lambda f: _with_header(f, run="other"), wire.WrongRunError),
    (lambda f: _with_header(f, t="x"), wire.HeaderError),
    (lambda f: _with_header(f, t=None), wire.HeaderError),
    (lambda f: _with_header(f, t=float("nan")), wire.HeaderError),
    (lambda f: _with_header(f, sizes=["1"]), wire.PayloadError),
    (lambda f: _with_header(f, epoch=1.5), wire.HeaderError),
])
def test_malformed_messages_raise_typed_errors(mutate, error):
    frames = [bytes(memoryview(x)) for x in _upd()]
    with pytest.raises(error):
        wire.decode(mutate(frames), expect_run="r1")


def test_unknown_kind_cannot_be_encoded():
    with pytest.raises(ValueError):
        wire.encode(kind="nope", run="r", sender="s", fragment=0)


def test_an_answer_sent_after_the_last_step_says_so_and_nothing_else_may():
    """``fin`` (optional: a peer that never sets it speaks the same protocol): an answer's flag that
    its sender has taken its last step; not a boolean, or on another kind, is malformed."""
    delta = torch.zeros(64)
    plain = wire.decode(wire.encode(kind=wire.UPDATE, run="r", sender="l", fragment=1, values=delta, steps=3))
    assert plain.final is False
    final = wire.decode(wire.encode(kind=wire.UPDATE, run="r", sender="l", fragment=1, values=delta, steps=3,
                                    final=True))
    assert final.final is True and final.steps == 3
    for kind, value in ((wire.UPDATE, 1), (wire.UPDATE, "yes"), (wire.FRAG, True)):
        frames = wire.encode(kind=kind, run="r", sender="l", fragment=1, values=delta)
        header = msgpack.unpackb(frames[1], raw=False)
        header["fin"] = value
        with pytest.raises(wire.HeaderError):
            wire.decode([frames[0], msgpack.packb(header, use_bin_type=True), *frames[2:]])
