"""The trained global model out of a run: from the live shards or from their checkpoints.

    ddloco export --redis-url redis://host:6379/0 --run-id exp1 --out model.safetensors
    ddloco export --checkpoint-dir runs/exp1-20261122-101500/checkpoints --out model.safetensors
    ddloco export ... --recalibrate-bn 50   # BatchNorm statistics re-estimated on 50 training batches
    ddloco export ... --format hf --out DIR   # the task's own format (Task.save): for --task hf a directory
                                              # that AutoModelForCausalLM/AutoTokenizer.from_pretrained open

    model = ddloco.load_global_model(redis_url=..., run_id="exp1")       # an nn.Module
    model = ddloco.load_global_model(checkpoint_dir="...")

The file holds the model's full ``state_dict`` (parameters and buffers, tied tensors under every
name), loadable with ``strict=True`` into a fresh ``task.model()``. safetensors is the default
format (no pickle: safe to load from anyone); ``pt`` is ``torch.save`` of the state dict.

``--recalibrate-bn N`` (default: the task's ``recalibrate_bn_batches``) re-estimates the running
statistics of the model's normalization layers on N training batches (``common/running_stats.py``):
the merged statistics do not belong to the merged weights.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from common import control
from common import exits
from common.config import RunConfig, run_config_from_dict
from common.files import atomic_path
from common.fragments import Fragment, model_plan, scatter, state_tensors
from common.keys import Keys
from common.task import Task, TaskError, bind_task, build_model
from common.running_stats import recalibrate
from syncer.checkpoints import load_checkpoint_file

FORMATS = ("safetensors", "pt", "hf")
"""``hf``: the task's own format (``Task.save``), a directory; the others: a state dict file."""


class ExportError(RuntimeError):
    """The global model cannot be assembled (no shards, missing checkpoints); says why."""


def _assemble(run: RunConfig, task: Task | None, values: dict[int, torch.Tensor], *, recalibrate_bn: int | None = 0,
              say: Callable[[str], None] | None = None, shared: bool = True,
              on_task: Callable[[Task], None] | None = None) -> torch.nn.Module:
    task, run = bind_task(run, task, shared=shared)   # a run from Redis: its spec must be allowed here
    if on_task is not None:
        on_task(task)   # e.g. refuse --format hf for a task without save, before building anything
    model = build_model(task, run.task.seed)
    plan: tuple[Fragment, ...] = model_plan(model, task.embedding_names, run.algo.fragments)
    missing = sorted(set(range(len(plan))) - set(values))
    if missing:
        raise ExportError(f"fragments {missing[:10]}{' ...' if len(missing) > 10 else ''} of {len(plan)} are missing")
    tensors = state_tensors(model)
    for p, frag in enumerate(plan):
        scatter(tensors, frag, values[p])
    _recalibrate(model, task, run.task.seed, recalibrate_bn, say)
    return model.eval()


def _recalibrate(model: torch.nn.Module, task: Task, seed: int, batches: int | None,
                 say: Callable[[str], None] | None) -> None:
    """``batches`` (None: the task's ``recalibrate_bn_batches``) of recalibration; ``say`` is told what was done."""
    n = task.recalibrate_bn_batches if batches is None else batches
    if n < 0:
        raise ExportError(f"--recalibrate-bn must be >= 0, got {n}")
    if n > 0:
        done = recalibrate(task, model, seed=seed, batches=n)
        if say is not None:
            say(done.describe() if done.layers else f"note: {done.describe()} (--recalibrate-bn {n} has no effect)")


