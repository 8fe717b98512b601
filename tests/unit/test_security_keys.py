"""Key layout, the allow list and the ZAP decisions (no sockets)."""
import zmq

from common.control import redact
from common.security import AllowList, Security, SecurityError, ZapHandler, create_keys


def _raw(z85_key: bytes) -> bytes:
    return zmq.utils.z85.decode(z85_key)


def test_zap_admits_listed_keys_for_the_roles_a_socket_serves_and_sees_new_and_revoked_ones(tmp_path):
    create_keys(tmp_path, shards=1, learners=["a"])
    allow = AllowList(tmp_path).load()
    zap = ZapHandler(zmq.Context.instance(), allow)
    a, shard, mon = (Security(tmp_path, n) for n in ("a", "shard0", "monitor"))
    assert zap.decide("broker", "CURVE", [_raw(a.public)]) == (True, "learner:a", "learner")
    assert zap.decide("peer", "CURVE", [_raw(a.public)])[0]
    assert zap.decide("peer", "CURVE", [_raw(mon.public)]) == (False, "role", "monitor")   # peers: learners only
    assert zap.decide("shard", "CURVE", [_raw(shard.public)])[0]
    stranger, _ = zmq.curve_keypair()
    assert zap.decide("broker", "CURVE", [_raw(stranger)])[:2] == (False, "unknown_key")
    assert zap.decide("broker", "NULL", [])[:2] == (False, "mechanism")
    assert zap.decide("nowhere", "CURVE", [_raw(a.public)])[:2] == (False, "domain")
    assert zap.decide("broker", "CURVE", [b"short"])[:2] == (False, "credentials")
    create_keys(tmp_path, learners=["b"], broker=False, monitors=())        # added while running
    assert zap.decide("broker", "CURVE", [_raw(Security(tmp_path, "b").public)])[0]
    (tmp_path / "public" / "learner" / "a.key").unlink()                   # revoked
    assert zap.decide("broker", "CURVE", [_raw(a.public)])[:2] == (False, "unknown_key")
    reply = zap.reply([b"1.0", b"7", b"broker", b"", b"", b"CURVE", _raw(stranger)])
    assert reply[2] == b"400" and reply[3] == b"unknown_key" and zap.failures == {"unknown_key": 1}
    ok = zap.reply([b"1.0", b"8", b"broker", b"", b"", b"CURVE", _raw(shard.public)])
    assert ok[2] == b"200" and ok[4] == b"shard:shard0" and zap.admitted == 1
    assert zap.reply([b"junk"])[2] == b"500" and zap.failures == {"unknown_key": 1, "malformed": 1}


def test_a_member_without_its_secret_or_listing_is_refused_by_name(tmp_path):
    create_keys(tmp_path, learners=["a"])
    try:
        Security(tmp_path, "nobody")
        raise AssertionError("no error")
    except SecurityError as e:
        assert "no secret key for 'nobody'" in str(e)
    (tmp_path / "public" / "learner" / "a.key").unlink()
    try:
        Security(tmp_path, "a")
        raise AssertionError("no error")
    except SecurityError as e:
        assert "not in the allow list" in str(e)
    assert create_keys(tmp_path, learners=["a"]) == []          # existing pairs are kept
    try:
        create_keys(tmp_path, learners=["../x"])
        raise AssertionError("no error")
    except SecurityError as e:
        assert "member name" in str(e)


def test_passwords_never_printed():
    assert redact("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("rediss://learner:s3cret@h/0?ssl_cert_reqs=required") == "rediss://learner:***@h/0?ssl_cert_reqs=required"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
