"""The built-in ``hf`` task: a tiny Llama (hidden 64, 2 layers) from a config, a BPE tokenizer
trained here, a corpus in ``ddloco data prepare``'s format. Config overrides by the attribute's
type, embedding names with a tied head, the same model on every build, the causal-LM loss, the
save and samples hooks, and each bad input refused in one line."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # before huggingface_hub is imported: no test looks for the hub
pytest.importorskip("transformers")

from common.config import ConfigError  # noqa: E402
from common.task import Task, TaskError, build_model, check_task, evaluate, load_task, parse_task_args  # noqa: E402
from tests.hf_corpus import TINY_CONFIG, make_corpus, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    tok = make_tokenizer(root / "tok")
    other = make_tokenizer(root / "other", vocab_size=280)
    return {"root": root, "tok": tok, "other": other, "corpus": make_corpus(root / "corpus", tok)}


def args(files: dict[str, Path], **extra: str) -> dict[str, str]:
    return {"model": "llama", "data": str(files["corpus"]), "seq_len": "32", "batch_size": "4",
            "eval_batches": "2", **TINY_CONFIG, **extra}


@pytest.fixture(scope="module")
def task(files: dict[str, Path]) -> Task:
    return load_task("hf", args(files))


def test_config_overrides_from_the_command_line_take_the_type_of_the_attribute_they_replace(files):
    parsed = parse_task_args(["config.num_hidden_layers=3", "config.rms_norm_eps=1e-5",
                              "config.tie_word_embeddings=true", "config.hidden_act=gelu"])
    assert parsed["config.num_hidden_layers"] == "3"   # a plain JSON value in the run config
    task = load_task("hf", {**args(files), **parsed})
    model = build_model(task, 0)
    c = model.config
    assert (c.num_hidden_layers, c.rms_norm_eps, c.tie_word_embeddings, c.hidden_act) == (3, 1e-5, True, "gelu")
    assert isinstance(c.num_hidden_layers, int) and isinstance(c.rms_norm_eps, float)
    assert len(model.model.layers) == 3 and c.head_dim == 16    # head_dim follows hidden 64 / 4 heads
    assert task.config["config"]["num_hidden_layers"] == 3 and task.config["model"] == "llama"
    assert c.vocab_size == 300 and c.eos_token_id == 0   # a model type takes the tokenizer's vocabulary


def test_bad_config_overrides_and_dotted_args_of_other_tasks_are_one_line_errors(files):
    with pytest.raises(TaskError, match=r"config\.nope: LlamaConfig has no such attribute"):
        load_task("hf", args(files, **{"config.nope": "1"}))
    with pytest.raises(TaskError, match=r"config\.num_hidden_layers='two': invalid literal.*num_hidden_layers is 32"):
        load_task("hf", args(files, **{"config.num_hidden_layers": "two"}))
    with pytest.raises(TaskError, match=r"takes no dotted task arg\(s\) config\.n_layer"):
        load_task("digits", {"config.n_layer": "2"})
    with pytest.raises(TaskError, match="KEY an identifier"):
        parse_task_args(["config..x=1"])


def test_embedding_names_come_from_the_model_and_a_tied_head_is_named_once(files, task):
    assert task.embedding_names == ("model.embed_tokens.weight", "lm_head.weight")
    tied = load_task("hf", args(files, **{"config.tie_word_embeddings": "true"}))
    assert tied.embedding_names == ("model.embed_tokens.weight",)
    names = dict(build_model(tied, 0).named_parameters())
    assert "lm_head.weight" not in names and set(tied.embedding_names) <= set(names)
    gpt2 = load_task("hf", {"model": "gpt2", "data": str(files["corpus"]), "seq_len": "32", "batch_size": "4",
                            "config.n_embd": "32", "config.n_layer": "1", "config.n_head": "2"})
    assert gpt2.embedding_names == ("transformer.wte.weight",)   # gpt2 ties its head by default


def test_every_build_of_the_task_makes_the_same_model_and_batches(files, task):
    again = load_task("hf", args(files))   # another process: its own load of the same args
    assert (again.name, again.config, again.data_digest) == (task.name, task.config, task.data_digest)
    a, b = build_model(task, 7), build_model(again, 7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_model(task, 8)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    first = next(iter(task.batches(1, 0, 5)))
    assert first.dtype == torch.long and first.shape == (4, 33)
    assert torch.equal(first, next(iter(again.batches(1, 0, 5))))   # batch 5 of stream 1, directly
    assert check_task(task, a, seed=0) == 4 * 32   # tokens: batch_size * seq_len


def test_loss_is_the_models_own_causal_lm_cross_entropy(task):
    model = build_model(task, 0).eval()
    batch = next(iter(task.batches(0, 0, 0)))
    with torch.no_grad():
        ours = float(task.loss(model, batch))
        theirs = float(model(input_ids=batch, labels=batch).loss)   # transformers shifts: [:, :-1] -> [:, 1:]
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    assert abs(evaluate(task, model) - 5.7) < 0.3   # about ln(300): an untrained model


def test_data_digest_is_the_corpus_index_and_the_tokenizer_not_the_shards(files, tmp_path):
    from ddloco.data import TokenCorpus, tokenizer_hash
    from transformers import AutoTokenizer

    from common.task import hash_data
    task = load_task("hf", args(files))
    corpus = TokenCorpus.open(str(files["corpus"]))
    tok = AutoTokenizer.from_pretrained(str(files["tok"]))
    assert task.data_digest == hash_data(corpus.digest.encode(), tokenizer_hash(tok).encode())
    assert str(files["corpus"]) in task.data_source


def test_save_writes_a_directory_transformers_loads_without_our_code(files, task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = build_model(task, 3).eval()
    task.save(model, str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert {p.suffix for p in (tmp_path / "out").iterdir()} >= {".json", ".safetensors"}
    batch = next(iter(task.batches(0, 0, 0)))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=batch).logits, loaded(input_ids=batch).logits, atol=1e-6)
    assert len(tok) == 300 and tok.decode(tok("def f(x):")["input_ids"]) == "def f(x):"
    assert loaded.config.use_cache   # for generation; training keeps it off
    assert not model.config.use_cache


def test_samples_are_greedy_continuations_of_held_out_prompts(task):
    model = build_model(task, 0)
    model.train()
    texts = task.samples(model)
    assert len(texts) == 3 and all(" || " in t for t in texts)
    assert texts == task.samples(model)   # greedy: the same text twice
    assert model.training   # its mode restored


def test_save_and_samples_must_be_callable_or_none(task):
    with pytest.raises(TaskError, match="Task.save must be callable or None"):
        dataclasses.replace(task, save="dir")
    with pytest.raises(TaskError, match="Task.samples must be callable or None"):
        dataclasses.replace(task, samples=3)


def test_export_refuses_the_hf_format_for_a_task_without_save(task):
    from ddloco.export import check_saves
    with pytest.raises(ConfigError, match=r"--format hf: task 'hf' has no save hook"):
        check_saves(dataclasses.replace(task, save=None))


BAD_INPUTS = {
    "unknown model": ({"model": "no-such-org/no-such-model"}, "model 'no-such-org/no-such-model' cannot be resolved offline"),
    "vocabulary too large": ({"config.vocab_size": "100"}, "has 300 tokens, more than the model's embedding (vocab_size=100)"),
    "corpus shorter than a batch": ({"batch_size": "100000"}, "shorter than one batch of 100000"),
    "shards of another tokenizer": ({"tokenizer": "OTHER"}, "its shards were made with another tokenizer"),
    "seq_len above the maximum": ({"seq_len": "200"}, "seq_len=200 is above the model's max_position_embeddings=128"),
    "unknown init": ({"init": "random"}, "init must be one of scratch, pretrained"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_are_one_line_task_errors(files, case):
    extra, needle = BAD_INPUTS[case]
    extra = {k: str(files["other"]) if v == "OTHER" else v for k, v in extra.items()}
    with pytest.raises(TaskError) as e:
        load_task("hf", args(files, **extra))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_pretrained_init_loads_a_saved_models_weights_and_a_directory_gives_its_config(files, task, tmp_path):
    saved = build_model(task, 11)
    task.save(saved, str(tmp_path / "m"))
    common = {"data": str(files["corpus"]), "seq_len": "32", "batch_size": "4", "eval_batches": "2"}
    pre = load_task("hf", {**common, "model": str(tmp_path / "m"), "init": "pretrained"})
    model = build_model(pre, 0)   # the run's seed does not matter: the weights are the saved ones
    assert model.training and not model.config.use_cache
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), model.state_dict().values()))
    assert pre.config["model_config"] == task.config["model_config"]   # the same architecture
    scratch = load_task("hf", {**common, "model": str(tmp_path / "m"), "config.num_hidden_layers": "1"})
    assert len(build_model(scratch, 0).model.layers) == 1   # a directory's config, overridden
    with pytest.raises(TaskError, match="init=pretrained needs weights: model='llama' is a model type"):
        load_task("hf", {**common, "model": "llama", "init": "pretrained"})


def test_checkpointing_turns_on_activation_checkpointing_and_still_trains(files):
    task = load_task("hf", args(files, checkpointing="true"))
    model = build_model(task, 0)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    loss = task.loss(model, next(iter(task.batches(0, 0, 0))))
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert "checkpointing" not in task.config   # the same training either way: learners may differ


def test_the_runs_task_check_refuses_another_corpus_or_model_config(files, tmp_path):
    from common.config import RunConfig, TaskConfig
    from common.task import bind_task
    _, run = bind_task(RunConfig(task=TaskConfig(spec="hf", args=args(files))))
    assert run.task.name == "hf" and run.task.data_digest
    same, _ = bind_task(run)   # another process, the same args: accepted
    assert same.data_digest == run.task.data_digest
    bigger = make_corpus(tmp_path / "bigger", files["tok"], train_repeat=2)   # the same tokenizer, other shards
    with pytest.raises(TaskError, match="data digest differs"):
        bind_task(run, load_task("hf", args(files, data=str(bigger))))
    with pytest.raises(TaskError, match="config differs from the run's: .*model_config="):
        bind_task(run, load_task("hf", args(files, **{"config.num_hidden_layers": "3"})))