def from_live_run(redis_url: str, run_id: str, *, task: Task | None = None, timeout_s: float = 30.0,
                  keys_dir: str = "", run_wait_s: float = 0.0, recalibrate_bn: int | None = 0,
                  say: Callable[[str], None] | None = None,
                  on_task: Callable[[Task], None] | None = None) -> tuple[torch.nn.Module, dict[int, int]]:
    """The global model as the running shards hold it now, and each fragment's version.
    ``keys_dir``: the run's CURVE keys (this reads as the ``monitor`` member). A run id not in
    Redis raises RunConfigMissing at once, naming the runs that are there; ``run_wait_s`` waits
    that long for it first (a run this program is starting); ``timeout_s`` bounds the wait for
    the shards' answers. ``recalibrate_bn``: batches to re-estimate normalization statistics on
    (None: the task's own setting; 0: none); ``on_task`` is called with the run's task once bound."""
    from common.rpc import fetch_fragments
    from common.security import Security
    security = Security(keys_dir, "monitor") if keys_dir else None
    r = control.connect(redis_url)
    keys = Keys(run_id)
    try:
        run = control.fetch_run_config(r, keys, wait_s=run_wait_s, redis_url=redis_url)
        task, run = bind_task(run, task, shared=True)
        if on_task is not None:
            on_task(task)
        n = run.algo.fragments
        try:
            frags = fetch_fragments(r, keys, n, timeout_s=timeout_s, sender="export", security=security)
        except TimeoutError as e:
            raise ExportError(f"{e} (are the run's syncers up?)") from None
    finally:
        r.close()
    return (_assemble(run, task, {p: v for p, (_, v) in frags.items()}, recalibrate_bn=recalibrate_bn, say=say,
                      on_task=on_task),
            {p: v for p, (v, _) in frags.items()})


def checkpoint_files(checkpoint_dir: str | Path, run_id: str | None = None) -> tuple[str, list[Path]]:
    """The run id and its shard checkpoints ``<run>-shard<k>of<S>.pt`` in ``checkpoint_dir``,
    ordered by k; ExportError when shards are missing or several runs are there."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        raise ExportError(f"checkpoint directory {d} does not exist")
    found: dict[str, dict[int, tuple[int, Path]]] = {}
    for path in d.glob("*-shard*of*.pt"):
        stem = path.name[:-3]
        run, _, tail = stem.rpartition("-shard")
        k, _, s = tail.partition("of")
        if k.isdigit() and s.isdigit():
            found.setdefault(run, {})[int(k)] = (int(s), path)
    if run_id is not None:
        found = {run_id: found[run_id]} if run_id in found else {}
    if not found:
        raise ExportError(f"no shard checkpoints{f' of run {run_id!r}' if run_id else ''} in {d}")
    if len(found) > 1:
        raise ExportError(f"checkpoints of several runs in {d}: {sorted(found)}; pass --run-id")
    (run, shards), = found.items()
    total = {s for s, _ in shards.values()}
    if len(total) != 1:
        raise ExportError(f"run {run!r} has checkpoints of different shard counts {sorted(total)} in {d}")
    (count,) = total
    missing = sorted(set(range(count)) - set(shards))
    if missing:
        raise ExportError(f"run {run!r}: checkpoints of shard(s) {missing} of {count} are missing in {d}")
    return run, [shards[k][1] for k in range(count)]


def from_checkpoints(checkpoint_dir: str | Path, run_id: str | None = None, *, task: Task | None = None,
                     recalibrate_bn: int | None = 0, say: Callable[[str], None] | None = None,
                     on_task: Callable[[Task], None] | None = None) -> tuple[torch.nn.Module, dict[int, int]]:
    """The global model as the shards' last checkpoints hold it, and each fragment's version
    (``recalibrate_bn``, ``say``, ``on_task``: as for ``from_live_run``)."""
    _, paths = checkpoint_files(checkpoint_dir, run_id)
    values: dict[int, torch.Tensor] = {}
    versions: dict[int, int] = {}
    run: RunConfig | None = None
    for path in paths:
        try:
            state = load_checkpoint_file(path)     # its values checked against their digests
            this = run_config_from_dict(state["run_config"])
            fragments = state["fragments"]
        except Exception as e:  # a corrupt or foreign file: unpickling, missing keys, an older config
            first = (str(e).splitlines() or [""])[0][:160]
            raise ExportError(f"{path} is not a readable shard checkpoint of this version ({type(e).__name__}: "
                              f"{first}); a checkpoint from before the task contract cannot be exported") from None
        if run is not None and this.digest() != run.digest():
            raise ExportError(f"{path} belongs to another run config than {paths[0]}")
        run = this
        for p, fs in fragments.items():
            values[int(p)] = fs["theta"]
            versions[int(p)] = int(fs["version"])
    assert run is not None
    # a shard's checkpoint is the operator's file, and a shard records only a task spec it trusted
    # (its own, a built-in or one allowed on its machine: common.task.bind_task)
    return (_assemble(run, task, values, recalibrate_bn=recalibrate_bn, say=say, shared=False, on_task=on_task),
            versions)


def save_state(model: torch.nn.Module, path: str | Path, fmt: str = "safetensors") -> Path:
    """Write ``model.state_dict()`` atomically (temp file, then rename)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format must be one of {FORMATS}, got {fmt!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one contiguous CPU copy per name: tied tensors appear under each of their names
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        if fmt == "safetensors":
            from safetensors.torch import save_file
            save_file(state, str(tmp))
        else:
            torch.save(state, tmp)
    return path


def check_saves(task: Task) -> None:
    """ConfigError (one line) when ``task`` has no ``save`` hook: ``--format hf`` is refused."""
    from common.config import ConfigError
    if task.save is None:
        raise ConfigError(f"--format hf: task {task.name!r} has no save hook (Task.save); it exports as "
                          f"safetensors or pt (a state dict for task.model())")


def save_task_format(model: torch.nn.Module, task: Task, out_dir: str | Path) -> Path:
    """The model in its task's own format (``task.save``) in directory ``out_dir`` (created)."""
    check_saves(task)
    assert task.save is not None
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir}: a file; --format hf writes a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    task.save(model, str(out_dir))
    return out_dir


