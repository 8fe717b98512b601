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
