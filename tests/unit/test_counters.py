"""The learner's and the shard's counters are declared once (``common.counters``): their metrics
and their fields in Redis come from that declaration, under the names, help texts, labels and
rounding they had when each was written by hand. The pinned values below were captured from the
hand-written ``learner.stats.heartbeat_fields`` / ``readings`` and ``syncer.readings.readings_of``
/ ``ControlPlane._shard_entry`` for the same filled-in counters (``_filled``)."""
from __future__ import annotations

import re
import types
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from broker.stats import BrokerStats
from common import counters, entries, metrics
from learner.stats import LearnerStats, heartbeat_fields, readings
from syncer.control_plane import ControlPlane
from syncer.readings import readings_of, snapshot_of
from syncer.state import ShardStats

pytestmark = pytest.mark.timeout(10)

OTHER_SHARD_FIELDS = ("rpc", "shards", "pid", "plan", "checkpoint", "epoch", "status", "heartbeat_at", "peak_rss_mb",
                      "cpu_s", "bad_entries")
"""The shard's hash fields that are not its counters."""


def _filled(stats):
    """Every counter of ``stats`` set to a value of its own, made from its name (not its place)."""
    for f in fields(stats):
        n = zlib.crc32(f.name.encode()) % 100000
        v = getattr(stats, f.name)
        if isinstance(v, metrics.Histogram):
            for s in (n / 70000.0, n / 7.0, 0.07):
                v.observe(s)
        elif isinstance(v, dict):
            setattr(stats, f.name, {f"{f.name}_a": n / 7.0, f"{f.name}_b": n % 97})
        elif isinstance(v, str):
            setattr(stats, f.name, f"{f.name}-{n}")
        else:
            setattr(stats, f.name, n if isinstance(v, int) else n / 7.0 + 0.5678912345)
    return stats


def _table(rs: list[metrics.Reading]) -> dict:
    """name -> (kind, help, label, value) of each metric, each name once."""
    assert len({r.name for r in rs}) == len(rs), [r.name for r in rs]
    out = {}
    for r in rs:
        v = r.value
        if isinstance(v, metrics.Histogram):
            v = v.cumulative()
        elif not isinstance(v, (int, float)):
            v = dict(v)
        if r.name.endswith("bad_entries_total"):
            assert v == entries.BAD_ENTRIES.snapshot()     # process-wide: other tests may have counted
            v = "BAD_ENTRIES"
        out[r.name] = (r.kind, r.doc, r.label, v)
    return out


LEARNER_HASH = {'answers': 59462,
                'blocked_s': 3609.139,
                'boot_phases': '{"boot_phases_a": 1049.0, "boot_phases_b": 68}',
                'boot_s': 11604.282,
                'bootstrap': 'bootstrap-54896',
                'boundary_cpu_s': 7572.996,
                'bootstraps_served': 75880,
                'bytes_down': 45711,
                'bytes_fetched': 66466,
                'bytes_up': 56525,
                'chunks_fetched': 68526,
                'cpu_s_at_joined': 2687.139,
                'd2h_copies': 73991,
                'd2h_ms': 12755.425,
                'fetches': 12534,
                'first_answer': 'first_answer-22909',
                'flush_s': 9784.568,
                'flushed': 60214,
                'gpu_peak_mb': 112.7,
                'h2d_copies': 91430,
                'h2d_ms': 5459.854,
                'io_cpu_s': 1154.854,
                'io_cpu_s_at_joined': 6597.711,
                'last_contrib_at': 420.42503409164283,
                'last_contrib_fragment': 624,
                'loss_ema': 4790.56789,
                'lr': 10286.853605520213,
                'malformed': 63029,
                'merges_applied': 37454,
                'net_cpu_s': 7958.568,
                'net_cpu_s_at_joined': 13765.282,
                'pin_ms': 1396.996,
                'pin_ms_net': 8604.568,
                'schedule_regressions': 35848,
                'schedule_tokens': 3719,
                'stale_opens': 24331,
                'step_ema_s': 6269.567891,
                'steps': 46130,
                'stream_wait_ms': 10985.854,
                'stream_waits': 7220,
                'tokens': 29454,
                'train_s': 10562.711,
                'unflushed': 78741,
                'version_gaps': 61925,
                'versions_regressed': 32998}

