"""Built-in GPT tasks (gpt, text, gpt-moe) and the task contract: loading, checks, helpers."""
from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from common.task import (Task, TaskError, bind_task, build_model, check_task, count_tokens, evaluate, load_task,
                            parse_task_args)
from ddloco.tasks.gpt import Batch, is_heldout, load_corpus, stdlib_root

pytestmark = pytest.mark.timeout(60)

SMALL = dict(n_layer=2, n_head=2, n_embd=32, seq_len=32, batch_size=4, eval_batches=2)


@pytest.fixture(scope="module")
def task() -> Task:
    return load_task("gpt", SMALL)


def test_build_model_is_deterministic_per_seed_and_leaves_the_global_rng(task: Task) -> None:
    before = torch.get_rng_state()
    a, b = build_model(task, 0).state_dict(), build_model(task, 0).state_dict()
    assert torch.equal(before, torch.get_rng_state())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed gave different weights"
    other = build_model(task, 1).state_dict()
    assert not torch.equal(a["wte.weight"], other["wte.weight"]), "seed 1 gave seed 0's weights"


def test_embedding_names_are_parameters(task: Task) -> None:
    model = build_model(task, 0)
    assert set(task.embedding_names) == {"wte.weight", "wpe.weight"}
    assert all(n in dict(model.named_parameters()) for n in task.embedding_names)


def test_split_is_disjoint_by_file_and_follows_the_seeded_hash() -> None:
    corpus = load_corpus(stdlib_root(), seq_len=32, max_bytes=4_000_000)
    assert corpus.train_files and corpus.heldout_files
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    for rel in corpus.heldout_files:
        assert is_heldout(rel, seed=0, heldout_fraction=0.1)
    for rel in corpus.train_files:
        assert not is_heldout(rel, seed=0, heldout_fraction=0.1)
    n = len(corpus.train_files) + len(corpus.heldout_files)
    assert 0.02 < len(corpus.heldout_files) / n < 0.3
    size = sum(os.path.getsize(os.path.join(corpus.root, f)) + 1 for f in corpus.train_files)
    assert size == len(corpus.train)  # every byte accounted for: files plus one separator each
    other = load_corpus(stdlib_root(), seq_len=32, split_seed=7, max_bytes=4_000_000)
    assert set(other.heldout_files) != set(corpus.heldout_files)


def test_same_stream_and_seed_repeat_other_streams_differ_and_start_resumes(task: Task) -> None:
    it = iter(task.batches(0, 3, 0))
    first = [next(it) for _ in range(5)]
    again = next(iter(task.batches(0, 3, 0)))
    assert torch.equal(first[0].inputs, again.inputs)
    assert not torch.equal(first[0].inputs, first[1].inputs), "stream repeats itself"
    assert not torch.equal(first[0].inputs, next(iter(task.batches(1, 3, 0))).inputs)
    assert not torch.equal(first[0].inputs, next(iter(task.batches(0, 4, 0))).inputs)
    resumed = next(iter(task.batches(0, 3, 4)))
    assert torch.equal(resumed.inputs, first[4].inputs) and torch.equal(resumed.targets, first[4].targets)


def test_batch_shapes_and_token_count(task: Task) -> None:
    batch = next(iter(task.batches(2, 0, 0)))
    assert isinstance(batch, Batch)
    assert batch.inputs.shape == batch.targets.shape == (4, 32)
    assert count_tokens(task, batch) == 4 * 32
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1]), "targets are not next bytes"


def test_eval_loss_is_deterministic_and_uniform_at_init() -> None:
    task = load_task("gpt")
    model = build_model(task, 0)
    model.train()
    first, second = evaluate(task, model), evaluate(task, model)
    assert first == second
    assert abs(first - math.log(256)) < 0.1, f"initial loss {first}, expected ~ln 256"
    assert model.training, "evaluate did not restore training mode"


