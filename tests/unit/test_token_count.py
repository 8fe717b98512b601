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
