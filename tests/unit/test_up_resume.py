"""Which stopped run `ddloco up --resume ARG` continues, and the run id `up` picks when given none:
plain directories and files, no processes."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from common.config import ConfigError
from ddloco.cli import _run_id_given
from ddloco.resume import STATE_FILE, new_run_id, resolve_resume


def _stopped(runs: Path, name: str, run_id: str, *, checkpoint: bool = True) -> Path:
    d = runs / name
    (d / "checkpoints").mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"run_id": run_id, "syncers": 1, "versions_total": 7,
                                            "tokens_total": 1234}))
    if checkpoint:
        (d / "checkpoints" / f"{run_id}-shard0of1.pt").write_bytes(b"")
    return d


def test_a_run_id_names_only_the_runs_of_exactly_that_id(tmp_path):
    runs = tmp_path / "runs"
    demo = _stopped(runs, "demo-20261126-101500", "demo")
    generated = _stopped(runs, "demo-1f9a3c-20261126-111500", "demo-1f9a3c")
    assert resolve_resume("demo", runs) == (demo, json.loads((demo / STATE_FILE).read_text()))
    assert resolve_resume("demo-1f9a3c", runs)[0] == generated
    assert resolve_resume(generated.name, runs)[0] == generated          # its directory's name under runs/
    assert resolve_resume(str(generated), runs)[0] == generated          # or its path


def test_several_runs_of_one_id_are_refused_listing_each_with_its_versions_and_tokens(tmp_path):
    runs = tmp_path / "runs"
    a = _stopped(runs, "x-20261126-101500", "x")
    b = _stopped(runs, "x-20261126-111500", "x")
    with pytest.raises(ConfigError) as refused:
        resolve_resume("x", runs)
    head, *lines = str(refused.value).splitlines()
    assert head == "--resume x: 2 stopped runs have run id 'x'; pick one by passing its directory:"
    assert sorted(ln.split("   (")[0] for ln in lines) == [f"  --resume {a}", f"  --resume {b}"]
    assert all(re.search(r"\(stopped \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, versions 7, 1,234 tokens\)$", ln) for ln in lines)


@pytest.mark.parametrize("case, problem", [
    ("missing", "no such directory"),
    ("no state", f"no readable {STATE_FILE}"),
    ("no checkpoint", "no shard checkpoints of run 'y'"),
])
def test_a_directory_that_cannot_be_resumed_is_one_line_saying_why(tmp_path, case, problem):
    runs = tmp_path / "runs"
    d = _stopped(runs, "y-20261126-101500", "y", checkpoint=case != "no checkpoint")
    if case == "no state":
        (d / STATE_FILE).unlink()
    arg = str(runs / "gone") if case == "missing" else str(d)
    with pytest.raises(ConfigError, match=re.escape(f"--resume {arg}: {problem}")) as refused:
        resolve_resume(arg, runs)
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"^--resume nobody: no stopped run 'nobody' with checkpoints under "):
        resolve_resume("nobody", runs)


def test_up_picks_a_new_run_id_unless_a_flag_or_the_config_file_names_one(tmp_path):
    named, unnamed = tmp_path / "named.toml", tmp_path / "unnamed.toml"
    named.write_text('[endpoints]\nrun_id = "exp1"\n')
    unnamed.write_text("[algo]\nfragments = 4\n")
    given = lambda run_id, config: _run_id_given(argparse.Namespace(run_id=run_id, config=config))  # noqa: E731
    assert given("exp1", None) and given(None, str(named)) and given("exp2", str(unnamed))
    assert not given(None, None) and not given(None, str(unnamed))
    ids = {new_run_id() for _ in range(20)}
    assert len(ids) == 20 and all(re.fullmatch(r"demo-[0-9a-f]{6}", i) for i in ids)


class _Monitor:
    """What ``adopt_freshest_model`` reads of the monitor: the model of its last evaluation and
    that model's fragment versions; records the model it is told to adopt."""

    def __init__(self, versions: dict[int, int]) -> None:
        self.versions = versions
        self.final_versions: dict[int, int] | None = None
        self.adopted: tuple[Any, dict[int, int]] | None = None

    def wait_evaluation(self, timeout_s: float | None = None) -> None:
        pass

    def adopt_final(self, model: Any, versions: dict[int, int]) -> None:
        self.adopted = (model, versions)
        self.final_versions = versions


def _checkpoint(d: Path, versions: dict[int, int]) -> Any:
    """A one-shard checkpoint of run ``r`` (the example CNN, 4 fragments) at ``versions``; the task."""
    import torch
    from common.config import AlgoConfig, RunConfig, TaskConfig
    from common.fragments import gather, model_plan, state_tensors
    from common.task import bind_task, build_model
    task, run = bind_task(RunConfig(task=TaskConfig(spec="examples.cnn:task"), algo=AlgoConfig(fragments=4)))
    model = build_model(task, run.task.seed)
    plan = model_plan(model, task.embedding_names, 4)
    d.mkdir(parents=True)
    torch.save({"run_config": run.to_dict(),
                "fragments": {p: {"theta": gather(state_tensors(model), f), "version": versions[p]}
                              for p, f in enumerate(plan)}}, d / "r-shard0of1.pt")
    return task


@pytest.mark.parametrize("case", ["checkpoints fresher", "checkpoints as fresh", "live fresher", "no checkpoints"])
def test_on_ctrl_c_the_freshest_complete_model_becomes_the_final_one(tmp_path, case):
    from ddloco.resume import adopt_freshest_model
    stopped = {0: 5, 1: 5, 2: 4, 3: 4}   # 18 merges in the shards' checkpoints
    live = {"checkpoints fresher": {0: 4, 1: 4, 2: 4, 3: 4}, "checkpoints as fresh": dict(stopped),
            "live fresher": {0: 6, 1: 5, 2: 5, 3: 4}, "no checkpoints": {0: 1, 1: 1, 2: 0, 3: 0}}[case]
    task = None if case == "no checkpoints" else _checkpoint(tmp_path / "ck", stopped)
    monitor, said = _Monitor(dict(live)), []
    adopt_freshest_model(monitor, str(tmp_path / "ck"), "r", task, said.append)
    if case.startswith("checkpoints"):
        assert monitor.adopted is not None and monitor.adopted[1] == stopped
    else:
        assert monitor.adopted is None and monitor.final_versions == live, said
        assert said[-1] == f"final      the last live evaluation (fragment versions {sum(live.values())}) is the final model"
