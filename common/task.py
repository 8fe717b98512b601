"""The task contract: what a user hands us to train their own model on their own data.

    from ddloco import Task

    def my_task(batch_size: int = 32) -> Task:
        return Task(name="mnist-cnn", model=Net, batches=my_batches, loss=my_loss,
                    eval_batches=my_heldout, config={"batch_size": batch_size})

A ``Task`` is plain data: six callables and a dict. Everything else (devices, fragments,
buffers, seeds, checkpoints, export) is ours. Every process of a run builds the task from the
same ``--task MODULE:ATTR`` and ``--task-arg`` values; the run is refused when ``name``,
``config`` or ``data_digest`` differ between processes.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Mapping

import torch
from torch import nn

# TaskError, parse_task_args and parse_value are re-exported here, their home before the split
from common.task_args import TaskError, _coerce_args, _fmt_args, parse_task_args, parse_value  # noqa: F401

if TYPE_CHECKING:
    import numpy as np

    from common.config import RunConfig


class TaskNotAllowed(TaskError):
    """The run's config names a task this machine does not allow to be imported (exit 2)."""


@dataclass(frozen=True)
class Task:
    """A model and its data, as every process of a run builds it."""

    name: str
    """Short name (logged, and part of the run config: processes with another name are refused)."""
    model: Callable[[], nn.Module]
    """Builds the model. Called with torch's global RNG seeded by the run seed, so plain
    ``nn.Module`` initialisation is reproducible; learners then adopt the shards' values."""
    batches: Callable[[int, int, int], Iterable[Any]]
    """``batches(stream, seed, start)``: training batches of data stream ``stream`` from batch
    index ``start``, deterministic for the three values (a restarted learner resumes exactly)."""
    loss: Callable[[nn.Module, Any], torch.Tensor]
    """``loss(model, batch)``: a differentiable scalar tensor."""
    eval_batches: Callable[[], Iterable[Any]] | None = None
    """Held-out batches; the global model's eval loss is their mean ``loss`` in ``eval()`` mode."""
    embedding_names: Collection[str] = ()
    """Parameter names (as in ``named_parameters``) merged by weighted average instead of RDA:
    embeddings and output heads tied to them. Names that are not parameters are refused."""
    tokens: Callable[[Any], int] | None = None
    """Tokens in a batch (the merge weights count them). Default: ``batch.tokens`` (attribute or
    key), else the first dimension of the first tensor in the batch."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The task's own settings, JSON-able; hashed into the run config with ``name``."""
    data_digest: str = ""
    """Identity of the data itself: ``hash_data(...)`` of the bytes the task loaded (its files, a
    library's bundled set, a download). Part of the run config: a process whose data hashes
    differently is refused even when ``name`` and ``config`` agree (another machine's files,
    another Python or library version). Give one whenever the data comes from outside your code;
    empty: the data is not checked (data generated from the seeds by your code needs none)."""
    data_source: str = ""
    """Where the data came from, for people (a path, a version); named when digests differ, not hashed."""
    recalibrate_bn_batches: int = 0
    """Batches of training data on which the final global model's normalization statistics
    (BatchNorm running mean and variance, any layer that tracks running statistics) are
    re-estimated before ``ddloco up`` reports and saves it and before ``ddloco export`` writes it
    (``common/running_stats.py``); 0: the merged statistics are kept. The merged statistics (a
    token-weighted average of the learners' own) belong to the learners' weights, not the merged
    ones; whether re-estimated ones score better depends on the model (README, "Bring your own
    model": on the example CNN, -0.036 to +0.012). Not part of the run config: training is the
    same either way."""
    save: Callable[[nn.Module, str], None] | None = None
    """``save(model, dir)``: write the trained model into directory ``dir`` in its own ecosystem's
    format (the ``hf`` task: ``save_pretrained`` of the model and its tokenizer). ``ddloco export
    --format hf`` and ``ddloco up --report DIR`` (into ``DIR/hf``) call it; None: no such format."""
    samples: Callable[[nn.Module], list[str]] | None = None
    """``samples(model)``: a few short texts the model writes (greedy continuations of held-out
    prompts), shown in ``ddloco up``'s report at each evaluation; None: none. Keep it cheap: it
    runs at every evaluation of the global model."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TaskError(f"Task.name must be a non-empty string, got {self.name!r}")
        for attr in ("data_digest", "data_source"):
            if not isinstance(getattr(self, attr), str):
                raise TaskError(f"Task.{attr} must be a string, got {type(getattr(self, attr)).__name__}")
        for attr in ("model", "batches", "loss"):
            if not callable(getattr(self, attr)):
                raise TaskError(f"Task.{attr} must be callable, got {type(getattr(self, attr)).__name__}")
        for attr in ("eval_batches", "tokens", "save", "samples"):
            value = getattr(self, attr)
            if value is not None and not callable(value):
                raise TaskError(f"Task.{attr} must be callable or None, got {type(value).__name__}")
        n = self.recalibrate_bn_batches
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TaskError(f"Task.recalibrate_bn_batches must be an int >= 0, got {n!r}")
        if isinstance(self.embedding_names, str):
            raise TaskError("Task.embedding_names must be a collection of names, not one string")
        try:
            json_config(self.config)
        except TypeError as e:
            raise TaskError(f"Task.config must be a JSON-able dict: {e}") from None


def hash_data(*parts: Any) -> str:
    """A ``Task.data_digest``: the first 16 hex digits of the SHA-256 of ``parts`` in order (bytes,
    numpy arrays, torch tensors), hashed as they already are in memory (no second read)."""
    import hashlib

    import numpy as np
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            part = part.detach().cpu().contiguous().numpy()
        if isinstance(part, np.ndarray):
            part = np.ascontiguousarray(part)
        h.update(part)
    return h.hexdigest()[:16]


def json_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as plain JSON types (what the run config hashes); TypeError if it is not."""
    import json
    if not isinstance(config, Mapping):
        raise TypeError(f"expected a dict, got {type(config).__name__}")
    return json.loads(json.dumps(dict(config), sort_keys=True))


