"""The run's token count: shares merged by max, a learner's view of the count never goes back."""
from __future__ import annotations

from common.tokens import advance_seen, merge_shares


def test_merged_shares_keep_the_larger_value_of_every_share_and_count_none_twice():
    ours = {"a:1": 640, "b:1": 320, "gone:0": 64}
    theirs = {"a:1": "704", "b:1": "256", "c:1": "128"}     # as HGETALL returns them: strings
    merged = merge_shares(ours, theirs)
    assert merged == {"a:1": 704, "b:1": 320, "gone:0": 64, "c:1": 128}
    assert merge_shares(merged, merged) == merged            # idempotent
    assert ours == {"a:1": 640, "b:1": 320, "gone:0": 64}    # inputs untouched


def test_a_learner_reads_the_total_when_it_is_ahead_of_its_own_count():
    assert advance_seen((1000, 100), 1500, 164) == (1500, 164)


def test_after_redis_restarted_empty_the_learners_count_goes_on_from_what_it_had_seen():
    # seen 10_000 with 500 tokens of its own; Redis restarts empty; its share (564) is the total
    assert advance_seen((10_000, 500), 564, 564) == (10_064, 564)


def test_the_count_a_learner_estimates_never_goes_back_across_an_empty_restart():
    """The estimate ``count + own tokens since`` over a run: the total as Redis holds it (other
    learners add 64 per read), emptied at read 10, the shards' shares back at read 13."""
    seen, own, estimates = (0, 0), 0, []
    others = 0
    for read in range(20):
        own += 64
        others += 64
        total = own + others if not 10 <= read < 13 else own     # only our own share after the restart
        seen = advance_seen(seen, total, own)
        for later in (own, own + 32):                            # the training thread between two reads
            estimates.append(seen[0] + later - seen[1])
    assert estimates == sorted(estimates), estimates
    assert seen == (2 * own, own)                                # back on the total once it is whole


def test_a_claim_far_above_the_others_is_capped_at_twice_the_lower_median_of_the_learners():
    from common.tokens import accept_claims
    got = accept_claims({}, {"a:1": 1000, "b:1": 1200, "mallory:x": 10 ** 18})
    assert got == {"a:1": 1000, "b:1": 1200, "mallory:x": 2400}, got   # median of [1000, 1200, 1e18]: 1200
    two = accept_claims({}, {"a:1": 1000, "mallory:x": 10 ** 18})
    assert two == {"a:1": 1000, "mallory:x": 2000}, two                # two learners: the lower one


def test_honest_shares_are_taken_whole_and_never_lowered():
    from common.tokens import accept_claims
    shares = accept_claims({}, {"a:1": 640, "b:1": 704})
    assert shares == {"a:1": 640, "b:1": 704}
    shares = accept_claims(shares, {"a:1": 500, "b:1": 900})          # a stale claim lowers nothing
    assert shares == {"a:1": 640, "b:1": 900}
    assert accept_claims(shares, {}) == shares                        # gone processes keep their share


def test_new_incarnations_of_one_id_share_that_ids_cap():
    """A learner that restarts under new incarnations again and again still adds at most twice
    the median: the cap is on the id's total over all its processes."""
    from common.tokens import accept_claims
    shares = accept_claims({}, {"a:1": 1000, "b:1": 1000, "m:1": 10 ** 9})
    for inc in range(2, 20):
        shares = accept_claims(shares, {"a:1": 1000, "b:1": 1000, f"m:{inc}": 10 ** 9})
    assert sum(v for k, v in shares.items() if k.startswith("m:")) == 2000, shares


def test_a_share_frozen_when_its_process_is_gone_does_not_grow_with_the_others():
    from common.tokens import accept_claims
    shares = accept_claims({}, {"a:1": 100, "b:1": 100, "m:1": 10 ** 9})
    assert shares["m:1"] == 200
    for step in range(2, 50):                                         # m is gone: only a and b report
        shares = accept_claims(shares, {"a:1": 100 * step, "b:1": 100 * step})
    assert shares == {"a:1": 4900, "b:1": 4900, "m:1": 200}, shares


def test_claims_of_learner_hashes_leave_out_what_is_not_a_count():
    from common.tokens import claims_of
    hashes = {"a": {"incarnation": "1", "tokens": "64"}, "b": {"tokens": "64"},
              "c": {"incarnation": "2", "tokens": "1e30"}, "d": {"incarnation": "3", "tokens": "-5"},
              "e": {"incarnation": "4", "tokens": str(2 ** 70)}}
    assert claims_of(hashes) == {"a:1": 64}


def test_while_the_others_are_still_joining_a_huge_claim_gets_no_more_than_the_floor():
    from common.tokens import accept_claims
    got = accept_claims({}, {"a:1": 0, "b:1": 0, "m:1": 10 ** 15}, live=["a", "b", "m"], floor=512)
    assert got == {"m:1": 512}, got
    alone = accept_claims({}, {"a:1": 10 ** 6}, live=["a"], floor=512)   # a run of one learner: its count
    assert alone == {"a:1": 10 ** 6}, alone
