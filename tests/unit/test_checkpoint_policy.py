"""What a shard's checkpoint file holds."""
from __future__ import annotations

import zipfile

import torch

from common.files import atomic_path
from syncer.checkpoints import save_state


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