# ---------------------------------------------------------------------------- loading
BUILTIN: dict[str, str] = {
    "gpt": "ddloco.tasks.gpt:gpt",
    "gpt-moe": "ddloco.tasks.gpt:gpt_moe",
    "text": "ddloco.tasks.gpt:text",
    "digits": "ddloco.tasks.digits:digits",
    "hf": "ddloco.tasks.hf:hf",
}
"""Short names of the built-in tasks and where they live."""

MOVED: dict[str, str] = {"tasks.gpt:gpt": "gpt", "tasks.gpt:gpt_moe": "gpt-moe", "tasks.gpt:text": "text",
                         "tasks.digits:digits": "digits"}
"""Built-in specs as runs before the move under ``ddloco.tasks`` stored them (old checkpoints)."""


ALLOWED_ENV = "DDLOCO_TASKS_ALLOWED"
"""The environment variable (read by entry points only) listing ``MODULE:ATTR`` specs, comma
separated, that a process may load when the run's config names them (``allow_tasks``)."""

_allowed_specs: frozenset[str] = frozenset()
"""Specs this process allows besides the built-ins; set once by its entry point (``allow_tasks``)."""


def allow_tasks(specs: Iterable[str]) -> None:
    """Let this process load these task specs when a run's config (from Redis or a checkpoint, so
    written by any member) names them; the built-ins are always allowed. Entry points call it with
    their own ``--task`` / config file's spec and ``DDLOCO_TASKS_ALLOWED``; nothing read from Redis
    ever reaches it."""
    global _allowed_specs
    _allowed_specs = _allowed_specs | {s.strip() for s in specs if s and s.strip()}


def task_allowed(spec: str) -> bool:
    """Whether ``spec`` may be imported when a run's config names it: a built-in (short name or
    its ``MODULE:ATTR``), or a spec this process allowed (``allow_tasks``)."""
    return spec in BUILTIN or spec in BUILTIN.values() or spec in MOVED or spec in _allowed_specs


