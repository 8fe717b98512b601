"""The learner's receipt of merged fragments (ALGORITHM §6) and its answers (§4), at fixed inputs:
no sockets, no Redis, no clock (``now`` is given), no model (``local`` is a plain tensor)."""
from __future__ import annotations

import pytest
import torch

from learner.messages import FragmentArrived, RoundOpened
from learner.receipt import AHEAD_UPDATES, FETCH_PENDING_S, FETCH_RETRY_S, Receipt

pytestmark = pytest.mark.timeout(30)

NOW = 1000.0


def frag(p: int, epoch: int, version: int, value: float, *, requested: bool = False, update_base: int = -1,
         n: int = 4) -> FragmentArrived:
    return FragmentArrived(p, epoch, version, torch.full((n,), float(value)), requested, update_base)


def joined(carry: bool = True, version: int = 3, epoch: int = 1, value: float = 1.0) -> Receipt:
    """A receipt of 2 fragments joined at ``version`` of shard life ``epoch``."""
    rc = Receipt(2, carry=carry)
    for p in range(2):
        assert rc.receive(frag(p, epoch, version, value, requested=True), now=NOW, local=_no_local,
                          joining=True) is not None
    return rc


def _no_local(p: int) -> torch.Tensor:
    raise AssertionError("the local value must not be read here")


def test_the_first_value_is_adopted_with_counters_at_zero_and_not_counted_as_a_merge() -> None:
    rc = Receipt(2, carry=True)
    rc.count_step(10)
    value = rc.receive(frag(0, 1, 5, 2.0, requested=True), now=NOW, local=_no_local, joining=True)
    assert torch.equal(value, torch.full((4,), 2.0))
    assert (int(rc.base_version[0]), int(rc.base_epoch[0]), int(rc.c_steps[0]), int(rc.c_tokens[0])) == (5, 1, 0, 0)
    assert int(rc.c_steps[1]) == 1 and not rc.known(1)
    assert rc.stats.merges_applied == 0


def test_carry_keeps_the_steps_not_answered_and_their_counters() -> None:
    rc = joined(carry=True)
    rc.count_step(8)
    rc.count_step(8)
    local = torch.full((4,), 1.5)                  # base 1.0 + 0.5 of unmerged local steps
    value = rc.receive(frag(0, 1, 4, 3.0), now=NOW, local=lambda p: local)
    assert torch.equal(value, torch.full((4,), 3.5))   # Θ_new + (θ − base)
    assert (int(rc.c_steps[0]), int(rc.c_tokens[0])) == (2, 16)
    assert rc.stats.merges_applied == 1 and int(rc.base_version[0]) == 4


def test_carry_after_an_answer_keeps_only_the_steps_since_the_answer() -> None:
    rc = joined(carry=True)
    rc.count_step(8)
    rc.count_step(8)
    rc.on_open(RoundOpened(0, 1, round=7, attempt=0, version=3), NOW)
    (o,) = rc.rounds_to_answer(1)
    c = rc.contribute(o, torch.full((4,), 1.5))
    assert (c.steps, c.tokens) == (2, 16)
    rc.count_step(8)                               # one step after the answer
    value = rc.receive(frag(0, 1, 4, 3.0), now=NOW, local=lambda p: torch.full((4,), 1.75))
    assert torch.equal(value, torch.full((4,), 3.25))  # Θ_new + (θ − snapshot answered)
    assert (int(rc.c_steps[0]), int(rc.c_tokens[0])) == (1, 8)


def test_overwrite_without_carry_resets_the_counters() -> None:
    rc = joined(carry=False)
    rc.count_step(8)
    value = rc.receive(frag(0, 1, 4, 3.0), now=NOW, local=_no_local)
    assert torch.equal(value, torch.full((4,), 3.0))
    assert (int(rc.c_steps[0]), int(rc.c_tokens[0])) == (0, 0)


def test_a_version_at_or_below_ours_and_an_older_shard_life_are_ignored() -> None:
    rc = joined(version=3, epoch=2)
    assert rc.receive(frag(0, 2, 3, 9.0), now=NOW, local=_no_local) is None
    assert rc.receive(frag(0, 2, 2, 9.0), now=NOW, local=_no_local) is None
    assert rc.receive(frag(0, 1, 50, 9.0), now=NOW, local=_no_local) is None    # a life that is gone
    assert int(rc.base_version[0]) == 3 and torch.equal(rc.base_values[0], torch.full((4,), 1.0))
    assert rc.stats.merges_applied == 0


def test_a_broadcast_past_the_next_version_is_a_counted_gap_and_is_applied() -> None:
    rc = joined(carry=False, version=3)
    assert rc.receive(frag(0, 1, 6, 2.0), now=NOW, local=_no_local) is not None
    assert rc.stats.version_gaps == 1 and int(rc.base_version[0]) == 6
    assert rc.receive(frag(1, 1, 9, 2.0, requested=True), now=NOW, local=_no_local) is not None
    assert rc.stats.version_gaps == 1            # a fetched value is the repair, not a gap


