"""Built-in ``hf``: a Hugging Face ``transformers`` causal language model on a tokenized corpus.

    ddloco up --task hf --task-arg model=llama --task-arg data=corpus/ --task-arg seq_len=256 \\
        --task-arg batch_size=16 --task-arg config.num_hidden_layers=4 --learners 4 --syncers 2

- ``model``: a model type (``llama``, ``gpt2``, ``qwen2``, ``mistral``, any ``AutoConfig.for_model``
  name: built from that type's default config), a local directory holding ``config.json`` (a
  config or a saved model), or a hub name (resolved from the local Hugging Face cache; where the
  hub is reachable it is downloaded the same way). ``config.NAME=VALUE`` task args override
  attributes of that config, converted to the type of the attribute they replace.
- ``init``: ``scratch`` (``AutoModelForCausalLM.from_config``, weights drawn from torch's RNG
  seeded by the run, so every process builds the same model) or ``pretrained``
  (``from_pretrained`` weights of ``model``).
- ``tokenizer``: a tokenizer directory or hub name; default ``DATA/tokenizer`` of a corpus made by
  ``ddloco data prepare``, else ``model``.
- ``data``: a directory made by ``ddloco data prepare`` (read by memory map), or raw files (a path
  or glob, tokenized on the fly through ``datasets`` streaming; ``text_field`` names the column of
  json/jsonl/parquet files). ``ddloco.data`` says how windows and streams are dealt.

A batch is a ``torch.long`` tensor ``[batch_size, seq_len + 1]``; the loss is the causal-LM
cross-entropy of the logits of ``[:, :-1]`` against ``[:, 1:]`` (mean over tokens, nats per token),
with SDPA attention; on CUDA the learner's ``--autocast auto`` (its default) runs the forward pass
under bf16 autocast (fp32 weights and optimizer; ``--autocast off``: fp32), on CPU fp32. The
held-out set is the first ``eval_batches`` batches of the corpus's fixed held-out windows
(``TokenCorpus.heldout_batches``); ``checkpointing=true`` turns on activation checkpointing.

Every problem with the inputs is a TaskError (one line) raised while the task is built: before
``ddloco up`` or a learner writes anything to Redis.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from common.task import Task, TaskError, hash_data
from common.task_args import parse_value

CONFIG_PREFIX = "config."
"""Task args named ``config.NAME`` override attribute NAME of the model's config."""
INITS = ("scratch", "pretrained")
SAMPLE_PROMPTS = 3
"""Greedy samples per evaluation (``Task.samples``): the first held-out windows' openings."""
SAMPLE_PROMPT_TOKENS = 8
"""Tokens of each held-out window used as a sample's prompt."""
SAMPLE_NEW_TOKENS = 32
"""Tokens each sample continues its prompt by (greedy)."""
SAMPLE_MARK = " || "
"""Between a sample's prompt and the model's continuation."""
IGNORED_CONFIG_KEYS = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache")
"""Left out of the config's hash: where it was read from and how it was saved or is used (the task
trains in fp32, without a KV cache), not what the model is."""


# ---------------------------------------------------------------------------- model config
def _coerce_override(name: str, raw: Any, current: Any) -> Any:
    """A ``config.NAME`` value as the type of the attribute it replaces (a string from the command
    line is parsed; a number from TOML is checked)."""
    kind = next((k.__name__ for k in (bool, int, float, str) if isinstance(current, k)), None)
    try:
        if isinstance(raw, str):
            return parse_value(raw, kind)
        accepted = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}.get(kind or "")
        if accepted and (not isinstance(raw, accepted) or (kind != "bool" and isinstance(raw, bool))):
            raise ValueError(f"expected {kind}, got {type(raw).__name__}")
        return float(raw) if kind == "float" else raw
    except ValueError as e:
        raise TaskError(f"task arg {CONFIG_PREFIX}{name}={raw!r}: {e} (the model config's {name} is "
                        f"{current!r})") from None


def _is_model_type(model: str) -> bool:
    from transformers import CONFIG_MAPPING
    return "/" not in model and not os.path.exists(model) and model in CONFIG_MAPPING


