"""When a shard writes a checkpoint (a pure decision at fixed inputs), and what the file holds."""
from __future__ import annotations

import zipfile

import torch

from common.files import atomic_path
from syncer.checkpoints import checkpoint_due, save_state


def test_a_write_starts_one_version_before_the_recovery_bound_of_a_fragment_or_after_the_interval() -> None:
    """Counted per fragment (a restarted shard takes a lone learner's copy up to its checkpoint's
    version + every_merges): twelve fragments merging in turn write once per 19 versions of one,
    not every 20 merges of the shard; the write starts at 19 so that one more merge of that
    fragment before it lands stays within the bound. A slow run still writes after the interval."""
    kw = dict(every_merges=20, interval_s=300.0)
    assert checkpoint_due(advanced=18, merges_since=12 * 18, since_last_s=299.0, **kw) is None
    assert checkpoint_due(advanced=19, merges_since=19, since_last_s=1.0, **kw) == "versions"
    assert checkpoint_due(advanced=25, merges_since=25, since_last_s=1.0, **kw) == "versions"   # a write failed
    assert checkpoint_due(advanced=1, merges_since=1, since_last_s=300.0, **kw) == "interval"
    assert checkpoint_due(advanced=0, merges_since=0, since_last_s=1e6, **kw) is None


def test_with_a_bound_of_one_or_two_versions_every_merge_or_every_other_one_writes() -> None:
    kw = dict(merges_since=1, since_last_s=0.0, interval_s=300.0)
    assert checkpoint_due(advanced=1, every_merges=1, **kw) == "versions"
    assert checkpoint_due(advanced=1, every_merges=2, **kw) == "versions"
    assert checkpoint_due(advanced=1, every_merges=3, **kw) is None
    assert checkpoint_due(advanced=2, every_merges=3, **kw) == "versions"


def test_a_checkpoint_file_has_no_crc32_records_and_loads_as_written(tmp_path) -> None:
    """The zip records carry no CRC32 (torch.load checks none: computing them was most of the
    writer's CPU); the file is still written atomically and loads with ``weights_only``, shared
    and expanded storages included."""
    theta = torch.randn(1000)
    state = {"fragments": {3: {"theta": theta, "momentum": torch.zeros(1).expand(1000), "version": 7}},
             "format": 2, "reason": "versions"}
    path = tmp_path / "run-shard0of1.pt"
    with atomic_path(path, durable=True) as tmp:
        save_state(state, tmp)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]       # no temporary file left
    records = zipfile.ZipFile(path).infolist()
    assert records and all(r.CRC == 0 for r in records), [(r.filename, r.CRC) for r in records]
    loaded = torch.load(path, weights_only=True)
    fs = loaded["fragments"][3]
    assert torch.equal(fs["theta"], theta) and fs["version"] == 7 and loaded["reason"] == "versions"
    assert fs["momentum"].shape == (1000,) and fs["momentum"].untyped_storage().nbytes() == 4
    assert torch.serialization.get_crc32_options()    # the setting was the writer's, for that write only


def test_one_learners_copy_is_bounded_by_the_journal_where_there_is_one_else_by_the_checkpoint() -> None:
    from syncer.checkpoints import JOURNAL_SLACK, lone_limit
    assert lone_limit(recorded=0, checkpoint=40, journal=None, every_merges=20) == 60        # no journal: as before
    assert lone_limit(recorded=0, checkpoint=40, journal=95, every_merges=20) == 95 + JOURNAL_SLACK
    assert lone_limit(recorded=0, checkpoint=40, journal=30, every_merges=20) == 40 + JOURNAL_SLACK  # an older journal
    assert lone_limit(recorded=200, checkpoint=40, journal=95, every_merges=20) == 200       # Redis kept the record
    assert lone_limit(recorded=100, checkpoint=40, journal=95, every_merges=20) == 95 + JOURNAL_SLACK  # a lagging record


class _Shard:
    """What ``Checkpointing``'s journal steps read of a shard."""

    def __init__(self, tmp_path) -> None:
        from types import SimpleNamespace

        from common.config import RunConfig
        self.options = SimpleNamespace(checkpoint_dir=str(tmp_path), shard=1, shards=2)
        self.endpoints = SimpleNamespace(run_id="r")
        self.run, self.plan_digest, self.epoch = RunConfig(), "plan", 3
        self.frags = {1: SimpleNamespace(version=0), 3: SimpleNamespace(version=0)}
        self._lease_lost = False
        self.warnings: list[str] = []
        self.log = SimpleNamespace(warning=lambda event, **kw: self.warnings.append(kw["error"]),
                                   error=lambda event, **kw: self.warnings.append(kw["error"]))


