"""Frame layouts are read in ``common.wire`` only: the broker's view of a topic and a header."""
from __future__ import annotations

import msgpack
import pytest

from common import wire

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("kind", wire.KINDS)
def test_topic_kind_and_fragment_invert_topic_for_every_kind(kind):
    for run, fragment in (("r1", 0), ("run.with.dots", 7), ("x", 123_456_789)):
        t = wire.topic(run, kind, fragment)
        assert (wire.topic_kind(t), wire.topic_fragment(t)) == (kind, fragment), t


def test_topic_parsing_of_what_a_publisher_may_invent():
    assert wire.topic_kind(b"") == "" and wire.topic_fragment(b"") is None
    assert wire.topic_kind(b"no-bar.0001") == ""                  # no run separator: no kind
    assert wire.topic_kind(b"r|fr\xffag.0001") == "fr\ufffdag"     # any bytes: decoded with replacement
    assert wire.topic_fragment(b"r|frag.") is None
    assert wire.topic_fragment(b"r|frag.x1") is None
    assert wire.topic_fragment(b"r|frag.1234567890") is None       # more than 9 digits
    assert wire.topic_fragment(b"r|frag.000000012") == 12


def test_peek_sender_reads_the_header_sender_only():
    frames = wire.encode(kind=wire.OPEN, run="r", sender="shard3", fragment=2)
    assert wire.peek_sender(frames[1]) == "shard3"
    assert wire.peek_sender(msgpack.packb([1, 2])) is None          # not a map
    assert wire.peek_sender(msgpack.packb({"v": 1})) is None        # a map without a sender
    with pytest.raises(wire.HeaderError):
        wire.peek_sender(b"\xc1")                                   # not msgpack
    with pytest.raises(wire.HeaderError):
        wire.peek_sender(msgpack.packb({"from": "a" * 2000}))       # beyond the bounds of any header
