"""The run's token count in a real Redis: shares only rise, the total is their sum."""
from __future__ import annotations

import pytest

from common import control, tokens
from common.keys import Keys

pytestmark = pytest.mark.timeout(30)


def test_shares_are_raised_never_lowered_and_the_total_is_their_sum(redis_server):
    r = control.connect(redis_server.url)
    keys = Keys("count")
    assert tokens.record(r, keys, {}) == 0
    assert tokens.record(r, keys, {"a:1": 640}) == 640
    assert tokens.record(r, keys, {"a:1": 640}) == 640              # idempotent
    assert tokens.record(r, keys, {"a:1": 500, "b:1": 64}) == 704   # a stale share lowers nothing
    pipe = r.pipeline(transaction=False)
    tokens.record(pipe, keys, {"a:1": 1_000_000_000_000, "c:1": 1})
    assert pipe.execute() == [1_000_000_000_065]                    # no float rounding, no exponent
    assert {k: int(v) for k, v in r.hgetall(keys.token_shares).items()} == {
        "a:1": 1_000_000_000_000, "b:1": 64, "c:1": 1}
    assert int(r.get(keys.tokens)) == 1_000_000_000_065


def test_after_an_empty_restart_the_shares_written_back_restore_the_total_exactly(redis_server):
    """A learner writes its share first (tokens trained since the restart in it), a shard then
    writes back what it remembered (older values of the same shares, a finished learner's)."""
    keys = Keys("count")
    r = control.connect(redis_server.url)
    tokens.record(r, keys, {"a:1": 640, "b:1": 320, "done:0": 128})
    remembered = tokens.merge_shares({}, r.hgetall(keys.token_shares))
    tokens.record(r, keys, {"a:1": 704, "b:1": 384})                  # trained on before the restart
    redis_server.restart_empty()
    r = control.connect(redis_server.url)
    assert tokens.record(r, keys, {"a:1": 768}) == 768                # a's heartbeat comes first
    assert tokens.record(r, keys, remembered) == 768 + 320 + 128      # the shard: b's old share, done's
    assert tokens.record(r, keys, {"b:1": 448}) == 768 + 448 + 128    # b's heartbeat
