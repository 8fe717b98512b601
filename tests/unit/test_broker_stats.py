"""The broker's counters are declared once (``broker.stats.BrokerStats``): the metrics, the log
lines and the run's ``broker`` hash all come from that declaration, under their published names."""
from __future__ import annotations

import json
from dataclasses import fields

import pytest

from broker.stats import BrokerStats, Counter, tally
from common.entries import parse_broker_entry

pytestmark = pytest.mark.timeout(10)


def _busy() -> BrokerStats:
    st = BrokerStats()
    st.messages, st.bytes, st.subscriptions = 3, 300, 2
    tally(st.by_kind, "upd", 2)
    tally(st.by_kind, "frag")
    tally(st.bytes_by_kind, "upd", 200)
    tally(st.bytes_by_kind, "frag", 100)
    tally(st.refused, "rate_limited")
    tally(st.refused, "rate_limited")
    st.auth_failures = {"unknown_key": 2, "handshake": 1}
    return st


def test_metrics_keep_their_names_labels_and_values():
    got = {r.name: (r.kind, r.label, r.value) for r in _busy().readings()}
    assert got == {
        "broker_messages_total": ("counter", "kind", {"upd": 2, "frag": 1}),
        "broker_bytes_total": ("counter", "kind", {"upd": 200, "frag": 100}),
        "broker_subscriptions_total": ("counter", "", 2),
        "broker_refused_total": ("counter", "reason", {"rate_limited": 2}),
        "broker_auth_failures_total": ("counter", "reason", {"unknown_key": 2, "handshake": 1}),
    }


def test_a_reading_is_a_copy_the_loop_can_go_on_counting_after():
    st = _busy()
    by_kind = next(r.value for r in st.readings() if r.name == "broker_messages_total")
    tally(st.by_kind, "upd")
    assert by_kind == {"upd": 2, "frag": 1}


def test_log_lines_carry_the_same_fields_in_the_same_order():
    d = _busy().as_dict()
    assert list(d) == ["messages", "bytes", "subscriptions", "by_kind", "refused", "auth_failures"]
    assert d["by_kind"] == {"upd": 2, "frag": 1} and d["auth_failures"] == {"unknown_key": 2, "handshake": 1}


def test_the_redis_hash_fields_are_what_up_reads():
    h = _busy().redis_fields()
    assert h == {"messages": 3, "bytes": 300, "refused": json.dumps({"rate_limited": 2}),
                 "auth_failures": 3, "auth_failures_by_reason": json.dumps({"unknown_key": 2, "handshake": 1})}
    parsed = parse_broker_entry({k: str(v) for k, v in h.items()})
    assert parsed == {"auth_failures": 3, "auth_failures_by_reason": {"unknown_key": 2, "handshake": 1},
                      "broker_refused": {"rate_limited": 2}}


def test_every_counter_is_declared_and_shown_somewhere():
    for f in fields(BrokerStats):
        c = f.metadata.get("counter")
        assert isinstance(c, Counter), f"{f.name} is not declared with _counter"
        assert c.metric or c.logged or c.redis, f"{f.name} is counted but shown nowhere"
        assert not c.metric or c.metric.endswith("_total")
