"""`ddloco bench prepare` runs end to end on a tiny corpus and reports both rates and their ratio."""
from __future__ import annotations

import json

import pytest

from ddloco.bench.micro import main

pytestmark = pytest.mark.timeout(60)


def test_bench_prepare_reports_the_ratio_of_prepare_to_the_tokenizer(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["prepare", "--mb", "0.3", "--repeats", "2", "--vocab", "300", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["repeats"]) == 2 and result["mb"] >= 0.3
    for row in result["repeats"]:
        assert row["tokens"] > 50_000 and row["prepare_tokens_per_s"] > 0 and row["encode_batch_fast_tokens_per_s"] > 0
        best = max(row["encode_batch_fast_tokens_per_s"], row["encode_batch_tokens_per_s"])
        assert row["ratio"] == pytest.approx(row["prepare_tokens_per_s"] / best)
    assert result["ratio_min"] <= result["ratio_median"] <= result["ratio_max"]