def test_an_update_on_our_base_gives_base_plus_update_exactly() -> None:
    rc = joined(carry=False, version=3, value=1.25)
    value = rc.receive(frag(0, 1, 4, 0.5, update_base=3), now=NOW, local=_no_local)
    assert torch.equal(value, torch.full((4,), 1.75)) and torch.equal(rc.base_values[0], value)
    assert int(rc.base_version[0]) == 4


def test_an_update_ahead_of_our_copy_is_kept_fetches_once_and_is_replayed_after_the_full_value() -> None:
    rc = joined(carry=False, version=3)
    ahead = frag(0, 1, 6, 0.5, update_base=5)
    assert rc.receive(ahead, now=NOW, local=_no_local) is None
    assert rc.take_fetches() == [0] and rc.stats.version_gaps == 1
    assert rc.receive(frag(0, 1, 7, 0.5, update_base=6), now=NOW + 1.0, local=_no_local) is None
    assert rc.take_fetches() == []                # a fetch is on its way (FETCH_PENDING_S)
    full = rc.receive(frag(0, 1, 5, 2.0, requested=True), now=NOW + 2.0, local=_no_local)
    assert torch.equal(full, torch.full((4,), 2.0))
    nxt = rc.replay(0)
    assert nxt is ahead and rc.stats.updates_replayed == 1
    assert torch.equal(rc.receive(nxt, now=NOW + 2.0, local=_no_local), torch.full((4,), 2.5))
    nxt = rc.replay(0)
    assert nxt is not None and nxt.version == 7
    assert torch.equal(rc.receive(nxt, now=NOW + 2.0, local=_no_local), torch.full((4,), 3.0))
    assert rc.replay(0) is None and int(rc.base_version[0]) == 7
    assert rc.receive(frag(0, 1, 8, 0.5, update_base=7), now=NOW + FETCH_PENDING_S + 9, local=_no_local) is not None


def test_an_update_that_arrives_before_the_join_value_is_kept_without_a_fetch() -> None:
    rc = Receipt(1, carry=True)
    assert rc.receive(frag(0, 1, 4, 0.5, update_base=3), now=NOW, local=_no_local) is None
    assert rc.take_fetches() == [] and rc.stats.version_gaps == 0   # the join's fetch brings the value
    rc.receive(frag(0, 1, 3, 1.0, requested=True), now=NOW, local=_no_local, joining=True)
    nxt = rc.replay(0)
    assert nxt is not None and torch.equal(rc.receive(nxt, now=NOW, local=lambda p: torch.full((4,), 1.0)),
                                           torch.full((4,), 1.5))


def test_updates_kept_ahead_are_bounded_and_older_ones_are_dropped_on_replay() -> None:
    rc = joined(carry=False, version=3)
    for v in range(10, 10 + AHEAD_UPDATES + 4):
        rc.receive(frag(0, 1, v + 1, 0.1, update_base=v), now=NOW, local=_no_local)
    assert len(rc.ahead[0]) == AHEAD_UPDATES
    assert min(rc.ahead[0]) == (1, 10 + 4)         # the oldest went first
    rc.receive(frag(0, 1, 25, 1.0, requested=True), now=NOW, local=_no_local)
    nxt = rc.replay(0)
    assert nxt is not None and nxt.update_base == 25
    assert sorted(k[1] for k in rc.ahead[0]) == list(range(26, 30))


def test_a_restarted_shard_below_our_version_moves_us_back_counted_without_carry() -> None:
    rc = joined(carry=True, version=9, epoch=1)
    rc.count_step(8)
    value = rc.receive(frag(0, 2, 7, 4.0, requested=True), now=NOW, local=_no_local)
    assert torch.equal(value, torch.full((4,), 4.0)) and rc.stats.versions_regressed == 1
    assert (int(rc.base_epoch[0]), int(rc.base_version[0]), int(rc.c_steps[0])) == (2, 7, 0)


def test_a_restarted_shard_at_our_version_continues_and_forgets_what_we_answered() -> None:
    rc = joined(carry=True, version=5, epoch=1)
    rc.count_step(8)
    rc.on_open(RoundOpened(0, 1, round=2, attempt=0, version=5), NOW)
    (o,) = rc.rounds_to_answer(1)
    rc.contribute(o, torch.full((4,), 1.5))        # answered, but the shard died before merging it
    value = rc.receive(frag(0, 2, 5, 1.0, requested=True), now=NOW, local=lambda p: torch.full((4,), 1.5))
    assert torch.equal(value, torch.full((4,), 1.5))    # carried against the old base: the steps are kept
    assert (int(rc.c_steps[0]), rc.stats.versions_regressed) == (1, 0)


