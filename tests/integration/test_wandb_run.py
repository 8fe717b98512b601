"""`ddloco up --wandb PROJECT` with WANDB_MODE=offline (no network): the offline run's own
transaction log (run-*.wandb, read with wandb's protobuf records) holds the report's eval curve
point for point against tokens, the progress figures as the run went, and the report's summary."""
from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
_BLOCK, _HEADER = 32 * 1024, 7
"""The .wandb file: a 7-byte ":W&B" header, then LevelDB-log blocks of records (crc32, length, type)."""


def wandb_records(path: Path) -> list[Any]:
    """Every record of an offline run's .wandb file, as wandb's own protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, chunk, records = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:   # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if kind == 0 and length == 0:   # zero padding up to the block's end
            pos += left - _HEADER
            continue
        chunk += data[pos:pos + length]
        pos += length
        if kind in (1, 4):   # FULL, or LAST of FIRST/MIDDLE.../LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def _items(items: Any) -> dict[str, Any]:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def test_up_logs_eval_curve_and_progress_to_an_offline_wandb_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
           "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data"),
           "WANDB_NAME": "digits-offline", "WANDB_SILENT": "true"}
    # with --tensorboard too where it is installed (`make test` installs it): both get every evaluation
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    proc = subprocess.run([sys.executable, "-m", "ddloco", "up", "--task", "digits", "--learners", "2",
                           "--syncers", "1", "--fragments", "2", "--steps", "300", "--step-time-floor-ms", "20",
                           "--minutes", "1.5", "--eval-every-s", "2",
                           "--wandb", "test", "--report", str(tmp_path / "report"),
                           *(["--tensorboard", str(tmp_path / "tb")] if tensorboard else [])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "wandb      eval/loss" in proc.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    log, = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(log)
    kinds = [r.WhichOneof("record_type") for r in records]
    run = records[kinds.index("run")].run
    assert (run.project, run.display_name) == ("test", "digits-offline")   # WANDB_NAME names it
    rows = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]

    evals = [(row["tokens"], row["eval/loss"]) for row in rows if "eval/loss" in row]
    curve = [(e["tokens"], e["loss"]) for e in report["eval_curve"]]
    assert len(curve) >= 3, curve   # the initial, at least one periodic and the final evaluation
    # every evaluation is logged when it happens; the report's curve keeps the shards' checkpointed
    # final model in place of the live final evaluation when merges landed after it
    assert evals == curve or (len(evals) == len(curve) + 1 and evals[:-2] + evals[-1:] == curve), (evals, curve)
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(t, pytest.approx(v)) for t, v in evals]

    progress = [row for row in rows if "run/merges" in row]
    assert [p["tokens"] for p in progress] == sorted(p["tokens"] for p in progress)
    assert any(0 < p["tokens"] < report["tokens_total"] for p in progress), "logged as the run went, not at its end"
    assert progress[-1]["run/merges"] > 0 and 0 < progress[-1]["run/goodput"] <= 1
    assert all(p["learner/learner-0/step_s"] > 0 and p["learner/learner-1/step_s"] > 0
               for p in progress[-1:]), progress[-1]

    summary: dict[str, Any] = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    for key in ("eval_loss_final", "merges", "goodput", "tokens_total"):
        assert summary[key] == report[key], key
    assert records[kinds.index("exit")].exit.exit_code == 0
