"""common.files: the one atomic-write helper."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.files import atomic_path, write_atomic


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "state.json"
    write_atomic(p, "one")
    write_atomic(p, b"two", durable=True)
    assert p.read_text() == "two"
    assert [q.name for q in p.parent.iterdir()] == ["state.json"]


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.pt"
    write_atomic(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(p, durable=True) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert p.read_text() == "old"
    assert [q.name for q in tmp_path.iterdir()] == ["ckpt.pt"]