def check_run_task(spec: str, args: Mapping[str, Any]) -> None:
    """Refuse (TaskNotAllowed, one line) a task spec from a run's config that this machine does
    not allow, before anything is imported; its args must be plain values (str, int, float,
    bool: converted by the callable's declared types, never imported or evaluated)."""
    if not task_allowed(spec):
        raise TaskNotAllowed(
            f"refused to import the run's task {spec!r}: the run config (in Redis, writable by any member) "
            f"names it, and this machine imports only built-in tasks and the ones it names itself; if you "
            f"trust it, pass --task {spec} or set {ALLOWED_ENV}={spec}")
    bad = sorted(k for k, v in args.items() if not isinstance(k, str) or not isinstance(v, (str, int, float, bool)))
    if bad:
        raise TaskNotAllowed(f"refused the run's task args {', '.join(map(str, bad))} of {spec!r}: a task arg "
                             f"from the run config must be a string, number or boolean")


def load_task(spec: str, args: Mapping[str, Any] | None = None) -> Task:
    """The task named by ``spec``: a built-in short name or ``MODULE:ATTR``.

    ATTR is a ``Task`` (then ``args`` must be empty) or a callable returning one, called with
    ``args`` as keyword arguments. MODULE is imported from the current directory or PYTHONPATH.
    """
    args = dict(args or {})
    target = BUILTIN.get(MOVED.get(spec, spec), spec)
    if ":" not in target:
        raise TaskError(f"task {spec!r} is neither a built-in ({', '.join(sorted(BUILTIN))}) nor MODULE:ATTR")
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time error of the user's module
        raise TaskError(f"cannot import task module {module_name!r}: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"task module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, Task):
        if args:
            raise TaskError(f"{target} is a Task, not a callable: it takes no task args (got {sorted(args)})")
        return obj
    if not callable(obj):
        raise TaskError(f"{target} is a {type(obj).__name__}, not a Task or a callable returning one")
    args = _coerce_args(obj, args, target)
    try:
        task = obj(**args)
    except TaskError as e:   # the task's own one line: named by where it came from, not all its args
        raise TaskError(f"{target}: {e}") from None
    except (TypeError, ValueError) as e:
        raise TaskError(f"{target}({_fmt_args(args)}) failed: {e}") from None
    if not isinstance(task, Task):
        raise TaskError(f"{target}({_fmt_args(args)}) returned a {type(task).__name__}, not a Task")
    return task


def indexed_batches(draw: Callable[["np.random.Generator"], Any], *, max_stream: int = 2**31 - 2
                    ) -> Callable[[int, int, int], Iterable[Any]]:
    """A ``Task.batches`` whose batch k of (stream, seed) is ``draw(rng)`` with ``rng`` seeded by
    ``(seed, stream, k)`` alone, so starting at any ``start`` is exact (a restarted learner
    resumes its stream). Streams above ``max_stream`` are refused (keep one for held-out data)."""
    import numpy as np

    def batches(stream: int, seed: int, start: int) -> Iterable[Any]:
        if not 0 <= stream <= max_stream:
            raise TaskError(f"stream must be in [0, {max_stream}], got {stream}")
        if start < 0:
            raise TaskError(f"start must be >= 0, got {start}")
        step = start
        while True:
            yield draw(np.random.default_rng([seed, stream, step]))
            step += 1
    return batches


# ---------------------------------------------------------------------------- using a task
_BUILD_LOCK = threading.Lock()
"""Builds seed torch's one global RNG: shards and learners running as threads of one process
(the Python API) must not interleave their draws."""


def build_model(task: Task, seed: int, *, device: torch.device | str | None = None) -> nn.Module:
    """``task.model()`` with torch's global RNG seeded by ``seed`` (and restored afterwards).
    ``device``: tensors the model creates are created there (``torch.device`` as a context): a
    CUDA learner's model never exists on the host (a 1 B-parameter model cost the learner 4 GB of
    peak RSS there); its values come from the shards at join. None: the CPU, as the shards build it."""
    import contextlib
    place = torch.device(device) if device is not None else contextlib.nullcontext()
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]), place:
        torch.manual_seed(seed)
        model = task.model()
    if not isinstance(model, nn.Module):
        raise TaskError(f"task {task.name!r}: model() returned a {type(model).__name__}, not an nn.Module")
    return model


