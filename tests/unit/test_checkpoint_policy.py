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
