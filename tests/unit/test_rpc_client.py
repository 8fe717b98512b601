"""FragmentClient against what shards advertise in Redis (which may be wrong)."""
import zmq

from common.rpc import FragmentClient


def test_an_endpoint_that_is_not_one_is_recorded_not_raised_and_not_retried_until_it_changes():
    ctx = zmq.Context()
    try:
        client = FragmentClient(ctx, run_id="r", sender="t")
        bad = {0: "tcp://${DDLOCO_ADVERTISE_HOST:-syncer-0}:7000", 1: "tcp://127.0.0.1:5999"}
        client.set_endpoints(2, bad)               # an unexpanded compose variable, as seen for real
        assert set(client.sockets) == {1}
        assert client.bad_endpoints[0][0] == bad[0] and client.bad_endpoints[0][1]
        assert not client.differs(2, bad)          # nothing to do until the shard advertises again
        good = {**bad, 0: "tcp://127.0.0.1:5998"}
        assert client.differs(2, good)
        client.set_endpoints(2, good)
        assert set(client.sockets) == {0, 1} and client.bad_endpoints == {}
        for s in client.sockets.values():
            s.close(linger=0)
    finally:
        ctx.term()


def test_a_shard_entry_whose_key_is_not_listed_is_recorded_and_the_other_shards_still_served(tmp_path):
    """A member's fake `shard:<k>` entry, or a shard whose key was never listed here: the client
    skips that shard (before: SecurityError, which ended every learner's network thread)."""
    from common import entries
    from common.security import Security, create_keys
    create_keys(str(tmp_path), shards=1, learners=["l0"], broker=False, monitors=())
    ctx = zmq.Context()
    client = FragmentClient(ctx, run_id="r", sender="l0", security=Security(str(tmp_path), "l0"))
    try:
        before = entries.BAD_ENTRIES.snapshot().get("shard.unusable_endpoint", 0)
        client.set_endpoints(2, {0: "tcp://127.0.0.1:5998", 1: "tcp://127.0.0.1:5997"})
        assert set(client.sockets) == {0} and "shard1" in client.bad_endpoints[1][1]
        assert entries.BAD_ENTRIES.snapshot()["shard.unusable_endpoint"] == before + 1
    finally:
        ctx.destroy(linger=0)
