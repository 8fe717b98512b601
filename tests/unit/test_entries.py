"""The parsers of Redis entries (common/entries.py): what a member could write is a value or None."""
from common import control
from common import entries


def test_counts_and_versions_are_ints_in_range_and_nothing_else():
    assert [entries.parse_int(v) for v in ("7", " 7 ", "3.0", 7)] == [7, 7, 3, 7]
    assert [entries.parse_int(v) for v in ("x", "-1", "3.5", "1e999", "nan", "", None, True, str(2**63 - 1))] == \
        [None] * 9
    assert entries.parse_number("0.25") == 0.25 and entries.parse_number("inf") is None
    assert entries.parse_shard_index("4095") == 4095 and entries.parse_shard_index("4096") is None


def test_one_stray_shard_entry_cannot_outvote_the_shards():
    table = {0: {"shards": "2"}, 1: {"shards": "2"}, 9: {"shards": "99"}}
    assert entries.shard_count_of(table) == 2
    assert entries.shard_count_of({0: {"shards": "1"}, 1: {"shards": "2"}}) == 1   # a tie: the smaller
    assert entries.shard_count_of({}) == 0
    assert entries.parse_shard_entry(3, {"rpc": "tcp://h:1", "shards": "2"}) is None     # k >= S
    assert entries.parse_shard_entry(0, {"rpc": "tcp://h:1", "shards": "2", "merges": "x"}) == {
        "rpc": "tcp://h:1", "shards": "2"}


def test_a_learner_entry_keeps_what_a_learner_writes_and_drops_the_rest():
    got = entries.parse_learner_entry("l", {"steps": "12", "tokens": "1.5", "step_ema_s": "nan", "status": "training",
                                            "host": "h" * 1000, "pid": "3.0", "updated_at": "17.5"})
    assert got == {"steps": "12", "status": "training", "pid": "3", "updated_at": "17.5"}


def test_merge_events_leases_and_broker_counts():
    assert entries.parse_merge_event({"kind": "merge", "t": "1.5", "fragment": "2", "contributors": '["a"]'})[
        "contributors"] == ["a"]
    assert entries.parse_merge_event({"kind": "merge", "t": "x", "fragment": "2"}) is None
    assert entries.parse_merge_event({"kind": "merge", "t": "1", "fragment": "2", "contributors": "{"}) is None
    assert control.lease_is_plausible("host:12:3", 3000)
    assert not control.lease_is_plausible("host:12:3", -1)              # no TTL: no shard writes that
    assert not control.lease_is_plausible("evil", 3000)
    assert not control.lease_is_plausible("host:12:3", 10**9)
    assert entries.parse_broker_entry({"auth_failures": "2", "refused": '{"wrong_role": 3, "x": "y"}'}) == {
        "auth_failures": 2, "auth_failures_by_reason": {}, "broker_refused": {"wrong_role": 3}}
    assert entries.parse_eval_entry({"loss": "abc"}) is None and entries.parse_eval_entry({}) is None