def stray_tensors(model: nn.Module, device: torch.device | str) -> list[str]:
    """Names of ``model``'s parameters and buffers that are not on ``device`` (a device without an
    index matches any index of its type). A model built inside ``torch.device(...)`` can still
    make some on the CPU: ``torch.nn.utils.skip_init`` and explicit ``device=`` arguments ignore
    the context."""
    device = torch.device(device)
    named = list(model.named_parameters()) + list(model.named_buffers())
    return [name for name, t in named
            if t.device.type != device.type or (device.index is not None and t.device.index != device.index)]


def count_tokens(task: Task, batch: Any) -> int:
    """Tokens in ``batch``: ``task.tokens(batch)``, else a ``tokens`` attribute or key, else the
    first dimension of the first tensor found. TaskError when none applies."""
    if task.tokens is not None:
        n = task.tokens(batch)
    elif hasattr(batch, "tokens") and not callable(batch.tokens):
        n = batch.tokens
    elif isinstance(batch, Mapping) and "tokens" in batch:
        n = batch["tokens"]
    else:
        first = _first_tensor(batch)
        if first is None or first.dim() == 0:
            raise TaskError(f"task {task.name!r}: cannot count tokens of a {type(batch).__name__} batch "
                            "(give Task(tokens=...), or a batch with a 'tokens' field or a leading batch dimension)")
        n = first.shape[0]
    if isinstance(n, torch.Tensor):
        n = n.item()
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0 or n != int(n):
        raise TaskError(f"task {task.name!r}: token count must be a non-negative integer, got {n!r}")
    return int(n)


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for x in batch:
            found = _first_tensor(x)
            if found is not None:
                return found
    return None