def test_an_open_round_on_a_newer_version_fetches_and_is_not_answered_against_the_stale_base() -> None:
    rc = joined(version=3)
    rc.count_step(8)
    rc.on_open(RoundOpened(0, 1, round=4, attempt=0, version=5), NOW)
    assert rc.take_fetches() == [0] and rc.stats.fetches == 1
    assert rc.rounds_to_answer(1) == []
    rc.on_open(RoundOpened(0, 1, round=4, attempt=1, version=5), NOW + FETCH_RETRY_S / 2)
    assert rc.take_fetches() == []                 # asked FETCH_RETRY_S ago at most: not again
    rc.on_open(RoundOpened(0, 1, round=4, attempt=2, version=5), NOW + FETCH_RETRY_S)
    assert rc.take_fetches() == [0] and rc.stats.fetches == 2
    rc.receive(frag(0, 1, 5, 2.0, requested=True), now=NOW, local=lambda p: torch.full((4,), 1.0))
    assert [o.attempt for o in rc.rounds_to_answer(1)] == [2]


def test_an_open_round_of_another_shard_life_fetches_that_lifes_value() -> None:
    rc = joined(version=3, epoch=1)
    rc.on_open(RoundOpened(1, 2, round=0, attempt=0, version=3), NOW)
    assert rc.take_fetches() == [1]


def test_a_round_merged_past_already_is_dropped_and_counted_and_a_round_is_answered_once() -> None:
    rc = joined(version=3)
    rc.count_step(8)
    rc.on_open(RoundOpened(0, 1, round=1, attempt=0, version=2), NOW)
    assert rc.rounds_to_answer(1) == [] and rc.stats.stale_opens == 1 and 0 not in rc.pending_open
    o = RoundOpened(1, 1, round=1, attempt=0, version=3)
    rc.on_open(o, NOW)
    assert rc.rounds_to_answer(2) == []            # lock-step: too few steps yet
    (got,) = rc.rounds_to_answer(1)
    rc.contribute(got, torch.zeros(4))
    rc.on_open(o, NOW)                             # the same open again (re-sent)
    assert rc.rounds_to_answer(1) == [] and 1 not in rc.pending_open


def test_only_the_available_fragments_are_answered() -> None:
    rc = joined(version=3)
    rc.count_step(8)
    for p in range(2):
        rc.on_open(RoundOpened(p, 1, round=1, attempt=0, version=3), NOW)
    assert [o.fragment for o in rc.rounds_to_answer(1, available={1: None})] == [1]
    assert sorted(rc.pending_open) == [0, 1]


def test_published_bases_are_read_only_copies() -> None:
    rc = joined(version=3)
    bases = rc.published()
    rc.receive(frag(0, 1, 4, 2.0), now=NOW, local=lambda p: torch.full((4,), 1.0))
    assert int(bases.versions[0]) == 3 and int(rc.base_version[0]) == 4
    with pytest.raises(ValueError):
        bases.versions[0] = 7


def _update_message(update: torch.Tensor, codec: str, *, epoch: int, base: int):
    from common import wire
    return wire.decode(wire.encode(kind=wire.FRAG, run="r", sender="shard0", fragment=0, values=update, codec=codec,
                                   epoch=epoch, version=base + 1, base=base))


@pytest.mark.parametrize("codec", ["int4", "int8", "fp32"])
def test_the_network_thread_resolves_an_update_on_the_published_base_bit_identically(codec):
    """A broadcast update built on the base the training thread last published is made the full
    value on the network thread (base + deq(update), as the shard computed it: the same bits as
    adding the decoded update); an update on any other base, epoch or an unknown fragment is left
    to the training thread."""
    import numpy as np
    from learner.network import NetworkThread
    from learner.receipt import Bases
    net = NetworkThread.__new__(NetworkThread)
    base, update = torch.randn(100), torch.randn(100)
    msg = _update_message(update, codec, epoch=2, base=7)
    expected = base + msg.values()
    net.bases = lambda: Bases(np.array([7, 3]), np.array([2, 2]), (base, None))
    resolved = net._resolve(msg, 7)
    assert torch.equal(resolved, expected) and resolved.data_ptr() != base.data_ptr()   # a new tensor
    assert net._resolve(msg, 6) is None                                      # built on another version
    assert net._resolve(_update_message(update, codec, epoch=3, base=7), 7) is None   # another life of the shard
    net.bases = lambda: Bases(np.array([7, 3]), np.array([2, 2]), (None, None))
    assert net._resolve(msg, 7) is None                # no value yet
    net.bases = lambda: None
    assert net._resolve(msg, 7) is None                # nothing published yet