LEARNER_METRICS = {'learner_training_stream_waits_total': ('counter',
                                                          'CUDA learner: merged values the training stream '
                                                          'reached before their copy had ended (it waited on the '
                                                          'GPU; 0 expected).',
                                                          '',
                                                          7220),
                   'learner_gpu_peak_megabytes': ('gauge', "CUDA learner: the device's peak allocated memory (MiB).",
                                                  '', 112.71074837735713),
                   'learner_answers_replaced_total': ('counter',
                                                      'Answers not sent: a newer answer for the same fragment '
                                                      'replaced them while they waited (the network thread '
                                                      'fell behind).',
                                                      '',
                                                      3),
                   'learner_answers_total': ('counter', 'Answers sent to open rounds.', '', 59462),
                   'learner_bad_entries_total': ('counter',
                                                 'Redis entries ignored as malformed, by kind.reason '
                                                 '(common/entries.py).',
                                                 'reason',
                                                 'BAD_ENTRIES'),
                   'learner_blocked_seconds_total': ('counter',
                                                     'Seconds waiting at the lock-step barrier.',
                                                     '',
                                                     3609.1393198059286),
                   'learner_boot_seconds': ('gauge',
                                            'Process start to joined (0 before).',
                                            '',
                                            11604.282176948785),
                   'learner_bootstraps_served_total': ('counter', 'States served to joining peers.', '', 75880),
                   'learner_bytes_total': ('counter',
                                           'Bytes sent (out: answers, copies, peer state) and received (in: '
                                           'merged fragments, peer state).',
                                           'direction',
                                           {'in': 45711, 'out': 56525}),
                   'learner_fetches_total': ('counter',
                                             'Full fragments asked of the shards (join, gaps, a restarted '
                                             'shard).',
                                             '',
                                             12534),
                   'learner_last_contribution_timestamp_seconds': ('gauge',
                                                                   'Unix time of the last answer sent (0: none '
                                                                   'yet).',
                                                                   '',
                                                                   420.42503409164283),
                   'learner_learning_rate': ('gauge',
                                             'Inner learning rate of the last step.',
                                             '',
                                             10286.853605520213),
                   'learner_loss': ('gauge', 'Training loss (EMA, 0.95).', '', 4790.5678912345),
                   'learner_malformed_total': ('counter', 'Messages dropped: failed to decode.', '', 63029),
                   'learner_merges_applied_total': ('counter', 'Merged fragments applied.', '', 37454),
                   'learner_nonfinite_answers_total': ('counter',
                                                       'Answers not sent: non-finite delta.',
                                                       '',
                                                       10743),
                   'learner_queue_depth': ('gauge',
                                           'Items waiting between the threads: inbox (network to training), '
                                           'outbox (training to network).',
                                           'queue',
                                           {'inbox': 4, 'outbox': 5}),
                   'learner_schedule_regressions_total': ('counter',
                                                          'Schedule reads of a run token count below the '
                                                          'highest used before (the learning rate went back; 0 '
                                                          'expected).',
                                                          '',
                                                          35848),
                   'learner_schedule_tokens': ('gauge',
                                               'Highest run token count the learning-rate schedule used.',
                                               '',
                                               3719.5678912345),
                   'learner_stale_opens_total': ('counter',
                                                 'Open rounds skipped: already merged past them.',
                                                 '',
                                                 24331),
                   'learner_status': ('gauge',
                                      "1 for the learner's current status.",
                                      'status',
                                      {'blocked': 1.0,
                                       'flushing': 0.0,
                                       'joining': 0.0,
                                       'stopped': 0.0,
                                       'training': 0.0}),
                   'learner_step_seconds': ('gauge', 'Inner step time (EMA, 0.9).', '', 6269.5678912345),
                   'learner_steps_total': ('counter', 'Inner steps taken by this process.', '', 46130),
                   'learner_tokens_total': ('counter', 'Tokens trained on by this process.', '', 29454),
                   'learner_train_seconds_total': ('counter',
                                                   'Seconds of training work (frozen steps excluded).',
                                                   '',
                                                   10562.710748377356),
                   'learner_version_gaps_total': ('counter',
                                                  'Lost broadcasts found by their version (repaired by a '
                                                  'fetch).',
                                                  '',
                                                  61925),
                   'learner_versions_regressed_total': ('counter',
                                                        'Fragments a shard moved back below our version.',
                                                        '',
                                                        32998)}

