"""Built-in GPT task: deterministic model, file-level split, batch streams, evaluation."""
from __future__ import annotations

import math
import os

import pytest
import torch

from common.config import TaskConfig
from common.tasks import Batch, GPTTask, is_heldout, load_corpus, make_task

pytestmark = pytest.mark.timeout(60)

SMALL = dict(n_layer=2, n_head=2, n_embd=32, seq_len=32, batch_size=4, eval_batches=2)


@pytest.fixture(scope="module")
def task() -> GPTTask:
    return make_task(TaskConfig(**SMALL))  # type: ignore[return-value]


def test_build_model_is_deterministic_per_seed(task: GPTTask) -> None:
    a, b = task.build_model().state_dict(), task.build_model().state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed gave different weights"
    other = make_task(TaskConfig(**SMALL, seed=1)).build_model().state_dict()
    assert not torch.equal(a["wte.weight"], other["wte.weight"]), "seed 1 gave seed 0's weights"


def test_build_model_leaves_global_rng_untouched(task: GPTTask) -> None:
    before = torch.get_rng_state()
    task.build_model()
    assert torch.equal(before, torch.get_rng_state())


def test_embedding_names_are_token_and_position_embeddings(task: GPTTask) -> None:
    model = task.build_model()
    assert task.embedding_names(model) == {"wte.weight", "wpe.weight"}
    assert all(n in dict(model.named_parameters()) for n in task.embedding_names(model))


def test_split_is_disjoint_by_file_and_follows_the_seeded_hash() -> None:
    cfg = TaskConfig(**SMALL)
    corpus = load_corpus(cfg)
    assert corpus.train_files and corpus.heldout_files
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    for rel in corpus.heldout_files:
        assert is_heldout(rel, seed=cfg.seed, heldout_fraction=cfg.heldout_fraction)
    for rel in corpus.train_files:
        assert not is_heldout(rel, seed=cfg.seed, heldout_fraction=cfg.heldout_fraction)
    n = len(corpus.train_files) + len(corpus.heldout_files)
    assert 0.02 < len(corpus.heldout_files) / n < 0.3
    # Every byte accounted for: files plus one separator each.
    size = sum(os.path.getsize(os.path.join(corpus.root, f)) + 1 for f in corpus.train_files)
    assert size == len(corpus.train)
    other = load_corpus(TaskConfig(**SMALL, seed=7))
    assert set(other.heldout_files) != set(corpus.heldout_files)


def test_same_stream_and_seed_repeat_and_other_streams_differ(task: GPTTask) -> None:
    first = [next(task.train_batches(stream=0, seed=3)) for _ in range(2)]
    a = task.train_batches(stream=0, seed=3)
    again = [next(a), next(a)]
    assert torch.equal(first[0].inputs, again[0].inputs)
    assert not torch.equal(again[0].inputs, again[1].inputs), "stream repeats itself"
    other_stream = next(task.train_batches(stream=1, seed=3))
    other_seed = next(task.train_batches(stream=0, seed=4))
    assert not torch.equal(first[0].inputs, other_stream.inputs)
    assert not torch.equal(first[0].inputs, other_seed.inputs)


def test_batch_shapes_and_token_count(task: GPTTask) -> None:
    batch = next(task.train_batches(stream=2, seed=0))
    assert isinstance(batch, Batch)
    assert batch.inputs.shape == batch.targets.shape == (4, 32)
    assert batch.inputs.dtype == torch.int64
    assert batch.tokens == 4 * 32
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1]), "targets are not next bytes"


def test_eval_loss_is_deterministic_and_uniform_at_init() -> None:
    task = make_task(TaskConfig())  # the default model
    model = task.build_model()
    model.train()
    first, second = task.eval_loss(model), task.eval_loss(model)
    assert first == second
    assert abs(first - math.log(256)) < 0.05, f"initial loss {first}, expected ~ln 256"
    assert model.training, "eval_loss did not restore training mode"


def test_adamw_steps_reduce_the_loss_of_a_fixed_batch(task: GPTTask) -> None:
    model = task.build_model()
    batch = next(task.train_batches(stream=0, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = task.loss(model, batch).item()
    for _ in range(8):
        opt.zero_grad()
        task.loss(model, batch).backward()
        opt.step()
    end = task.loss(model, batch).item()
    assert end < start - 0.3, f"loss went from {start:.3f} to {end:.3f}"


def test_train_batches_resume_exactly_at_a_data_position():
    from common.config import TaskConfig
    from common.tasks import make_task
    task = make_task(TaskConfig(seq_len=16, batch_size=4, corpus_max_bytes=300_000))
    it = task.train_batches(stream=3, seed=0)
    first = [next(it) for _ in range(5)]
    resumed = next(task.train_batches(stream=3, seed=0, start_step=4))
    assert torch.equal(resumed.inputs, first[4].inputs) and torch.equal(resumed.targets, first[4].targets)
    assert not torch.equal(first[3].inputs, first[4].inputs)