def test_adamw_steps_reduce_the_loss_of_a_fixed_batch(task: Task) -> None:
    model = build_model(task, 0)
    batch = next(iter(task.batches(0, 0, 0)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = task.loss(model, batch).item()
    for _ in range(8):
        opt.zero_grad()
        task.loss(model, batch).backward()
        opt.step()
    assert task.loss(model, batch).item() < start - 0.3


def test_text_task_trains_on_a_directory_of_files_with_a_split_by_file(tmp_path) -> None:
    for i in range(30):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * 20)
    task = load_task("text", {"path": str(tmp_path), "n_layer": 1, "seq_len": 16, "batch_size": 2})
    assert task.name == "text" and task.config["files"][0] + task.config["files"][1] == 30
    model = build_model(task, 0)
    assert check_task(task, model, seed=0) == 32
    assert math.isfinite(evaluate(task, model))
    with pytest.raises(TaskError, match="needs --task-arg path"):
        load_task("text")
    few = tmp_path / "few"
    few.mkdir()
    for i in range(3):   # too few files for a 10 % hash split: one of them is held out all the same
        (few / f"f{i}.txt").write_text("some words to model. " * 40)
    small = load_task("text", {"path": str(few), "seq_len": 16, "n_layer": 1})
    assert small.config["files"] == [2, 1]
    with pytest.raises(TaskError, match="does not exist"):
        load_task("text", {"path": str(tmp_path / "missing")})


def test_gpt_moe_routes_tokens_through_experts_and_trains() -> None:
    task = load_task("gpt-moe", dict(SMALL, n_experts=3, top_k=2))
    model = build_model(task, 0)
    names = {n for n, _ in model.named_parameters()}
    assert {"blocks.0.mlp.router.weight", "blocks.0.mlp.experts.2.fc.weight"} <= names
    batch = next(iter(task.batches(0, 0, 0)))
    loss = task.loss(model, batch)
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad is not None, "router gets no gradient"
    with pytest.raises(TaskError, match="top_k"):
        load_task("gpt-moe", dict(SMALL, n_experts=2, top_k=3))


def test_load_task_errors_name_the_problem(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mytask.py").write_text(
        "import torch\nfrom common.task import Task\n"
        "def make(width=4):\n"
        "    return Task(name='mine', model=lambda: torch.nn.Linear(width, 1),\n"
        "                batches=lambda s, seed, start: iter([(torch.ones(2, width), torch.ones(2, 1))] * 9),\n"
        "                loss=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), config={'width': width})\n"
        "not_a_task = 3\n"
        "def vector_loss():\n"
        "    t = make()\n"
        "    return Task(name='v', model=t.model, batches=t.batches, loss=lambda m, b: m(b[0]) - b[1])\n"
        "def nan_loss():\n"
        "    t = make()\n"
        "    return Task(name='n', model=t.model, batches=t.batches, loss=lambda m, b: torch.tensor(float('nan')))\n"
        "def uncountable():\n"
        "    t = make()\n"
        "    return Task(name='u', model=t.model, batches=lambda s, seed, start: iter([{'x': 1}]), loss=t.loss)\n")
    task = load_task("mytask:make", {"width": 3})
    assert task.name == "mine" and task.config == {"width": 3}
    assert count_tokens(task, next(iter(task.batches(0, 0, 0)))) == 2
    cases = [("nosuchmodule:task", {}, "cannot import task module 'nosuchmodule'"),
             ("mytask:missing", {}, "has no attribute 'missing'"),
             ("mytask:not_a_task", {}, "is a int, not a Task or a callable"),
             ("mytask:make", {"depth": 2}, "takes no task arg(s) depth; it accepts: width"),
             ("gpt", {"n_embd": 30, "n_head": 4}, "must be divisible"),
             ("nocolon", {}, "neither a built-in")]
    for spec, args, needle in cases:
        with pytest.raises(TaskError) as e:
            load_task(spec, args)
        assert needle in str(e.value), (spec, str(e.value))
    for attr, needle in [("vector_loss", "must return a scalar tensor, got a tensor of shape (2, 1)"),
                         ("nan_loss", "is nan"), ("uncountable", "cannot count tokens of a dict batch")]:
        t = load_task(f"mytask:{attr}")
        with pytest.raises(TaskError) as e:
            check_task(t, build_model(t, 0), seed=0)
        assert needle in str(e.value), (attr, str(e.value))


def test_bind_fills_name_and_config_and_refuses_a_different_config() -> None:
    from common.config import RunConfig, TaskConfig
    task, run = bind_task(RunConfig(task=TaskConfig(spec="gpt", args=dict(SMALL))))
    assert run.task.name == "gpt" and run.task.config["n_layer"] == 2
    with pytest.raises(TaskError, match=r"config differs from the run's: n_layer=3 \(run has 2\)"):
        bind_task(run, load_task("gpt", dict(SMALL, n_layer=3)))
    with pytest.raises(TaskError, match="KEY=VALUE"):
        parse_task_args(["novalue"])


def test_task_args_from_the_command_line_take_the_type_the_callable_declares(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "typed.py").write_text(
        "import torch\nfrom common.task import Task\n"
        "def make(path: str = '', width: int = 4, rate=0.5, flag: bool = False, other=None):\n"
        "    return Task(name='typed', model=lambda: torch.nn.Linear(width, 1),\n"
        "                batches=lambda s, seed, start: iter([torch.ones(2, width)]), loss=lambda m, b: m(b).mean(),\n"
        "                config={'path': path, 'width': width, 'rate': rate, 'flag': flag, 'other': other})\n")
    args = parse_task_args(["path=2024", "width=007", "rate=1e-3", "flag=true", "other=12"])
    assert args == {"path": "2024", "width": "007", "rate": "1e-3", "flag": "true", "other": "12"}
    assert load_task("typed:make", args).config == {"path": "2024", "width": 7, "rate": 1e-3, "flag": True,
                                                     "other": 12}
    for bad, needle in [("width=two", "task arg width='two'"), ("rate=nan", "expected a finite number"),
                        ("flag=maybe", "expected true or false")]:
        with pytest.raises(TaskError, match=needle):
            load_task("typed:make", parse_task_args([bad]))


def test_models_built_by_concurrent_threads_are_identical() -> None:
    """Shards and learners of the Python API are threads of one process: their builds share
    torch's global RNG and must not interleave."""
    import threading
    task = load_task("gpt", dict(SMALL, n_layer=4))
    built: list[dict] = []
    threads = [threading.Thread(target=lambda: built.append(build_model(task, 0).state_dict())) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 6
    assert all(torch.equal(b[k], built[0][k]) for b in built for k in b), "concurrent builds differ"


def test_gpt_on_another_pythons_standard_library_is_refused_naming_the_data_digest(tmp_path, monkeypatch) -> None:
    from common.config import RunConfig, TaskConfig
    args = dict(SMALL, corpus_max_bytes=200_000)
    task, run = bind_task(RunConfig(task=TaskConfig(spec="gpt", args=args)))
    assert run.task.data_digest == task.data_digest != "" and stdlib_root() in run.task.data_source
    other_lib = tmp_path / "lib" / "python3.99"          # another interpreter's standard library
    other_lib.mkdir(parents=True)
    for i in range(40):
        (other_lib / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # another version\n" * 20)
    monkeypatch.setattr("ddloco.tasks.gpt.stdlib_root", lambda: str(other_lib))
    other = load_task("gpt", args)
    with pytest.raises(TaskError) as e:
        bind_task(run, other)
    msg = str(e.value)
    assert (f"data digest differs: run has {run.task.data_digest}, this process has {other.data_digest} "
            f"(its data: Python ") in msg, msg
    assert f"standard library sources under {other_lib} (40 file(s)" in msg and stdlib_root() in msg, msg


def test_builtin_tasks_hash_the_data_they_load() -> None:
    a, b = load_task("gpt", SMALL), load_task("gpt", dict(SMALL, n_layer=3))
    assert len(a.data_digest) == 16 and a.data_digest == b.data_digest   # same corpus, another model
    assert load_task("gpt", dict(SMALL, split_seed=1)).data_digest != a.data_digest   # another split
    assert load_task("gpt-moe", SMALL).data_digest == a.data_digest


def test_the_readme_own_model_snippet_is_cut_from_a_complete_example_that_trains(tmp_path, monkeypatch) -> None:
    """Every line of the README's "Bring your own model" snippet stands in examples/own_model.py, which
    defines what the snippet names (Net, my_batches, my_heldout_batches, images, labels, data_dir),
    writes its data files once, and passes the task contract's dry run; a few AdamW steps lower its loss."""
    import importlib
    import re
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    section = readme[readme.index("## Bring your own model"):]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    source = (repo / "examples" / "own_model.py").read_text()
    missing = [line for line in snippet.splitlines() if line.strip() and line not in source.splitlines()]
    assert missing == [], missing
    monkeypatch.setenv("DATA_DIR", str(tmp_path / "data"))
    sys.modules.pop("examples.own_model", None)
    own = importlib.import_module("examples.own_model")
    try:
        assert (tmp_path / "data" / "labels.npy").exists()
        task = own.task(batch_size=64)
        model = build_model(task, 0)
        assert check_task(task, model, seed=0) == 64
        before = evaluate(task, model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for batch in itertools.islice(task.batches(0, 0, 0), 60):
            opt.zero_grad()
            task.loss(model, batch).backward()
            opt.step()
        assert evaluate(task, model) < 0.7 * before
    finally:
        sys.modules.pop("examples.own_model", None)