SHARD_METRICS = {'run_global_eval_loss': ('gauge',
                                          "The global model's last eval loss, as `ddloco up` evaluated it "
                                          '(read from Redis; NaN when nothing evaluates the run).',
                                          '',
                                          1.5),
                 'shard_answers_rejected_total': ('counter',
                                                  'Answers refused (nonfinite_delta) or cut (claims, clipped) '
                                                  'by the robust merge, by reason.',
                                                  'reason',
                                                  {'rejected_a': 8553.857142857143, 'rejected_b': 28}),
                 'shard_answers_total': ('counter',
                                         'Learner answers by outcome: accepted (into its open round), late '
                                         '(the round had merged), stale_base (its base version or shard life '
                                         'is gone), wrong_run.',
                                         'outcome',
                                         {'accepted': 59462,
                                          'late': 84453,
                                          'stale_base': 26926,
                                          'wrong_run': 37506}),
                 'shard_bad_entries_total': ('counter',
                                             'Redis entries ignored as malformed, by kind.reason '
                                             '(common/entries.py).',
                                             'reason',
                                             'BAD_ENTRIES'),
                 'shard_bytes_total': ('counter',
                                       'Message bytes: in (answers, copies), out (opens, merged fragments, '
                                       'replies).',
                                       'direction',
                                       {'in': 69491, 'out': 6886}),
                 'shard_checkpoint_bytes_total': ('counter', 'Bytes of checkpoints written.', '', 61191),
                 'shard_checkpoint_cpu_seconds_total': ('counter', 'CPU seconds the checkpoint writer thread spent writing (its thread time: serialisation, checksums, copies into the page cache).', '', 9635.282176948785),
                 'shard_checkpoint_write_seconds_total': ('counter', 'Wall seconds of checkpoint writes (fsyncs included).', '', 9243.710748377356),
                 'shard_checkpoints_total': ('counter',
                                             'Checkpoints: written, failed.',
                                             'outcome',
                                             {'failed': 47892, 'written': 23511}),
                 'shard_fragment_requests_total': ('counter',
                                                   'Full-fragment requests: served, deferred (the fragment was '
                                                   'recovering), deduped (sent to that requester moments ago).',
                                                   'outcome',
                                                   {'deduped': 68350, 'deferred': 7523, 'served': 68721}),
                 'shard_fragment_version': ('gauge', 'Version of each owned fragment.', 'fragment', {}),
                 'shard_fragments_recovering': ('gauge',
                                                "Fragments still collecting live learners' copies.",
                                                '',
                                                0),
                 'shard_grace_window_seconds': ('gauge',
                                                'The adaptive grace window: how long a round waits for more '
                                                'answers past its quorum.',
                                                '',
                                                0.25),
                 'shard_live_learners': ('gauge',
                                         'Learners with a fresh heartbeat, as last read from Redis.',
                                         '',
                                         3),
                 'shard_malformed_total': ('counter',
                                           'Messages and requests that failed to decode or made no sense '
                                           '(dropped).',
                                           '',
                                           63029),
                 'shard_merge_seconds': ('histogram',
                                         'Seconds of merge computation per round (worker thread).',
                                         '',
                                         ([('0.05', 0),
                                           ('0.1', 1),
                                           ('0.25', 1),
                                           ('0.5', 1),
                                           ('1.0', 2),
                                           ('2.0', 2),
                                           ('5.0', 2),
                                           ('10.0', 2),
                                           ('20.0', 2),
                                           ('60.0', 2),
                                           ('120.0', 2),
                                           ('+Inf', 3)],
                                          9009.113671428571)),
                 'shard_merges_total': ('counter',
                                        'Rounds merged into a new fragment version (restored from the '
                                        'checkpoint at start).',
                                        '',
                                        89324),
                 'shard_reopens_total': ('counter', 'Round opens sent again (no quorum yet).', '', 92209),
                 'shard_round_seconds': ('histogram',
                                         "Seconds from a round's open to its merge.",
                                         '',
                                         ([('0.05', 0),
                                           ('0.1', 1),
                                           ('0.25', 1),
                                           ('0.5', 1),
                                           ('1.0', 2),
                                           ('2.0', 2),
                                           ('5.0', 2),
                                           ('10.0', 2),
                                           ('20.0', 2),
                                           ('60.0', 2),
                                           ('120.0', 2),
                                           ('+Inf', 3)],
                                          5655.064014285714)),
                 'shard_rounds_behind_total': ('counter',
                                               "Merges later than the schedule: the fragment's learner steps "
                                               'between merges (EMA) above 1.2 x H.',
                                               '',
                                               20964),
                 'shard_rounds_dropped_total': ('counter',
                                                'Rounds whose merge was not finite (dropped).',
                                                '',
                                                21535),
                 'shard_rounds_open': ('gauge', 'Rounds in flight.', '', 0),
                 'shard_versions_behind_total': ('counter',
                                                 "Fragments that restarted below the run's recorded version "
                                                 '(no live learner had it).',
                                                 '',
                                                 84394)}

