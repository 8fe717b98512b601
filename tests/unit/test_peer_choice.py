"""Which training peers a joining learner may ask for its state (learner/bootstrap.py), at a fixed
``now``: training, fresh, reachable from here, not itself."""
from __future__ import annotations

import pytest

from learner.bootstrap import reachable_peers

pytestmark = pytest.mark.timeout(30)

NOW = 1_000_000.0


def _h(status: str = "training", peer: str = "tcp://10.0.0.2:7000", updated_at: float = NOW, host: str = "b"):
    return {"status": status, "peer": peer, "updated_at": str(updated_at), "host": host}


def test_only_fresh_training_peers_reachable_from_here_are_asked_in_a_stable_order() -> None:
    live = {"z-remote": _h(),
            "a-remote": _h(peer="tcp://10.0.0.3:7000"),
            "me": _h(),
            "joining": _h(status="joining"),
            "frozen": _h(updated_at=NOW - 5.0),
            "no-endpoint": _h(peer=""),
            "loopback-elsewhere": _h(peer="tcp://127.0.0.1:7000", host="other"),
            "loopback-here": _h(peer="tcp://127.0.0.1:7001", host="a")}
    got = reachable_peers(live, me="me", here="a", fresh_after=NOW - 0.7)
    assert got == [("a-remote", "tcp://10.0.0.3:7000"), ("loopback-here", "tcp://127.0.0.1:7001"),
                   ("z-remote", "tcp://10.0.0.2:7000")]


def test_no_peer_when_none_is_training() -> None:
    assert reachable_peers({"x": _h(status="flushing")}, me="me", here="a", fresh_after=NOW - 1) == []
