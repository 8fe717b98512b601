"""The vision tasks: built-in ``digits`` (scikit-learn's 8x8 digits) and the user-style example
``examples.cnn:task``. Both honour the task contract: deterministic resumable batch streams, a
fixed held-out set, countable batches, BatchNorm buffers, and a model that actually learns."""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from common.task import (Task, TaskError, build_model, check_task, count_tokens, evaluate, json_config,
                            load_task, scalar_loss)

pytestmark = pytest.mark.timeout(60)

TASKS = ["digits", "cnn"]


@pytest.fixture(scope="module")
def digits_task() -> Task:
    pytest.importorskip("sklearn")
    return load_task("digits", {"batch_size": 16})


@pytest.fixture(scope="module")
def cnn_task() -> Task:
    return load_task("examples.cnn:task", {"batch_size": 16, "eval_examples": 256})


@pytest.fixture(params=TASKS)
def task(request: pytest.FixtureRequest) -> Task:
    return request.getfixturevalue(f"{request.param}_task")


def take(task: Task, stream: int, seed: int, start: int, n: int) -> list[Any]:
    it = iter(task.batches(stream, seed, start))
    return [next(it) for _ in range(n)]


def same(a: Any, b: Any) -> bool:
    return torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and a.tokens == b.tokens


def train(task: Task, model: nn.Module, steps: int, *, seed: int = 0, lr: float = 3e-3) -> None:
    """``steps`` AdamW steps on stream 0, on one thread (tiny convolutions gain nothing from more,
    and lose a lot when the other core is busy)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for batch in take(task, 0, seed, 0, steps):
            loss = scalar_loss(task, model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- batch streams
def test_batches_are_deterministic_for_stream_seed_start(task: Task) -> None:
    a, b = take(task, 1, 7, 0, 5), take(task, 1, 7, 0, 5)
    assert all(same(x, y) for x, y in zip(a, b))
    assert not same(a[0], a[1]), "consecutive batches are identical"


def test_start_k_resumes_at_batch_k_of_a_fresh_iterator(task: Task) -> None:
    full = take(task, 2, 3, 0, 6)
    resumed = take(task, 2, 3, 4, 2)
    assert same(resumed[0], full[4]) and same(resumed[1], full[5])


def test_streams_and_seeds_give_different_batches(task: Task) -> None:
    base = take(task, 0, 0, 0, 1)[0]
    assert not torch.equal(base.images, take(task, 1, 0, 0, 1)[0].images), "stream 1 repeats stream 0"
    assert not torch.equal(base.images, take(task, 0, 1, 0, 1)[0].images), "seed 1 repeats seed 0"


def test_batch_shapes_and_token_count(task: Task) -> None:
    batch = take(task, 0, 0, 0, 1)[0]
    assert batch.images.dtype == torch.float32 and batch.images.dim() == 4 and batch.images.shape[:2] == (16, 1)
    assert batch.labels.dtype == torch.int64 and batch.labels.shape == (16,)
    assert 0 <= int(batch.labels.min()) and int(batch.labels.max()) < 10
    assert count_tokens(task, batch) == 16 == task.config["batch_size"]
    assert check_task(task, build_model(task, 0), seed=0) == 16


def test_negative_stream_or_start_is_refused() -> None:
    pytest.importorskip("sklearn")
    task = load_task("digits")
    with pytest.raises(TaskError):
        next(iter(task.batches(-1, 0, 0)))
    with pytest.raises(TaskError):
        next(iter(task.batches(0, 0, -1)))


# ---------------------------------------------------------------------------- loss, eval, model
def test_loss_is_a_finite_differentiable_scalar(task: Task) -> None:
    model = build_model(task, 0)
    loss = task.loss(model, take(task, 0, 0, 0, 1)[0])
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and torch.isfinite(loss)
    assert loss.requires_grad
    assert abs(float(loss.detach()) - 2.303) < 0.5, "an untrained 10-class model should score about ln 10"


def test_eval_set_is_fixed_and_evaluate_is_repeatable(task: Task) -> None:
    first, second = list(task.eval_batches()), list(task.eval_batches())
    assert len(first) == len(second) >= 1
    assert all(same(x, y) for x, y in zip(first, second))
    model = build_model(task, 0)
    assert evaluate(task, model) == evaluate(task, model)
    assert model.training, "evaluate() must restore train mode"
    assert not any(torch.equal(first[0].images[:16], b.images) for b in take(task, 0, 0, 0, 3))


def test_model_is_deterministic_per_seed_and_has_batchnorm_buffers(task: Task) -> None:
    a, b, c = build_model(task, 0), build_model(task, 0), build_model(task, 1)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    pa, pc = dict(a.named_parameters()), dict(c.named_parameters())
    assert any(not torch.equal(pa[k], pc[k]) for k in pa), "seed 1 gave seed 0's weights"
    buffers = dict(a.named_buffers())
    assert any(n.endswith("running_mean") for n in buffers) and any(n.endswith("running_var") for n in buffers)
    before = {n: t.clone() for n, t in buffers.items() if n.endswith("running_mean")}
    a.train()
    with torch.no_grad():
        task.loss(a, take(task, 0, 0, 0, 1)[0])
    assert any(not torch.equal(before[n], dict(a.named_buffers())[n]) for n in before), \
        "a training-mode forward did not update BatchNorm's running statistics"


def test_config_is_json_and_names_every_setting(task: Task) -> None:
    config = json_config(task.config)
    assert json.loads(json.dumps(config)) == config
    assert config["batch_size"] == 16


# ---------------------------------------------------------------------------- digits specifics
def test_digits_split_is_fixed_disjoint_and_independent_of_the_run_seed() -> None:
    pytest.importorskip("sklearn")
    from ddloco.tasks.digits import load_split

    task = load_task("digits")
    assert task.name == "digits"
    n_train, n_heldout = task.config["images"]
    assert n_train + n_heldout == 1797 and n_heldout == round(1797 * 0.2)
    assert sum(count_tokens(task, b) for b in task.eval_batches()) == n_heldout
    split = load_split(0.2, 0)
    assert split.train_images.min() >= 0.0 and split.train_images.max() <= 1.0
    other = load_split(0.2, 1)
    assert not torch.equal(split.heldout_labels, other.heldout_labels), "split_seed has no effect"
    assert load_task("digits", {"eval_fraction": 0.5}).config["images"][1] == round(1797 * 0.5)


@pytest.mark.parametrize("args", [{"batch_size": 0}, {"width": 0}, {"eval_fraction": 1.0},
                                  {"eval_fraction": 0.0}, {"split_seed": -1}, {"batch_size": 1.5}])
def test_digits_refuses_bad_args(args: dict[str, Any]) -> None:
    pytest.importorskip("sklearn")
    with pytest.raises(TaskError):
        load_task("digits", args)


def test_digits_trains_to_high_heldout_accuracy() -> None:
    pytest.importorskip("sklearn")
    from ddloco.tasks.digits import heldout_accuracy

    task = load_task("digits")
    model = build_model(task, 0)
    initial = evaluate(task, model)
    train(task, model, 100)
    final = evaluate(task, model)
    assert final < 0.3 * initial, (initial, final)
    assert heldout_accuracy(model) >= 0.9
    assert model.training, "heldout_accuracy must restore train mode"


# ---------------------------------------------------------------------------- the example
def test_example_ties_its_head_to_the_class_embedding(cnn_task: Task) -> None:
    import ddloco

    assert isinstance(cnn_task, ddloco.Task)
    model = build_model(cnn_task, 0)
    params = dict(model.named_parameters())
    assert set(cnn_task.embedding_names) == {"class_emb.weight"} <= set(params)
    scalar_loss(cnn_task, model, take(cnn_task, 0, 0, 0, 1)[0]).backward()
    grad = params["class_emb.weight"].grad
    assert grad is not None and grad.abs().sum() > 0, "the class embedding is not the output head"


def test_example_data_depends_on_data_seed_only_through_its_args() -> None:
    a = load_task("examples.cnn:task", {"eval_examples": 64})
    b = load_task("examples.cnn:task", {"eval_examples": 64})
    c = load_task("examples.cnn:task", {"eval_examples": 64, "data_seed": 1})
    ea, eb, ec = (next(iter(t.eval_batches())) for t in (a, b, c))
    assert same(ea, eb) and not torch.equal(ea.images, ec.images)
    assert a.config != c.config
    with pytest.raises(TaskError):
        load_task("examples.cnn:task", {"batch_size": 0})


def test_example_trains_fast() -> None:
    task = load_task("examples.cnn:task")  # the defaults a user runs: batch 32
    model = build_model(task, 0)
    initial = evaluate(task, model)
    train(task, model, 120)
    final = evaluate(task, model)
    assert final < 0.3 * initial, (initial, final)
