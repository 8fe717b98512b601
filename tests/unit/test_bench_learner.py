"""`ddloco bench learner`: what it compares and how its figures are made."""
from __future__ import annotations

import pytest
import torch

from common import quant
from ddloco.bench import learner_path

pytestmark = pytest.mark.timeout(60)


def test_the_old_and_new_paths_compute_the_same_values():
    """The bench times the old passes against the new ones for the same result (the snapshot and
    the answer's payload here; the rest: tests/unit/test_learner_sync_path.py)."""
    if quant.encode_diff(torch.zeros(64), torch.zeros(64), "int4") is None:
        pytest.skip("common._qkernels (with the learner's kernels) is not built here")
    paths = learner_path._paths(10_000)
    tensors, frag = learner_path._fragment(10_000)
    assert torch.equal(learner_path._gather_old(tensors, frag), learner_path.gather(tensors, frag))
    old, new = paths["answer"][:2]
    assert [bytes(f) for f in old()[2:]] == [bytes(f) for f in new()[2:]]


def test_every_path_has_its_ratio_to_a_memcpy_of_the_bytes_it_touches(monkeypatch: pytest.MonkeyPatch):
    if quant.encode_diff(torch.zeros(64), torch.zeros(64), "int4") is None:
        pytest.skip("common._qkernels (with the learner's kernels) is not built here")
    monkeypatch.setattr(learner_path, "tune_allocator", lambda: False)   # the test process's malloc stays as it is
    rows = learner_path.bench_learner(1 << 14, 1)
    assert [r["path"] for r in rows] == ["snapshot", "answer", "receive", "apply", "total"]
    assert rows[-1]["touched_mb"] == pytest.approx(sum(r["touched_mb"] for r in rows[:-1]), abs=0.11)
    for r in rows:
        assert r["old_ms"] > 0 and r["new_ms"] > 0
        assert r["new_vs_memcpy"] == pytest.approx(r["memcpy_ms"] / r["new_ms"])
        assert r["speedup"] == pytest.approx(r["old_ms"] / r["new_ms"])