def test_the_journal_is_written_every_few_versions_and_read_back_and_a_bad_one_is_ignored(tmp_path) -> None:
    import json

    from syncer.checkpoints import JOURNAL_EVERY, Checkpointing, LatestWriter

    class Shard(_Shard, Checkpointing):
        pass
    shard = Shard(tmp_path)
    shard._journal_versions, written = {}, []
    shard._journal_writer = LatestWriter(lambda e: (shard._write_journal(e), written.append(e)), name="j")
    assert shard._read_journal() is None                                   # none yet
    for v in range(1, JOURNAL_EVERY + 2):
        shard.frags[1].version = v
        shard._journal_after_merge(1, v)
    shard._journal_writer.close()
    assert [e["versions"] for e in written] == [{"1": JOURNAL_EVERY, "3": 0}]   # once, at JOURNAL_EVERY
    assert shard.journal_path.name == "r-shard1of2.versions.json"
    assert shard._read_journal() == {1: JOURNAL_EVERY, 3: 0}
    good = json.loads(shard.journal_path.read_text())
    bads = ["{not json", json.dumps([good]), "[" * 100_000 + "]" * 100_000,
            *(json.dumps({**good, k: v}) for k, v in (("plan_digest", "other"), ("run_digest", "other"), ("shard", 0),
                                                     ("shards", 3), ("format", 2), ("versions", {"2": 5}),
                                                     ("versions", {"1": -1}), ("versions", {"1": 2.5}),
                                                     ("versions", {"1": "7"}), ("versions", [1])))]
    for bad in bads:
        shard.journal_path.write_text(bad)
        assert shard._read_journal() is None, bad[:80]
    assert len(shard.warnings) == len(bads)


def test_a_recovering_fragment_keeps_its_journal_version_while_another_one_moves_on(tmp_path) -> None:
    """After a restart a fragment still waiting for the learners' copies is at its checkpoint's
    version, below the journal's: a journal written meanwhile (another fragment merged) keeps the
    journal's version for it, never the older one."""
    from syncer.checkpoints import JOURNAL_EVERY, Checkpointing, LatestWriter

    class Shard(_Shard, Checkpointing):
        pass
    shard = Shard(tmp_path)
    shard._journal_writer = LatestWriter(shard._write_journal, name="j")
    shard._journal_versions = {1: 100, 3: 100}                  # read back at the restart
    shard.frags[1].version, shard.frags[3].version = 50, 118    # 1 recovering at its checkpoint's, 3 recovered
    shard._journal_after_merge(3, 118 + JOURNAL_EVERY)
    shard.frags[3].version += JOURNAL_EVERY
    shard._journal_now()
    shard._journal_writer.close()
    assert shard._read_journal() == {1: 100, 3: 118 + JOURNAL_EVERY}


def test_a_shard_starts_above_the_epoch_of_its_journal_where_its_checkpoint_is_older(tmp_path) -> None:
    """A life that crashed before its first checkpoint left its epoch in the journal (written at
    start): the next life's floor is the larger of the two; another run's journal counts nothing."""
    import json
    from types import SimpleNamespace

    from syncer.checkpoints import Checkpointing, LatestWriter

    class Shard(_Shard, Checkpointing):
        pass
    shard = Shard(tmp_path)
    shard.options.fresh = False
    shard._journal_versions, shard.epoch = {}, 9
    shard._journal_writer = LatestWriter(shard._write_journal, name="j")
    assert shard._journal_epoch() == 0
    shard._journal_now()
    shard._journal_writer.close()
    assert shard._journal_epoch() == 9
    entry = json.loads(shard.journal_path.read_text())
    shard.journal_path.write_text(json.dumps({**entry, "run_digest": "another run"}))
    assert shard._journal_epoch() == 0
    shard.journal_path.write_text(json.dumps({**entry, "epoch": "9"}))
    assert shard._journal_epoch() == 0
    shard.options = SimpleNamespace(**{**vars(shard.options), "fresh": True})
    shard.journal_path.write_text(json.dumps(entry))
    assert shard._journal_epoch() == 0                            # --fresh: as the checkpoint's epoch