def resolve_config(model: str, overrides: dict[str, Any]) -> Any:
    """The model's ``PretrainedConfig``: ``model`` as a model type, a directory or a hub name in
    the local cache, with ``overrides`` (attribute name -> value) applied. TaskError otherwise."""
    from transformers import AutoConfig
    if not model:
        raise TaskError("task hf needs --task-arg model=NAME_OR_DIR (a model type such as llama, a directory "
                        "with config.json, or a hub name)")
    try:
        base = AutoConfig.for_model(model) if _is_model_type(model) else AutoConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TaskError(f"model {model!r} cannot be resolved offline: not a model type (llama, gpt2, qwen2, "
                        f"mistral, ...), a directory with config.json, or a hub name in the local cache "
                        f"({type(e).__name__}: {first})") from None
    unknown = sorted(k for k in overrides if not hasattr(base, k))
    if unknown:
        raise TaskError(f"task arg(s) {', '.join(CONFIG_PREFIX + k for k in unknown)}: {type(base).__name__} "
                        f"has no such attribute")
    values = {k: _coerce_override(k, v, getattr(base, k)) for k, v in overrides.items()}
    if not values:
        return base
    if _is_model_type(model):
        return AutoConfig.for_model(model, **values)   # derived attributes (head_dim) follow
    d = base.to_dict()
    if "head_dim" in d and "head_dim" not in values and d.get("num_attention_heads") and (
            "hidden_size" in values or "num_attention_heads" in values) and \
            d["head_dim"] == d["hidden_size"] // d["num_attention_heads"]:
        d["head_dim"] = None   # derived from the new sizes, as the config's constructor does
    try:
        return type(base).from_dict({**d, **values})
    except (ValueError, TypeError) as e:
        raise TaskError(f"model {model!r} with {_fmt(values)}: {e}") from None


def _fmt(values: dict[str, Any]) -> str:
    return ", ".join(f"{CONFIG_PREFIX}{k}={v!r}" for k, v in values.items())


def config_digest(config: Any) -> str:
    """16 hex digits identifying the model's architecture (its config, where it came from left out)."""
    d = {k: v for k, v in config.to_dict().items() if k not in IGNORED_CONFIG_KEYS}
    return hash_data(json.dumps(d, sort_keys=True, default=str).encode())