def batch_to(batch: Any, device: torch.device) -> Any:
    """Move a batch's tensors to ``device``: tensors, dataclasses, tuples, lists, dicts."""
    if device.type == "cpu" and not _has_non_cpu(batch):
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: batch_to(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(batch_to(x, device) for x in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_to(x, device) for x in batch)
    if isinstance(batch, dict):
        return {k: batch_to(v, device) for k, v in batch.items()}
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


def _has_non_cpu(batch: Any) -> bool:
    t = _first_tensor(batch)
    return t is not None and t.device.type != "cpu"


def scalar_loss(task: Task, model: nn.Module, batch: Any) -> torch.Tensor:
    """``task.loss(model, batch)``, checked to be a scalar tensor (TaskError otherwise)."""
    loss = task.loss(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TaskError(f"task {task.name!r}: loss(model, batch) must return a scalar tensor, got {what}")
    return loss.reshape(())


def evaluate(task: Task, model: nn.Module) -> float:
    """Mean loss over ``task.eval_batches()`` in ``eval()`` mode, without gradients (the model's
    mode is restored). TaskError when the task has no held-out batches."""
    if task.eval_batches is None:
        raise TaskError(f"task {task.name!r} has no eval_batches: the global model cannot be evaluated")
    was_training = model.training
    device = next(iter(model.parameters()), torch.empty(0)).device
    model.eval()
    total, n = 0.0, 0
    try:
        with torch.no_grad():
            for batch in task.eval_batches():
                total += float(scalar_loss(task, model, batch_to(batch, device)))
                n += 1
    finally:
        model.train(was_training)
    if n == 0:
        raise TaskError(f"task {task.name!r}: eval_batches() yielded nothing")
    return total / n


def check_task(task: Task, model: nn.Module, *, seed: int, stream: int = 0) -> int:
    """Dry run of the contract on one batch, before anything is written anywhere: the batch has
    a countable size and the loss is a finite scalar. Returns the batch's token count."""
    try:
        batch = next(iter(task.batches(stream, seed, 0)))
    except StopIteration:
        raise TaskError(f"task {task.name!r}: batches({stream}, {seed}, 0) yielded nothing") from None
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(f"task {task.name!r}: batches({stream}, {seed}, 0) raised {type(e).__name__}: {e}") from None
    tokens = count_tokens(task, batch)
    if tokens <= 0:
        raise TaskError(f"task {task.name!r}: a training batch counts {tokens} tokens (must be > 0)")
    # eval() mode: a train() forward would update buffers (BatchNorm statistics); no copy of the model
    was_training = model.training
    device = next(iter(model.parameters()), torch.empty(0)).device
    try:
        model.eval()
        with torch.no_grad():
            value = float(scalar_loss(task, model, batch_to(batch, device)))
    except TaskError:
        raise
    except Exception as e:  # the user's forward or loss on the first batch
        raise TaskError(f"task {task.name!r}: loss(model, first batch) raised {type(e).__name__}: {e}") from None
    finally:
        model.train(was_training)
    if not math.isfinite(value):
        raise TaskError(f"task {task.name!r}: the loss of the initial model on the first batch is {value}")
    return tokens


def describe_data_difference(run_digest: str, run_source: str, digest: str, source: str) -> str:
    """The refusal of a process whose data is not the run's: both digests and where each came from."""
    return (f"data digest differs: run has {run_digest}, this process has {digest or 'none'} "
            f"(its data: {source or 'not described'}; the run's: {run_source or 'not recorded'})")


def bind_task(run: "RunConfig", task: Task | None = None, *, shared: bool = False) -> tuple[Task, "RunConfig"]:
    """The run's task, and ``run`` with the task's name, config and data digest filled in.

    ``task`` None loads ``run.task.spec`` with ``run.task.args``; ``shared``: ``run`` was read from
    where any member can write (Redis), so the spec is loaded only if this machine allows it
    (``check_run_task``: TaskNotAllowed otherwise, nothing imported), and with a ``task`` given a
    spec it does not allow is left out of the bound run (nothing this process records, e.g. its
    checkpoints, carries a spec it did not trust). When ``run`` already names a
    task (it came from Redis or a checkpoint), the loaded one must report the same name, config
    and data digest (when the run recorded one): TaskError names what differs.
    """
    given = task is not None
    if task is None:
        if not run.task.spec:
            raise TaskError("the run's task was handed over as a Python object (no task spec in its config); "
                            "give this process the same Task, or --task MODULE:ATTR")
        if shared:
            check_run_task(run.task.spec, run.task.args)
        task = load_task(run.task.spec, run.task.args)
    config = json_config(task.config)
    want = run.task
    if want.name and want.name != task.name:
        raise TaskError(f"task name {task.name!r} differs from the run's {want.name!r}")
    problems = []
    if want.name and want.config != config:
        keys = sorted(set(config) | set(want.config))
        diff = [f"{k}={config.get(k)!r} (run has {want.config.get(k)!r})" for k in keys
                if config.get(k) != want.config.get(k)]
        problems.append(f"task {task.name!r} config differs from the run's: {', '.join(diff)}")
    if want.name and want.data_digest and want.data_digest != task.data_digest:
        # a run that recorded no digest (a task without one, or older code) is not checked
        problems.append(describe_data_difference(want.data_digest, want.data_source, task.data_digest,
                                                 task.data_source))
    if problems:
        raise TaskError("; ".join(problems))
    bound = dataclasses.replace(want, name=task.name, config=config, data_source=task.data_source,
                                data_digest=want.data_digest if want.name else task.data_digest)
    if given and shared and bound.spec and not task_allowed(bound.spec):
        # the run's spec (from Redis) was not checked here, as this process brought its own task:
        # it is not recorded as ours (a checkpoint of this process never carries an unchecked spec)
        bound = dataclasses.replace(bound, spec="")
    if given and not want.name and want.spec == "gpt" and task.name != "gpt":
        # a Task object with the default spec: no spec says how to load it (a process joining
        # without a task is told so); set run.task.spec to its MODULE:ATTR to let such processes in
        bound = dataclasses.replace(bound, spec="")
    return task, dataclasses.replace(run, task=bound)