SHARD_HASH = {'answers': 59462,
              'bytes_in': 69491,
              'bytes_out': 6886,
              'checkpoint_bytes': 61191,
              'checkpoint_cpu_s': 9635.282,
              'checkpoint_write_s': 9243.711,
              'checkpoints': 23511,
              'claims_clamped': 35321,
              'dropped': 233449,
              'late_answers': 84453,
              'malformed': 63029,
              'merge_s_sum': 9009.1137,
              'merges': 89324,
              'rejected_rejected_a': 8553.857142857143,
              'rejected_rejected_b': 28,
              'reopens': 92209,
              'replies_cached': 26506,
              'requests': 68721,
              'requests_deduped': 68350,
              'rounds_behind': 20964,
              'stale_base': 26926,
              'versions_behind': 84394,
              'weights_capped': 34619}


def test_the_learner_hash_keeps_its_fields_and_rounding():
    assert heartbeat_fields(_filled(LearnerStats())) == LEARNER_HASH


def test_the_learner_metrics_keep_their_names_help_labels_and_values():
    got = readings(_filled(LearnerStats()), "blocked", replaced=3, inbox=4, outbox=5)
    assert _table(got) == LEARNER_METRICS


def test_the_shard_metrics_keep_their_names_help_labels_and_values():
    snap = snapshot_of(_filled(ShardStats()), {}, grace_s=0.25, live_learners=3, eval_loss=1.5)
    assert _table(readings_of(snap)) == SHARD_METRICS


def test_the_shard_hash_keeps_its_fields_and_rounding():
    shard = types.SimpleNamespace(stats=_filled(ShardStats()), rpc_endpoint="tcp://x", plan_digest="d",
                                  options=types.SimpleNamespace(shards=2), checkpoint_path=None, epoch=4)
    entry = ControlPlane._shard_entry(shard)
    assert {k: v for k, v in entry.items() if k not in OTHER_SHARD_FIELDS} == SHARD_HASH
    assert entry["status"] == "running" and entry["epoch"] == 4


@pytest.mark.parametrize("stats", [LearnerStats, ShardStats, BrokerStats])
def test_every_counter_is_declared_once(stats):
    for f in fields(stats):
        assert isinstance(f.metadata.get("counter"), counters.Counter), f"{stats.__name__}.{f.name} is not declared"


def test_a_metric_of_several_fields_takes_its_help_from_the_first_and_a_label_value_from_each():
    @dataclass
    class Stats:
        sent: int = counters.declare(0, doc="Bytes: in, out.", metric="x_bytes_total", label="direction", key="out")
        got: int = counters.declare(0, doc="Bytes received.", metric="x_bytes_total", label="direction", key="in",
                                    redis="got")
        by_reason: dict = counters.declare(dict, doc="By reason.", redis="why_{}", redis_total="why")

    a, b = Stats(sent=2, got=3), Stats()
    a.by_reason["x"] = 4
    assert b.by_reason == {}, "each object counts in a dict of its own"
    (r,) = counters.readings(a)
    assert (r.name, r.kind, r.doc, r.label, r.value) == ("x_bytes_total", "counter", "Bytes: in, out.", "direction",
                                                         {"out": 2, "in": 3})
    assert counters.hash_fields(a) == {"got": 3, "why_x": 4, "why": 4}


@pytest.mark.parametrize("spec, error", [
    ({"metric": "x_steps"}, "a counter's metric ends in _total: 'x_steps'"),
    ({"metric": "x_steps", "kind": "meter"}, "counter kind 'meter': one of counter, gauge, histogram"),
    ({"metric": "x_total", "key": "in"}, "counter key 'in' without a metric and its label"),
])
def test_a_wrong_declaration_is_refused_when_it_is_made(spec, error):
    with pytest.raises(ValueError) as e:
        counters.declare(0, doc="d", **spec)
    assert str(e.value) == error


@pytest.mark.parametrize("stats", [LearnerStats, ShardStats, BrokerStats])
def test_every_declared_metric_is_listed_in_the_deploy_guide(stats):
    guide = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    missing = {c.metric for c in (f.metadata["counter"] for f in fields(stats)) if c.metric} - set(
        re.findall(r"ddloco_(\w+)", guide))
    assert not missing, f"docs/deploy.md (Metrics) does not list {sorted(missing)}"