def max_positions(config: Any) -> int | None:
    """The longest sequence the model takes (``max_position_embeddings``), None if it names none."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


# ---------------------------------------------------------------------------- tokenizer
def load_tokenizer(tokenizer: str, data: str, model: str) -> tuple[Any, str]:
    """The run's tokenizer and where it came from: ``tokenizer``, else ``DATA/tokenizer``, else
    ``model`` (a saved model's directory or hub name)."""
    from transformers import AutoTokenizer
    source = tokenizer or (os.path.join(data, "tokenizer") if data and os.path.isdir(os.path.join(data, "tokenizer"))
                           else "")
    if not source and model and not _is_model_type(model):
        source = model
    if not source:
        raise TaskError("task hf needs --task-arg tokenizer=NAME_OR_DIR (data is not a prepared directory with a "
                        "tokenizer/ and model is a model type, which has no tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(source), source
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TaskError(f"tokenizer {source!r} cannot be loaded offline: not a tokenizer directory or a hub "
                        f"name in the local cache ({type(e).__name__}: {first})") from None


# ---------------------------------------------------------------------------- model
def embedding_names(model: nn.Module) -> tuple[str, ...]:
    """Names (as ``named_parameters`` shows them) of the input embedding and of an output head not
    tied to it: a tied head is one parameter, named once."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = []
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        weight = getattr(module, "weight", None)
        if weight is not None and id(weight) in by_id and by_id[id(weight)] not in names:
            names.append(by_id[id(weight)])
    return tuple(names)


def model_builder(config: Any, model: str, init: str, checkpointing: bool) -> Any:
    """``Task.model``: ``from_config`` (torch's RNG, seeded by the run) or ``from_pretrained``
    weights, fp32, SDPA attention, in train mode."""
    def build() -> nn.Module:
        from transformers import AutoModelForCausalLM
        if init == "pretrained":
            lm = AutoModelForCausalLM.from_pretrained(model, config=config, attn_implementation="sdpa",
                                                      dtype=torch.float32)
        else:
            lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        lm.config.use_cache = False    # training: no KV cache (samples turn it on for generation)
        if checkpointing:   # transformers 5 renamed gradient_checkpointing_enable (deprecated, removed in 6)
            (getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable)()
        return lm.train()
    return build


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross-entropy (nats per token): logits of ``batch[:, :-1]`` against ``batch[:, 1:]``,
    in fp32 (the learner's ``--autocast``, bf16 on CUDA by default, wraps the forward pass)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]   # (B, T), (B, T)
    logits = model(input_ids=inputs).logits         # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))  # (B*T, V), (B*T,)


def batch_tokens(batch: torch.Tensor) -> int:
    """Target tokens of a batch ``[B, seq_len + 1]``: B * seq_len."""
    return int(batch.shape[0] * (batch.shape[1] - 1))


def sample_texts(model: nn.Module, tokenizer: Any, prompts: torch.Tensor) -> list[str]:
    """``Task.samples``: each prompt (a row of ``prompts``, (N, P)) continued greedily by
    SAMPLE_NEW_TOKENS tokens, in one batch, as ``prompt || continuation`` text."""
    was_training = model.training
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.eval()
    try:
        with torch.no_grad():
            gen = model.generate(prompts.to(device), attention_mask=torch.ones_like(prompts, device=device),
                                 max_new_tokens=SAMPLE_NEW_TOKENS, do_sample=False, use_cache=True,
                                 pad_token_id=pad)   # (N, P + new)
    finally:
        model.train(was_training)
    return [tokenizer.decode(p.tolist()) + SAMPLE_MARK + tokenizer.decode(g[prompts.shape[1]:].tolist())
            for p, g in zip(prompts, gen.cpu())]


def save_hf(tokenizer: Any) -> Any:
    """``Task.save``: the model's config and safetensors weights, and the tokenizer's files, in one
    directory that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` open."""
    def save(model: nn.Module, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        use_cache = model.config.use_cache
        model.config.use_cache = True   # what a user loading it for generation wants
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()   # no progress bar in `up`'s output or the daemons' logs
        try:
            model.save_pretrained(out_dir)
        finally:
            model.config.use_cache = use_cache
        tokenizer.save_pretrained(out_dir)
    return save


# ---------------------------------------------------------------------------- the task
def _check_positive(**values: Any) -> None:
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TaskError(f"task arg {k} must be an int >= 1, got {v!r}")


def _check_fits(config: Any, tok: Any, tok_source: str, corpus: Any, seq_len: int, batch_size: int,
                eval_batches: int) -> None:
    """The bad inputs that need the config, the tokenizer and the corpus together."""
    from ddloco.data import tokenizer_hash
    longest = max_positions(config)
    if longest is not None and seq_len > longest:
        raise TaskError(f"seq_len={seq_len} is above the model's max_position_embeddings={longest} (lower seq_len "
                        f"or set --task-arg config.max_position_embeddings=...)")
    if len(tok) > config.vocab_size:
        raise TaskError(f"tokenizer {tok_source!r} has {len(tok):,} tokens, more than the model's embedding "
                        f"(vocab_size={config.vocab_size:,}); set --task-arg config.vocab_size={len(tok)} or "
                        f"use the model's tokenizer")
    if corpus.tokenizer_hash != tokenizer_hash(tok):
        raise TaskError(f"data {corpus.source}: its shards were made with another tokenizer (hash "
                        f"{corpus.tokenizer_hash}) than the run's {tok_source!r} (hash {tokenizer_hash(tok)}); "
                        f"prepare the data with this tokenizer or pass the one it was made with")
    windows = corpus.train_windows(seq_len)
    if windows < batch_size:
        raise TaskError(f"data {corpus.source}: its train split holds {windows} window(s) of seq_len+1="
                        f"{seq_len + 1} tokens, shorter than one batch of {batch_size}; add text or lower "
                        f"seq_len / batch_size")
    if not corpus.heldout_batches(batch_size, seq_len, 1):
        raise TaskError(f"data {corpus.source}: its held-out split is shorter than one window of seq_len+1="
                        f"{seq_len + 1} tokens")


def hf(*, model: str = "", tokenizer: str = "", data: str = "", seq_len: int = 256, batch_size: int = 8,
       text_field: str = "text", init: str = "scratch", streams: int = 16, eval_batches: int = 8,
       checkpointing: bool = False, **config: Any) -> Task:
    """Built-in ``hf``: a ``transformers`` causal LM (``model``, ``config.*`` overrides, ``init``)
    trained on ``data`` with ``tokenizer`` (module docstring)."""
    from ddloco.data import open_corpus
    from ddloco.data.tokenizer import require
    require("transformers")   # the [hf] extra: one line saying how to install it
    _check_positive(seq_len=seq_len, batch_size=batch_size, streams=streams, eval_batches=eval_batches)
    if init not in INITS:
        raise TaskError(f"task arg init must be one of {', '.join(INITS)}, got {init!r}")
    if init == "pretrained" and _is_model_type(model):
        raise TaskError(f"init=pretrained needs weights: model={model!r} is a model type (give a saved model's "
                        f"directory or hub name, or init=scratch)")
    bad = sorted(k for k in config if not k.startswith(CONFIG_PREFIX) or not k[len(CONFIG_PREFIX):].isidentifier())
    if bad:
        raise TaskError(f"task hf takes no task arg(s) {', '.join(bad)} (model config overrides are "
                        f"config.NAME=VALUE)")
    if not data:
        raise TaskError("task hf needs --task-arg data=DIR_OR_FILES (a directory made by `ddloco data prepare`, "
                        "or text/json/parquet files)")
    overrides = {k[len(CONFIG_PREFIX):]: v for k, v in config.items()}
    tok, tok_source = load_tokenizer(tokenizer, data, model)
    if _is_model_type(model) and init == "scratch":
        # a config built from a model type takes the tokenizer's vocabulary and special tokens
        overrides = {**_tokenizer_defaults(tok), **overrides}
    model_config = resolve_config(model, overrides)
    corpus = open_corpus(data, tok, text_field=text_field, streams=streams)
    _check_fits(model_config, tok, tok_source, corpus, seq_len, batch_size, eval_batches)
    eval_set = [torch.from_numpy(b) for b in corpus.heldout_batches(batch_size, seq_len, eval_batches)]
    prompts = eval_set[0][:SAMPLE_PROMPTS, :SAMPLE_PROMPT_TOKENS]   # (N, P): the first held-out windows' openings

    with torch.device("meta"):   # the parameter names, without allocating or drawing weights
        from transformers import AutoModelForCausalLM
        names = embedding_names(AutoModelForCausalLM.from_config(model_config))
    from ddloco.data import tokenizer_hash
    task_config = {"model": model_config.model_type, "model_config": config_digest(model_config), "init": init,
                   "config": dict(sorted(_applied(model_config, overrides).items())),
                   "seq_len": seq_len, "batch_size": batch_size, "streams": streams, "eval_batches": eval_batches,
                   "text_field": text_field, "vocab_size": int(model_config.vocab_size)}
    return Task(name="hf", model=model_builder(model_config, model, init, checkpointing),
                batches=corpus_batches(corpus, batch_size, seq_len), loss=lm_loss,
                eval_batches=lambda: iter(eval_set), embedding_names=names, tokens=batch_tokens,
                config=task_config, data_digest=hash_data(corpus.digest.encode(), tokenizer_hash(tok).encode()),
                data_source=f"{corpus.source}; tokenizer {tok_source}",
                save=save_hf(tok), samples=lambda m: sample_texts(m, tok, prompts))


def corpus_batches(corpus: Any, batch_size: int, seq_len: int) -> Any:
    """``Task.batches``: batch ``index`` of stream ``stream`` is the corpus's, found in O(1) (a restarted
    learner or a joiner resumes at its exact position)."""
    def batches(stream: int, seed: int, start: int) -> Iterator[torch.Tensor]:
        if start < 0:
            raise TaskError(f"start must be >= 0, got {start}")
        index = start
        while True:
            yield torch.from_numpy(corpus.train_batch(stream, seed, index, batch_size, seq_len))  # (B, T+1) long
            index += 1
    return batches


def _tokenizer_defaults(tok: Any) -> dict[str, Any]:
    """Config attributes a model type's default config takes from the tokenizer: its vocabulary
    size and special token ids (an explicit ``config.NAME`` still wins)."""
    out: dict[str, Any] = {"vocab_size": len(tok)}
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tok, attr, None)
        if value is not None:
            out[attr] = value
    return out


def _applied(model_config: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """The overridden attributes as the config now holds them (plain JSON values)."""
    return {k: getattr(model_config, k) for k in overrides
            if isinstance(getattr(model_config, k), (bool, int, float, str))}