def save_for_report(model: torch.nn.Module, task: Task, out_dir: Path) -> bool:
    """``up --report``'s copy in the task's own format: whether it was written (a task without
    ``save`` has none; a failing ``save`` is one line on stderr, the report is kept)."""
    if task.save is None:
        return False
    try:
        save_task_format(model, task, out_dir)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"ddloco up: {out_dir}: the task could not save the model: {e}", file=sys.stderr, flush=True)
        return False
    return True


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict written by ``save_state`` (either format, by suffix)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(path, weights_only=True)


def load_global_model(*, redis_url: str | None = None, run_id: str | None = None,
                      checkpoint_dir: str | Path | None = None, task: Task | None = None,
                      wait_s: float = 30.0, recalibrate_bn: int | None = None) -> torch.nn.Module:
    """The run's global model as an ``nn.Module`` (``eval()`` mode): from the live shards
    (``redis_url`` + ``run_id``; waits up to ``wait_s`` for the run to appear, as for shards
    this program has just started) or from the shards' checkpoints (``checkpoint_dir``), its
    normalization statistics re-estimated on ``recalibrate_bn`` training batches (None: the task's
    ``recalibrate_bn_batches``, as ``ddloco up`` saves it; 0: the merged statistics)."""
    if checkpoint_dir is not None:
        return from_checkpoints(checkpoint_dir, run_id, task=task, recalibrate_bn=recalibrate_bn)[0]
    if redis_url is None or run_id is None:
        raise ExportError("give redis_url and run_id (a live run) or checkpoint_dir (a stopped one)")
    return from_live_run(redis_url, run_id, task=task, run_wait_s=wait_s, recalibrate_bn=recalibrate_bn)[0]


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="ddloco export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output file, e.g. model.safetensors (a directory for --format hf)")
    ap.add_argument("--format", choices=FORMATS, default=None,
                    help="safetensors (default; .pt files default to pt), pt (torch.save of the state dict) or hf "
                    "(the task's own format in directory --out: for --task hf config.json, model.safetensors and "
                    "the tokenizer's files, loaded by AutoModelForCausalLM/AutoTokenizer.from_pretrained)")
    src = ap.add_argument_group("source: a live run, or a stopped one's checkpoints")
    src.add_argument("--redis-url", help="the live run's Redis (env DDLOCO_REDIS_URL)")
    src.add_argument("--run-id", help="the run (required with --redis-url; picks one run in --checkpoint-dir)")
    src.add_argument("--keys", default=os.environ.get("DDLOCO_KEYS", ""), metavar="DIR",
                     help="a live run's CURVE keys (env DDLOCO_KEYS): read as the monitor member")
    src.add_argument("--broker-pub", "--broker-sub", dest="_broker", help=argparse.SUPPRESS)  # accepted, unused
    src.add_argument("--task", help="the run's task as MODULE:ATTR, when its config has no spec (a run started "
                     "from Python with a Task object); default: the spec in the run's config")
    src.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="argument of --task")
    src.add_argument("--checkpoint-dir", help="the shards' checkpoint directory (runs/<run>-<time>/checkpoints "
                     "for `ddloco up`)")
    ap.add_argument("--recalibrate-bn", type=int, default=None, metavar="N",
                    help="re-estimate the running statistics of BatchNorm (any normalization layer that tracks "
                    "them) on N training batches of stream 2**31-2 under the run's seed, in train mode without "
                    "gradients; parameters unchanged. Default: the task's recalibrate_bn_batches; 0: keep the "
                    "merged statistics")
    args = ap.parse_args(list(argv))
    if args.recalibrate_bn is not None and args.recalibrate_bn < 0:
        print(f"ddloco export: --recalibrate-bn must be >= 0, got {args.recalibrate_bn}", file=sys.stderr)
        return exits.USAGE
    fmt = args.format or ("pt" if args.out.endswith(".pt") else "safetensors")
    url_source = "--redis-url" if args.redis_url else "DDLOCO_REDIS_URL"
    args.redis_url = args.redis_url or os.environ.get("DDLOCO_REDIS_URL") or None
    import redis
    from common.config import ConfigError, check_value, redis_url_problem
    from common.command import check_redis_answers
    from common.exits import FAILURE as EXIT_FAILURE, USAGE as EXIT_USAGE
    from common.task import ALLOWED_ENV, TaskNotAllowed, allow_tasks, load_task, parse_task_args
    from common.security import SecurityError
    allow_tasks(os.environ.get(ALLOWED_ENV, "").split(","))   # this machine's own list, never Redis
    bound: list[Task] = []   # the run's task, once bound (--format hf saves through it)

    def on_task(t: Task) -> None:
        if fmt == "hf":
            check_saves(t)
        bound.append(t)
    try:
        task = load_task(args.task, parse_task_args(args.task_arg)) if args.task else None
        if args.checkpoint_dir:
            model, versions = from_checkpoints(args.checkpoint_dir, args.run_id, task=task,
                                               recalibrate_bn=args.recalibrate_bn, say=print, on_task=on_task)
        elif args.redis_url and args.run_id:
            check_value(url_source, args.redis_url, redis_url_problem)
            check_redis_answers(args.redis_url, url_source)   # as status: one line, exit 2
            model, versions = from_live_run(args.redis_url, args.run_id, task=task, keys_dir=args.keys,
                                            recalibrate_bn=args.recalibrate_bn, say=print, on_task=on_task)
        else:
            print("ddloco export: give --checkpoint-dir, or --redis-url and --run-id", file=sys.stderr)
            return EXIT_USAGE
        path = save_task_format(model, bound[0], args.out) if fmt == "hf" else save_state(model, args.out, fmt)
    except (ConfigError, control.RunConfigMissing, SecurityError, TaskNotAllowed) as e:   # the user's input
        print(f"ddloco export: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ExportError, TaskError) as e:
        print(f"ddloco export: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except redis.RedisError as e:
        print(f"ddloco export: Redis at {control.redact(args.redis_url)} failed: {e}", file=sys.stderr)
        return EXIT_FAILURE
    n = sum(t.numel() for t in state_tensors(model).values())
    print(f"exported   {path} ({fmt}): {len(model.state_dict())} tensors, {n:,} values, fragment versions "
          f"{min(versions.values())}-{max(versions.values())} (sum {sum(versions.values())})")
    return exits.OK
