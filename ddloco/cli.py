"""`ddloco`: the command-line front end (the only code that reads argv).

    ddloco up       a whole local cluster (Redis, broker, S shards, M learners) + report
    ddloco status   live view of a run from Redis
    ddloco keys     CurveZMQ key pairs for a run's members (the allow list)
    ddloco broker   the ZeroMQ forwarder daemon
    ddloco syncer   one syncer shard daemon
    ddloco learner  one learner daemon (--task: a built-in or your MODULE:ATTR)
    ddloco sim      goodput simulator at paper scale
    ddloco bench    micro benchmarks of the hot paths
    ddloco compare  quality: DDP, one learner, sync DiLoCo, our cluster at equal tokens, seeds
    ddloco export   the global model of a live or stopped run as a safetensors / torch file
    ddloco chaos    seeded failures injected into a running cluster, and what they cost
    ddloco fuzz     seeded random and mutated frames thrown at a running cluster's endpoints

Exit codes: 0 success, 1 runtime failure, 2 bad usage or config, 3 refused by the run.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from common.config import (AlgoConfig, ConfigError, ConfigFile, Endpoints, LearnerOptions, SyncerOptions,
                           TaskConfig, check_value, endpoint_problem, load_config, override, redis_url_problem)
from common.exits import FAILURE as EXIT_FAILURE
from common.exits import REFUSED as EXIT_REFUSED
from common.exits import USAGE as EXIT_USAGE


def _add_common(p: argparse.ArgumentParser, command: str = "") -> None:
    """The cluster flags; ``command`` tailors what they say (a flag a command accepts but does not
    use is hidden from its --help)."""
    hidden = argparse.SUPPRESS
    g = p.add_argument_group("cluster")
    g.add_argument("--config", metavar="FILE.toml", help="TOML config file (sections task, algo, endpoints, "
                   "learner, syncer, up); flags override it")
    g.add_argument("--run-id", help="with --redis-url: write the broker's counters to this run's entry in Redis"
                   if command == "broker" else "run identifier (namespaces Redis keys, messages and the work "
                   "directory runs/RUN_ID-<time>; default: a new one, demo-<6 hex digits>)" if command == "up"
                   else "run identifier (namespaces Redis keys and messages; default demo)")
    redis_default = {"up": "default: an embedded Redis", "broker": "used with --run-id only"}.get(
        command, "default redis://127.0.0.1:6379/0")
    g.add_argument("--redis-url", help="Redis URL, e.g. redis://host:6379/0, redis://user:password@host:6379/0 or "
                   f"rediss://... (TLS); env DDLOCO_REDIS_URL keeps a password off the command line ({redis_default})")
    g.add_argument("--keys", metavar="DIR", help=hidden if command == "status" else
                   "not used by up: it makes a key pair per member in runs/<run>/keys" if command == "up" else
                   "CurveZMQ keys made by `ddloco keys` (env DDLOCO_KEYS): this member's secret and the run's "
                   "allow list")
    g.add_argument("--insecure", action="store_true", help=hidden if command == "status" else
                   "no CURVE authentication or encryption (env DDLOCO_INSECURE=1); logged. Without it a daemon "
                   "refuses to start with no --keys")
    if command == "up":
        pub_help = ("endpoint the broker binds for publishers (its XSUB) and every learner and shard publishes "
                    "to, e.g. tcp://127.0.0.1:5555 (default: a free port on 127.0.0.1; a port in use is refused)")
        sub_help = ("endpoint the broker binds for subscribers (its XPUB) and every learner and shard "
                    "subscribes at, e.g. tcp://127.0.0.1:5556 (default: a free port on 127.0.0.1)")
    elif command in ("status", "broker"):   # status reads Redis only; the broker binds --xsub / --xpub
        pub_help = sub_help = hidden
    else:
        pub_help = "the broker's XSUB endpoint, where this process publishes, e.g. tcp://host:5555 (default port 5555)"
        sub_help = "the broker's XPUB endpoint, where this process subscribes, e.g. tcp://host:5556 (default port 5556)"
    g.add_argument("--broker-pub", metavar="ENDPOINT", help=pub_help)
    g.add_argument("--broker-sub", metavar="ENDPOINT", help=sub_help)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default info)")
    g.add_argument("--log-format", default="auto", choices=["auto", "json", "console"],
                   help="auto: console on a terminal, JSON lines otherwise")


def _add_algo(p: argparse.ArgumentParser) -> None:
    d = AlgoConfig()
    g = p.add_argument_group("algorithm (must match the run's)")
    g.add_argument("--fragments", type=int, help=f"P: number of fragments (default {d.fragments})")
    g.add_argument("--sync-every", type=int, help=f"H: steps between merges of a fragment (default {d.sync_every_steps})")
    g.add_argument("--tau", type=int, help=f"tau: rounds in flight per shard (default {d.tau})")
    g.add_argument("--quorum", type=int, help=f"K: minimum answers per round (default {d.quorum})")
    g.add_argument("--codec", choices=["fp32", "bf16", "int8", "int4"], help=f"uplink codec (default {d.uplink_codec})")
    g.add_argument("--no-grace", action="store_true", help="disable the adaptive grace window")
    g.add_argument("--lockstep", action="store_true", help="lock-step baseline: learners wait every H steps and "
                   "every round waits for every live learner (K = M)")
    g.add_argument("--seed", type=int, help="seed of model init and data (default 0)")
    g.add_argument("--inner-lr", type=float, help="AdamW learning rate of the inner loop (default 3e-3)")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay of the inner loop (default 0)")
    g.add_argument("--grad-clip", type=float, help="clip the inner gradient norm to this (default 0: off)")
    g.add_argument("--grad-accum", type=int, help="micro-batches per inner step (default 1)")
    g.add_argument("--lr-schedule", choices=["constant", "cosine", "linear"],
                   help="inner LR schedule on the run's global token count (default constant)")
    g.add_argument("--lr-warmup-tokens", type=int, help="schedule warm-up over the run's first N tokens")
    g.add_argument("--lr-decay-tokens", type=int, help="cosine/linear: global token count where decay ends")
    g = p.add_argument_group("task (must match the run's)")
    g.add_argument("--task", metavar="TASK", help="built-in task (gpt, gpt-moe, text, digits) or MODULE:ATTR, a "
                   "ddloco.Task or a callable returning one, imported from the current directory or PYTHONPATH "
                   "(default gpt; env DDLOCO_TASK)")
    g.add_argument("--task-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="keyword argument of the task callable, repeatable (env DDLOCO_TASK_ARGS, space-separated)")


def _task_from_args(args: argparse.Namespace, task: TaskConfig) -> TaskConfig:
    """--task / --task-arg, else DDLOCO_TASK / DDLOCO_TASK_ARGS, over the TOML [task] table."""
    from common.task import TaskError, parse_task_args
    spec = getattr(args, "task", None) or os.environ.get("DDLOCO_TASK") or None
    items = getattr(args, "task_arg", None)
    if items is None and os.environ.get("DDLOCO_TASK_ARGS"):
        items = os.environ["DDLOCO_TASK_ARGS"].split()
    try:
        extra = parse_task_args(items or [])
    except TaskError as e:
        raise ConfigError(str(e)) from None
    if spec is not None and spec != task.spec:
        task = override(task, spec=spec, args={})  # another task: the TOML's args were for the old one
    return override(task, args={**task.args, **extra}) if extra else task


_FLAG_OF_FIELD = {
    "algo.fragments": ("fragments", "--fragments"), "algo.sync_every_steps": ("sync_every", "--sync-every"),
    "algo.tau": ("tau", "--tau"), "algo.quorum": ("quorum", "--quorum"), "algo.uplink_codec": ("codec", "--codec"),
    "algo.inner_lr": ("inner_lr", "--inner-lr"), "algo.inner_weight_decay": ("weight_decay", "--weight-decay"),
    "algo.inner_grad_clip": ("grad_clip", "--grad-clip"), "algo.inner_grad_accum": ("grad_accum", "--grad-accum"),
    "algo.lr_schedule": ("lr_schedule", "--lr-schedule"),
    "algo.lr_warmup_tokens": ("lr_warmup_tokens", "--lr-warmup-tokens"),
    "algo.lr_decay_tokens": ("lr_decay_tokens", "--lr-decay-tokens"), "task.seed": ("seed", "--seed"),
    "endpoints.run_id": ("run_id", "--run-id"),
    "up.learners": ("learners", "--learners"), "up.syncers": ("syncers", "--syncers"), "up.steps": ("steps", "--steps"),
    "up.minutes": ("minutes", "--minutes"), "up.eval_every_s": ("eval_every_s", "--eval-every-s"),
    "syncer.shard": ("shard", "--shard"), "syncer.shards": ("shards", "--shards"),
    "syncer.checkpoint_every_merges": ("checkpoint_every", "--checkpoint-every"),
    "syncer.merge_threads": ("merge_threads", "--merge-threads"),
    "syncer.metrics_port": ("metrics_port", "--metrics-port"),
    "learner.max_steps": ("steps", "--steps"), "learner.data_shard": ("data_shard", "--data-shard"),
    "learner.slowdown": ("slowdown", "--slowdown"), "learner.threads": ("threads", "--threads"),
    "learner.step_time_floor_ms": ("step_time_floor_ms", "--step-time-floor-ms"),
    "learner.device": ("device", "--device"), "learner.metrics_port": ("metrics_port", "--metrics-port"),
}
"""A config field, as its range check names it, -> (argparse dest, flag) of the flag that sets it."""
_FIELD_NAMES = re.compile(r"(?<![\w.])(" + "|".join(re.escape(f) for f in sorted(_FLAG_OF_FIELD, key=len, reverse=True))
                          + r")(?!\w)")


def _override_by_flags(args: argparse.Namespace, obj: Any, **changes: Any) -> Any:
    """``override(obj, **changes)`` where the changes come from flags: a value out of range is
    named by the flag the user typed (``--learners must be >= 1``), not by the config field that
    holds it (``up.learners``, which names a value from the TOML file, already checked alone)."""
    try:
        return override(obj, **changes)
    except ConfigError as e:
        def named(m: re.Match) -> str:
            dest, flag = _FLAG_OF_FIELD[m.group(1)]
            given = getattr(args, dest, None)
            return flag if given is not None and given is not False else m.group(1)   # 0 is a value
        raise ConfigError(_FIELD_NAMES.sub(named, str(e))) from None


def _resolve(args: argparse.Namespace) -> ConfigFile:
    cfg = load_config(args.config)
    endpoints = _override_by_flags(args, cfg.endpoints, run_id=args.run_id,
                                   redis_url=args.redis_url or os.environ.get("DDLOCO_REDIS_URL") or None,
                                   broker_pub=args.broker_pub, broker_sub=args.broker_sub,
                                   keys_dir=getattr(args, "keys", None) or os.environ.get("DDLOCO_KEYS") or None)
    run = cfg.run
    if hasattr(args, "quorum"):
        algo = _override_by_flags(args, run.algo, fragments=args.fragments, sync_every_steps=args.sync_every,
                                  tau=args.tau, quorum=args.quorum, uplink_codec=args.codec,
                                  grace_enabled=False if args.no_grace else None,
                                  lockstep=True if args.lockstep else None, inner_lr=args.inner_lr,
                                  inner_weight_decay=args.weight_decay, inner_grad_clip=args.grad_clip,
                                  inner_grad_accum=args.grad_accum, lr_schedule=args.lr_schedule,
                                  lr_warmup_tokens=args.lr_warmup_tokens, lr_decay_tokens=args.lr_decay_tokens)
        task = _override_by_flags(args, run.task, seed=args.seed)
        run = override(run, algo=algo, task=_task_from_args(args, task))
    return override(cfg, run=run, endpoints=endpoints)


def _algo_given(args: argparse.Namespace) -> bool:
    """A config file or an algorithm flag: the process brings a whole run config (which must
    equal the run's, or starts the run)."""
    return args.config is not None or any(
        getattr(args, k, None) not in (None, False)
        for k in ("fragments", "sync_every", "tau", "quorum", "codec", "no_grace", "lockstep", "seed",
                  "inner_lr", "weight_decay", "grad_clip", "grad_accum", "lr_schedule",
                  "lr_warmup_tokens", "lr_decay_tokens"))


def _task_given(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "task", None) or getattr(args, "task_arg", None) or os.environ.get("DDLOCO_TASK"))


def _run_and_task(cfg: ConfigFile, args: argparse.Namespace, *, starts_run: bool) -> tuple[Any, Any]:
    """What a daemon brings to the run: the whole run config (``starts_run``, a config file or
    algorithm flags), or only its task (``--task``: joins with the run's settings, checked to be
    the same task), or nothing (the run's config and task, from Redis)."""
    if starts_run or _algo_given(args):
        return cfg.run, None
    if _task_given(args):
        from common.task import allow_tasks, load_task
        allow_tasks([cfg.run.task.spec])   # named by this process: the run's spec may be recorded as it
        return None, load_task(cfg.run.task.spec, cfg.run.task.args)
    return None, None


def _redact(url: str) -> str:
    from common.control import redact
    return redact(url)


_ENDPOINT_FLAGS = (("redis_url", "--redis-url", redis_url_problem), ("broker_pub", "--broker-pub", endpoint_problem),
                   ("broker_sub", "--broker-sub", endpoint_problem), ("xsub", "--xsub", endpoint_problem),
                   ("xpub", "--xpub", endpoint_problem), ("rpc_bind", "--rpc-bind", endpoint_problem),
                   ("peer_bind", "--peer-bind", endpoint_problem))
"""Flags holding a Redis URL or a ZeroMQ endpoint, and the check of each (common.config)."""


def _check_flag_values(args: argparse.Namespace) -> None:
    """Every URL and endpoint flag (and DDLOCO_REDIS_URL) before anything starts: a bad one is one
    line naming the flag and the value (exit 2), not a traceback from deep inside a socket."""
    for attr, flag, problem in _ENDPOINT_FLAGS:
        if getattr(args, attr, None) is not None:
            check_value(flag, getattr(args, attr), problem)
    if hasattr(args, "redis_url") and args.redis_url is None and os.environ.get("DDLOCO_REDIS_URL"):
        check_value("DDLOCO_REDIS_URL", os.environ["DDLOCO_REDIS_URL"], redis_url_problem)


def _redis_url_source(args: argparse.Namespace) -> str:
    if args.redis_url is not None:
        return "--redis-url"
    if os.environ.get("DDLOCO_REDIS_URL"):
        return "DDLOCO_REDIS_URL"
    return f"[endpoints] redis_url of {args.config}" if args.config else "--redis-url (default)"


def _check_redis_answers(args: argparse.Namespace, url: str) -> None:
    check_redis_answers(url, _redis_url_source(args))


def check_redis_answers(url: str, source: str) -> None:
    """Redis must answer before a command starts on it (the client retries a refused connection
    for ~2 s): else one line naming where the URL came from (``source``: a flag, an environment
    variable, a config field) and the value (exit 2). A Redis lost later is a runtime failure
    (exit 1, restarted by the supervisor)."""
    import redis
    from common.control import connect
    try:
        r = connect(url)
        r.ping()
        r.close()
    except (redis.RedisError, OSError, ValueError) as e:
        raise ConfigError(f"{source} {_redact(url)!r}: Redis does not answer there ({e})") from None


def _add_metrics(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics at "
                   "http://HOST:PORT/metrics (env DDLOCO_METRICS_PORT; default: none; 0: any free port, logged)")
    g.add_argument("--metrics-host", metavar="HOST", help="address of the metrics endpoint (env "
                   "DDLOCO_METRICS_HOST; default 127.0.0.1; 0.0.0.0 to be scraped from other hosts or containers)")


def _metrics(args: argparse.Namespace) -> dict[str, Any]:
    """--metrics-port / --metrics-host, else DDLOCO_METRICS_PORT / DDLOCO_METRICS_HOST (None: the
    options' defaults, no endpoint)."""
    port = args.metrics_port
    raw = os.environ.get("DDLOCO_METRICS_PORT", "")
    if port is None and raw:
        try:
            port = int(raw)
        except ValueError:
            raise ConfigError(f"DDLOCO_METRICS_PORT must be a port number, got {raw!r}") from None
    return {"metrics_port": port, "metrics_host": args.metrics_host or os.environ.get("DDLOCO_METRICS_HOST") or None}


def _insecure(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "insecure", False)) or os.environ.get("DDLOCO_INSECURE", "") not in ("", "0")


def _security_check(endpoints: Endpoints, args: argparse.Namespace, who: str, member: str = "") -> None:
    """Secure by default: a daemon without keys refuses to start unless --insecure says so; with
    keys, ``member``'s secret and listing are checked before anything else starts."""
    from common.log import get_logger
    if endpoints.keys_dir:
        from common.security import Security, check_keys_dir
        check_keys_dir(endpoints.keys_dir)   # SecurityError: exit 2 (a standby's member is known later)
        if member:
            Security(endpoints.keys_dir, member)  # SecurityError: exit 2 with what is missing
        return
    if not _insecure(args):
        raise ConfigError("no CurveZMQ keys: pass --keys DIR (make them with `ddloco keys --dir DIR ...`) "
                          "or run with --insecure")
    get_logger(who).warning(f"{who}.insecure", detail="--insecure: ZeroMQ traffic is neither authenticated nor "
                            "encrypted; anyone who reaches the endpoints can join, read and publish")


def _setup_logging(args: argparse.Namespace) -> None:
    from common.log import configure_logging
    fmt = {"auto": None, "json": True, "console": False}[args.log_format]
    configure_logging(json_output=fmt, level=args.log_level)


def _setup_up_logging(args: argparse.Namespace) -> None:
    """``up``'s own process talks to a person: its log lines (the embedded Redis's) are aligned
    like its progress lines unless --log-format asks otherwise, and --quiet leaves errors only.
    Its daemons log JSON lines to runs/<run>/logs (they are started with --log-format json)."""
    from common.log import configure_logging
    configure_logging(json_output=args.log_format == "json", brief=args.log_format == "auto",
                      level="error" if args.quiet else args.log_level)


# ---------------------------------------------------------------------------- daemons
def cmd_broker(args: argparse.Namespace) -> int:
    from broker.daemon import BrokerOptions, run_broker
    from common.lifecycle import install_stop_handlers
    from common.security import SecurityError
    _setup_logging(args)
    cfg = _resolve(args)
    _security_check(cfg.endpoints, args, "broker", "broker")
    if cfg.endpoints.keys_dir and not args.shards and not args.run_id:
        print("ddloco broker: with CURVE keys it forwards a shard's messages only from the fragment's owner, so it "
              "needs the run's shard count: pass --shards S, or --run-id (and --redis-url) to read it from the run's "
              "config", file=sys.stderr)
        return EXIT_USAGE
    if args.run_id:  # its counters go to the run's Redis
        _check_redis_answers(args, cfg.endpoints.redis_url)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        run_broker(override(BrokerOptions(xsub_bind=args.xsub, xpub_bind=args.xpub, hwm_messages=args.hwm,
                                          keys_dir=cfg.endpoints.keys_dir, shards=args.shards,
                                          fragments=args.fragments, max_subscriptions=args.max_subscriptions,
                                          max_message_bytes=int(args.max_message_mb * (1 << 20)),
                                          redis_url=cfg.endpoints.redis_url if args.run_id else "",
                                          run_id=args.run_id or ""), **_metrics(args)), stop)
    except SecurityError as e:
        print(f"ddloco broker: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def cmd_syncer(args: argparse.Namespace) -> int:
    from common.control import ConfigMismatch, LeaseHeld, RunConfigMissing
    from common.lifecycle import install_stop_handlers
    from syncer.shard import CheckpointMismatch, Shard
    import redis
    cfg = _resolve(args)
    opts = _override_by_flags(args, cfg.syncer, shard=args.shard, shards=args.shards,
                              checkpoint_dir=args.checkpoint_dir, checkpoint_every_merges=args.checkpoint_every,
                              rpc_bind=args.rpc_bind, advertise_host=_advertise_host(args),
                              fresh=True if args.fresh else None, merge_threads=args.merge_threads, **_metrics(args))
    _setup_logging(args)
    _security_check(cfg.endpoints, args, "syncer", f"shard{opts.shard}")
    _check_redis_answers(args, cfg.endpoints.redis_url)
    stop = threading.Event()
    install_stop_handlers(stop)
    run, task = _run_and_task(cfg, args, starts_run=not args.join)
    try:
        with Shard(endpoints=cfg.endpoints, options=opts, run=run, task=task) as shard:
            while not stop.is_set():
                shard.poll_once(20)
    except (ConfigMismatch, CheckpointMismatch, LeaseHeld) as e:
        print(f"ddloco syncer: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except RunConfigMissing as e:
        print(f"ddloco syncer: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except redis.RedisError as e:
        print(f"ddloco syncer: Redis at {_redact(cfg.endpoints.redis_url)} failed: {e}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


_FORKED = False
"""This process is a learner forked by a standby factory (``learner --standby``, fork orders)."""


def cmd_learner(args: argparse.Namespace) -> int:
    from learner.group import group_from_env
    ranks = group_from_env()
    if args.nproc is not None and args.nproc != 1 and ranks is None:   # a rank ignores it
        return _exec_torchrun(args)
    code = _learner(args, ranks)
    if _FORKED or ranks is not None:
        # a fork's interpreter teardown walks (and so copies, page by page) every object it
        # inherited: 2-3 s per learner, 30 s and more with 32 on two cores. A torchrun rank's
        # teardown can be aborted by gloo's threads ("terminate called without an active
        # exception", SIGABRT) after its process group was destroyed and its work was done.
        # Everything is written (Redis, logs): end here, as multiprocessing ends its children.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _learner(args: argparse.Namespace, ranks: tuple[int, int, int] | None) -> int:
    """One learner process (``ranks``: its place in a torchrun learner, learner/group.py)."""
    from common.control import RunConfigMissing
    from common.lifecycle import install_stop_handlers
    from learner.api import train
    from learner.core import JoinTimeout, LearnerRefused
    import redis
    cfg = _resolve(args)
    opts = _override_by_flags(args, cfg.learner, learner_id=args.learner_id, data_shard=args.data_shard,
                              max_steps=args.steps, slowdown=args.slowdown, step_time_floor_ms=args.step_time_floor_ms,
                              threads=args.threads, device=args.device, autocast=args.autocast,
                              peer_bind=args.peer_bind, group_sharding=args.group_sharding,
                              advertise_host=_advertise_host(args), **_metrics(args))
    _setup_logging(args)
    if ranks is None or ranks[0] == 0:   # other ranks of a torchrun learner never reach Redis or the broker
        # a standby's identity (and so its key) is known only when it is told whom to replace
        _security_check(cfg.endpoints, args, "learner", "" if args.standby else opts.learner_id)
        _check_redis_answers(args, cfg.endpoints.redis_url)
    stop = threading.Event()
    install_stop_handlers(stop)
    run, task = _run_and_task(cfg, args, starts_run=False)
    import torch
    # the daemon's cores (`up` shares them between its learners); a standby prepares on one, as
    # a process that ran OpenMP on several cannot fork (the copy hangs in its first parallel op)
    torch.set_num_threads(1 if args.standby else opts.threads)
    try:
        if args.standby:
            return _standby(cfg, opts, task, run, stop)
        train(endpoints=cfg.endpoints, task=task, options=opts, run=run, stop=stop)
    except LearnerRefused as e:
        code = _refused_exit_code(args)
        print(f"ddloco learner: {e}" + (" (exit 0: not restarting, fix the learner's config or task and "
                                         "start it again)" if code == 0 else ""), file=sys.stderr)
        return code
    except (JoinTimeout, RunConfigMissing) as e:
        print(f"ddloco learner: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except redis.RedisError as e:
        print(f"ddloco learner: Redis at {_redact(cfg.endpoints.redis_url)} failed: {e}", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def _exec_torchrun(args: argparse.Namespace) -> int:
    """``learner --nproc N``: become ``torchrun --standalone --nproc-per-node N -m learner ARGS``
    (the same arguments less --nproc): N ranks, one learner of the run (learner/group.py). On
    several machines run torchrun yourself with its rendezvous flags."""
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if args.standby:
        raise ConfigError("--nproc and --standby cannot be combined (a standby is one process)")
    rest, skip = [], False
    for a in args.argv[1:]:
        flag = a.split("=", 1)[0]
        if skip:
            skip = False
        elif len(flag) >= 4 and "--nproc".startswith(flag):   # --nproc and what argparse takes for it (--npro)
            skip = "=" not in a
        else:
            rest.append(a)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
            "-m", "learner", *rest]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)   # signals reach torchrun, which passes them to every rank
    return EXIT_FAILURE   # not reached


def _advertise_host(args: argparse.Namespace) -> str | None:
    """--advertise-host, else DDLOCO_ADVERTISE_HOST (how compose passes the host's address)."""
    return args.advertise_host or os.environ.get("DDLOCO_ADVERTISE_HOST") or None


def _refused_exit_code(args: argparse.Namespace) -> int:
    """Exit status of a refused learner: ``--refused-exit-code`` or DDLOCO_REFUSED_EXIT_CODE, else
    EXIT_REFUSED. Compose sets 0 so that ``restart: on-failure`` does not restart a learner the run
    will refuse again (a refusal needs a human; a crash or a kill is retried)."""
    raw = args.refused_exit_code if args.refused_exit_code is not None else os.environ.get("DDLOCO_REFUSED_EXIT_CODE")
    try:
        return EXIT_REFUSED if raw in (None, "") else int(raw)
    except ValueError:
        return EXIT_REFUSED


def _standby(cfg: ConfigFile, opts: LearnerOptions, task: Any, run: Any, stop: threading.Event) -> int:
    """``learner --standby``: prepare everything that does not depend on the learner id (imports,
    run config, task, model, dry run), then wait for one JSON line on stdin naming the learner to
    become: ``{"learner_id": ..., "data_shard": ..., "max_steps": ..., "slowdown": ...}``. A
    supervisor keeps one standby process per machine so that a failed learner is replaced in well
    under a second (end of input: exit 0)."""
    import json
    import select
    import time
    from learner.core import Learner
    learner = Learner(endpoints=cfg.endpoints, options=override(opts, learner_id=opts.learner_id or "standby"),
                      task=task, run=run, stop=stop)
    learner.prepare()
    learner.warm_up()   # the first AdamW construction imports torch's compiler stack: seconds
    print(json.dumps({"event": "learner.standby_ready", "pid": os.getpid()}), flush=True)
    forks: dict[int, str] = {}   # pid -> where its exit status goes
    line = ""
    pending = b""   # read from fd 0 unbuffered: select() cannot see lines a buffered reader holds
    while not stop.is_set() and not line:
        _reap_forks(forks)
        if b"\n" not in pending:
            ready, _, _ = select.select([0], [], [], 0.2)
            if not ready:
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return 0  # the supervisor went away
            pending += chunk
            continue
        raw, pending = pending.split(b"\n", 1)
        line = raw.decode(errors="replace") + "\n"
        if '"fork"' in line and _fork_learner(line, forks):
            line = ""   # the factory: wait for the next order
    if stop.is_set():
        # forked learners stop with the factory: each is asked to leave, and its exit status is
        # still collected for the supervisor (after 20 s the parent-death signal ends the rest)
        for pid in forks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20.0
        while forks and time.monotonic() < deadline:
            _reap_forks(forks)
            time.sleep(0.05)
        return 0
    try:
        orders = json.loads(line)
        if orders.get("redis_url"):   # the learner's own Redis user (per-learner users, Redis >= 7)
            learner.use_redis_url(str(orders["redis_url"]))
        learner.assign(learner_id=str(orders["learner_id"]), data_shard=orders.get("data_shard"),
                       max_steps=orders.get("max_steps"), slowdown=orders.get("slowdown"),
                       metrics_port=orders.get("metrics_port"))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--standby: expected one JSON line with learner_id, got {line[:200]!r} ({e})") from None
    if cfg.endpoints.keys_dir:
        from common.security import Security
        Security(cfg.endpoints.keys_dir, learner.id)  # SecurityError: exit 2 naming the missing key
    import torch
    torch.set_num_threads(opts.threads)
    learner.run()
    return 0


def _fork_learner(line: str, forks: dict[int, str]) -> bool:
    """A standby used as a factory (``{"fork": true, "log": PATH, "reply": PATH, ...}``): fork a
    copy of this prepared process to become the learner the line names, in well under a second
    and without a CPU second of imports, however many failures come at once. Returns True in
    the factory (the child's pid is written to ``reply``, its exit status to ``reply``.exit
    when it ends); in the child returns False, its output now going to ``log``, and the caller
    goes on to become the learner."""
    import json
    from common.lifecycle import die_with_parent
    orders = json.loads(line)
    reply = Path(orders["reply"])
    global _FORKED
    sys.stdout.flush()
    sys.stderr.flush()
    factory = os.getpid()
    import gc
    gc.freeze()   # what the factory holds is never collected: the fork's collector skips it (no copy)
    pid = os.fork()
    if pid == 0:
        _FORKED = True
        die_with_parent(factory)
        fd = os.open(orders["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        return False
    forks[pid] = str(reply) + ".exit"
    _write_atomic(reply, str(pid))
    print(json.dumps({"event": "learner.standby_forked", "pid": pid, "learner_id": orders.get("learner_id")}),
          flush=True)
    return True


def _reap_forks(forks: dict[int, str]) -> None:
    """Collect the exit status of forked learners that ended (Popen's convention: -N for signal N)."""
    for pid in list(forks):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 9   # reaped elsewhere: SIGKILL is the best guess
        if done:
            _write_atomic(Path(forks.pop(pid)), str(os.waitstatus_to_exitcode(status)))


def _write_atomic(path: Path, text: str) -> None:
    """Write then rename: a reader (``up`` polling the file) never sees it half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _run_id_given(args: argparse.Namespace) -> bool:
    """``--run-id``, or a config file whose [endpoints] table names the run."""
    if args.run_id or args.config is None:
        return bool(args.run_id)
    import tomllib
    try:
        endpoints = tomllib.loads(Path(args.config).read_text()).get("endpoints")
    except (OSError, tomllib.TOMLDecodeError):
        return True   # loading the config says what is wrong with it
    return isinstance(endpoints, dict) and "run_id" in endpoints


def cmd_up(args: argparse.Namespace) -> int:
    from ddloco.up import new_run_id, resolve_resume, run_up
    if args.tensorboard:  # an optional package: refuse before anything starts
        from ddloco.tensorboard_log import tensorboard_missing
        missing = tensorboard_missing()
        if missing:
            print(missing, file=sys.stderr)
            return EXIT_USAGE
    resume = None
    if args.resume:   # a refused resume creates nothing: every check before the work directory
        resume, state = resolve_resume(args.resume)
        if args.run_id not in (None, state["run_id"]):
            raise ConfigError(f"--resume {args.resume} continues run {state['run_id']!r}: leave --run-id out")
        if args.config is None:
            args.config = str(resume / "config.toml")  # the stopped run's settings
        args.run_id = state["run_id"]
    elif not _run_id_given(args):
        args.run_id = new_run_id()   # every run its own work directory, Redis keys and --resume name
    cfg = _resolve(args)
    _setup_up_logging(args)  # library logs (embedded Redis) to stderr; progress lines go to stdout
    if args.redis_url is not None:   # an external Redis must answer before anything starts
        _check_redis_answers(args, cfg.endpoints.redis_url)
    steps = args.steps
    if steps is None and args.minutes is not None:
        steps = 0  # --minutes alone: train for that long (no step budget)
    up = _override_by_flags(args, cfg.up, learners=args.learners, syncers=args.syncers, steps=steps,
                            minutes=args.minutes, report_dir=args.report, eval_every_s=args.eval_every_s)
    chaos = None
    if args.chaos:
        from ddloco.chaos import parse_chaos
        chaos = parse_chaos(args.chaos)
    extra = None
    if args.extra_learners:
        if args.extra_learners < 0 or args.extra_at is None or args.extra_for is None or args.extra_for <= 0:
            raise ConfigError("--extra-learners N needs --extra-at SECONDS and --extra-for SECONDS (> 0)")
        extra = (args.extra_learners, args.extra_at, args.extra_for)
    if cfg.run.algo.lockstep and args.quorum is None:  # the synchronous baseline waits for every learner
        cfg = override(cfg, run=override(cfg.run, algo=override(cfg.run.algo, quorum=up.learners)))
    slow = None
    if args.slowdowns:
        try:
            slow = [float(x) for x in args.slowdowns.split(",")]
        except ValueError:
            raise ConfigError(f"--slowdowns must be a comma list of numbers >= 1, got {args.slowdowns!r}") from None
        if any(x < 1 for x in slow):
            raise ConfigError("--slowdowns factors must be >= 1")
    cfg = override(cfg, learner=_override_by_flags(args, cfg.learner, device=args.device))
    rc = run_up(override(cfg, up=up), external_redis=args.redis_url is not None,
                step_time_floor_ms=args.step_time_floor_ms, slowdowns=slow, quiet=args.quiet, resume=resume,
                chaos=chaos, extra=extra, insecure=_insecure(args), tensorboard=args.tensorboard,
                broker_pub=args.broker_pub or "", broker_sub=args.broker_sub or "")
    # Everything is written and every child and Redis stopped. Rarely (after `--chaos`, on a loaded
    # machine) the interpreter's own shutdown aborted in native code ("terminate called without an
    # active exception", exit -6) after all of that; leave without it so the exit code is the run's.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def cmd_status(args: argparse.Namespace) -> int:
    from ddloco.status import run_status
    cfg = _resolve(args)
    if args.watch is not None and (args.json or args.watch <= 0):
        raise ConfigError("--watch SECONDS must be > 0, without --json")
    if args.count < 0:
        raise ConfigError("--count must be >= 0")
    if args.watch is None:   # --watch shows a Redis that fails in its view and asks again
        _check_redis_answers(args, cfg.endpoints.redis_url)
    return run_status(cfg.endpoints, as_json=args.json, watch_s=args.watch, count=args.count)


def cmd_bench(argv: Sequence[str]) -> int:
    from ddloco.bench.micro import main as bench_main
    return bench_main(list(argv))


def cmd_compare(argv: Sequence[str]) -> int:
    from ddloco.compare.runner import cli_main
    return cli_main(list(argv))


def cmd_export(argv: Sequence[str]) -> int:
    from ddloco.export import main as export_main
    return export_main(list(argv))


def cmd_sim(argv: Sequence[str]) -> int:
    from ddloco.sim.cli import main as sim_main
    return sim_main(list(argv))


def cmd_keys(args: argparse.Namespace) -> int:
    from common.security import create_keys
    ids = [x for x in (args.learner_ids or "").split(",") if x] + [f"{args.prefix}{i}" for i in range(args.learners)]
    made = create_keys(args.dir, learners=ids, shards=args.shards, monitors=["monitor"], overwrite=args.force)
    root = os.path.abspath(args.dir)
    if args.redis_password:
        import secrets
        pw_file = os.path.join(root, "secret", "redis.password")
        if not os.path.exists(pw_file) or args.force:
            with open(os.open(pw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
                fh.write(secrets.token_urlsafe(24) + "\n")
        print(f"redis      password in {pw_file} (0600)")
    print(f"keys       {len(made)} new key pair(s) in {root}" + (f": {', '.join(made)}" if made else " (all existed)"))
    print(f"public     {root}/public/<role>/<name>.key: the allow list; copy the whole public/ tree to every host")
    print(f"secret     {root}/secret/<name>.key_secret: give each host only the secrets of the members it runs")
    print("use        every daemon with --keys DIR (or DDLOCO_KEYS=DIR); revoke a member by deleting its public file")
    if args.redis_users:
        return _learner_redis_users(root, ids, args.run_id or "", args.redis_url or os.environ.get("DDLOCO_REDIS_URL", ""))
    return 0


def _learner_redis_users(root: str, ids: list[str], run_id: str, admin_url: str) -> int:
    """``keys --redis-users``: a Redis user per learner id (Redis >= 7, common/redis_acl.py) made
    through an admin URL, its URL in DIR/secret/<id>.redis.env (0600). On a Redis < 7: one
    warning line, and the files hold the URL given (the learners share its user, as before)."""
    import redis
    from common import control, redis_acl
    if not run_id or not admin_url or not ids:
        print("error: --redis-users needs --run-id, --redis-url (or DDLOCO_REDIS_URL: an admin's URL) and learner "
              "ids (--learner-ids or --learners)", file=sys.stderr)
        return EXIT_USAGE
    try:
        admin = control.connect(admin_url)
        version = redis_acl.server_version(admin)
        own = redis_acl.has_selectors(version)
        if not own:
            print("warning: " + redis_acl.FALLBACK_WARNING.format(version=".".join(map(str, version))), file=sys.stderr)
        urls = {lid: redis_acl.user_url(admin_url, redis_acl.learner_user(lid),
                                        redis_acl.add_learner_user(admin, run_id, lid)) if own else admin_url
                for lid in ids}
    except (redis.RedisError, ValueError) as e:
        print(f"error: cannot create the learners' Redis users at {control.redact(admin_url)}: {e}", file=sys.stderr)
        return 1
    for lid, url in urls.items():
        path = os.path.join(root, "secret", f"{lid}.redis.env")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(f"DDLOCO_REDIS_URL={url}\n")
    print(f"redis      {len(urls)} learner Redis user(s) for run {run_id!r}" + (
          " (each writes only its own keys)" if own else " (Redis < 7.0: the URL given)")
          + f": {root}/secret/<id>.redis.env (0600; `set -a; . FILE; set +a` on the learner's host)")
    return 0


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ddloco", description="Decoupled DiLoCo: asynchronous, failure-tolerant "
                                 "distributed pre-training.",
                                 epilog="Exit codes: 0 success, 1 runtime failure, 2 bad usage or config (one line "
                                        "naming the flag or field), 3 refused by the run.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                            help="`ddloco COMMAND --help` lists its flags")

    p = sub.add_parser("up", help="run a whole local cluster and write a report",
                       description="Start Redis (embedded unless --redis-url), the broker (on free ports unless "
                                   "--broker-pub/--broker-sub), --syncers shards and --learners learners as "
                                   "separate processes; show progress; stop everything at the end or on Ctrl-C; "
                                   "write --report DIR/report.json and plots. Secure by default: CURVE keys per "
                                   "member and, for the embedded Redis, a password, made for the run "
                                   "(--insecure: none).")
    _add_common(p, "up")
    _add_algo(p)
    p.add_argument("--learners", type=int, help="M: learner processes (default 4)")
    p.add_argument("--syncers", type=int, help="S: syncer shards (default 2)")
    p.add_argument("--steps", type=int, help="inner steps per learner (default 400, or none when --minutes is "
                   "given; 0 = until --minutes)")
    p.add_argument("--minutes", type=float, help="wall-clock cap (default 4)")
    p.add_argument("--eval-every-s", type=float, metavar="SECONDS", help="evaluate the global model this often "
                   "(default 8; it fetches every fragment: make it rarer for a large model; 0: every second)")
    p.add_argument("--report", metavar="DIR", help="write DIR/report.json, PNG plots and DIR/model.safetensors "
                   "(the final global model; on Ctrl-C the freshest one); DIR is created and checked writable "
                   "before anything starts")
    p.add_argument("--step-time-floor-ms", type=float, default=None,
                   help="emulated accelerator step time of every learner: a step never takes less (ms)")
    p.add_argument("--slowdowns", default=None, help="comma list of per-learner slowdown factors, e.g. 1,1,1.18,1.18")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors (no progress or log lines, no digest of "
                   "the daemons' warnings)")
    p.add_argument("--resume", metavar="RUN_ID|DIR", help="continue a stopped run: its config, the shards' "
                   "checkpoints (fragment versions, momentum) and the learners' data positions, from its work "
                   "directory DIR (runs/<run-id>-<time>) or the one directory of RUN_ID (several: refused, "
                   "listing them)")
    p.add_argument("--device", default=None, help="learners' device: auto (default), cpu, cuda, cuda:N")
    p.add_argument("--chaos", metavar="SPEC", help="inject seeded failures and restart what was killed, e.g. "
                   "seed=7,learner_mtbf_s=60,stalls=3,stall_s=20,shard_kills=1,shard_wipes=1,broker_restarts=1,"
                   "redis_restarts=1 (ddloco chaos --help); the report gains the failure figures")
    p.add_argument("--extra-learners", type=int, default=0, metavar="N",
                   help="temporary learners (scavenged capacity) started at --extra-at for --extra-for seconds "
                        "(default 0)")
    p.add_argument("--extra-at", type=float, metavar="SECONDS", help="when the temporary learners start")
    p.add_argument("--extra-for", type=float, metavar="SECONDS", help="how long they train")
    p.add_argument("--tensorboard", metavar="DIR", help="also log the global model's eval loss to TensorBoard "
                   "event files in DIR (scalar eval/loss, step = tokens); needs the tensorboard package")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", help="live view of a run from Redis",
                       description="Members, their steps and last contribution, fragment versions, shards "
                                   "(reads Redis only; a run id that is not there is told with the runs that are).")
    _add_common(p, "status")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", type=float, nargs="?", const=1.0, metavar="SECONDS", help="a live view redrawn every "
                   "SECONDS (default 1) until Ctrl-C; a Redis that fails is shown in the view and asked again")
    p.add_argument("--count", type=int, default=0, metavar="N", help="with --watch: leave after N refreshes "
                   "(exit 0 if the last one read the run)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("keys", help="create CurveZMQ key pairs for a run's members",
                       description="One key pair per member, in a folder per role: DIR/public/{broker,shard,learner,"
                                   "monitor}/<name>.key (the allow list, for every host) and DIR/secret/<name>.key_secret "
                                   "(each member's own). Names: broker, shard<k>, the learner ids, monitor. Existing "
                                   "pairs are kept (add learners later by running it again).")
    p.add_argument("--dir", required=True, help="keys directory (created)")
    p.add_argument("--shards", type=int, default=1, help="shard keys shard0..shard<S-1> (default 1)")
    p.add_argument("--learners", type=int, default=0, help="learner keys <prefix>0..<prefix><N-1>")
    p.add_argument("--prefix", default="learner-", help="learner id prefix for --learners (default learner-, as "
                   "`ddloco up` names them)")
    p.add_argument("--learner-ids", help="comma list of learner ids to make keys for")
    p.add_argument("--force", action="store_true", help="replace existing key pairs (revokes the old ones)")
    p.add_argument("--redis-password", action="store_true", help="also write a random Redis password to "
                   "DIR/secret/redis.password (kept if it exists; compose.yaml uses it)")
    p.add_argument("--redis-users", action="store_true", help="also create a Redis user per learner id "
                   "(--learner-ids/--learners) that writes only that learner's keys (Redis >= 7.0; replaces its "
                   "password if it exists), through --redis-url (an admin's; default DDLOCO_REDIS_URL), and write "
                   "its URL to DIR/secret/<id>.redis.env (0600)")
    p.add_argument("--run-id", help="with --redis-users: the run the learners join")
    p.add_argument("--redis-url", help="with --redis-users: an admin's Redis URL (default DDLOCO_REDIS_URL)")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("broker", help="run the ZeroMQ forwarder daemon",
                       description="Forwards every published message to every subscriber: learners and shards "
                                   "publish to --xsub (their --broker-pub) and subscribe at --xpub (their "
                                   "--broker-sub). With --keys only the run's listed keys connect; with --run-id "
                                   "its counters go to the run's Redis.")
    _add_common(p, "broker")
    p.add_argument("--xsub", metavar="ENDPOINT", default="tcp://0.0.0.0:5555",
                   help="bind endpoint for publishers (default tcp://0.0.0.0:5555)")
    p.add_argument("--xpub", metavar="ENDPOINT", default="tcp://0.0.0.0:5556",
                   help="bind endpoint for subscribers (default tcp://0.0.0.0:5556)")
    _add_metrics(p)
    p.add_argument("--hwm", type=int, default=200, help="high-water mark per direction and subscriber "
                   "(messages; bounds the broker's memory for a subscriber that stops reading; default 200)")
    p.add_argument("--shards", type=int, default=0, help="the run's shard count S: a shard's open/frag/need "
                   "goes on only from the fragment's owner, shard<p %% S> (default: read from the run's config in "
                   "Redis with --run-id; while unknown, shards' messages are refused)")
    p.add_argument("--fragments", type=int, default=0, help="the run's fragment count P, which sizes the "
                   "per-member rate limits and subscription cap (default: from the run's config in Redis, else 64)")
    p.add_argument("--max-message-mb", type=float, default=128.0, help="largest frame a publisher may send, in "
                   "MiB: the largest fragment at fp32 plus its header (a larger one drops the sender's connection; "
                   "`ddloco up` sets it from the model; default 128)")
    p.add_argument("--max-subscriptions", type=int, default=0, help="topics one member may subscribe to "
                   "(default 2 x P + 16)")
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("syncer", help="run one syncer shard daemon",
                       description="Owns fragments p with p % shards == shard. Publishes its run config to Redis "
                                   "(refused if the run has another one) unless --join takes the run's.")
    _add_common(p, "syncer")
    _add_algo(p)
    p.add_argument("--shard", type=int, help="k: this shard's index (default 0)")
    p.add_argument("--shards", type=int, help="S: number of shards (default 1)")
    p.add_argument("--checkpoint-dir", help="atomic checkpoint directory (default runs/checkpoints)")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every N merges (default 20)")
    p.add_argument("--rpc-bind", metavar="ENDPOINT", help="ROUTER endpoint serving full fragments (default "
                   "tcp://127.0.0.1:0: any free port)")
    p.add_argument("--advertise-host", help="host learners use to reach --rpc-bind (env DDLOCO_ADVERTISE_HOST; "
                   "default: the bound address)")
    p.add_argument("--join", action="store_true", help="take the run config from Redis instead of publishing one")
    p.add_argument("--merge-threads", type=int, help="torch threads for merges, which run on a worker thread off "
                   "the socket loop (default: torch's setting)")
    _add_metrics(p)
    p.add_argument("--fresh", action="store_true", help="start over from the initial model: ignore the checkpoint "
                   "and the learners' copies (versions still go up, so learners adopt it)")
    p.set_defaults(func=cmd_syncer)

    p = sub.add_parser("learner", help="run one learner daemon (--task: built-in or MODULE:ATTR)",
                       description="Joins the run named by --run-id through --redis-url and the broker; takes the "
                                   "run's config from Redis (with --config or algorithm flags it must match; "
                                   "--task must report the run's task name, config and data digest). A run id "
                                   "not in Redis is warned about within seconds, with the runs that are there.")
    _add_common(p, "learner")
    _add_algo(p)
    p.add_argument("--learner-id", help="unique id (default <hostname>-<pid>)")
    p.add_argument("--data-shard", type=int, help="stream of training batches (default: derived from the "
                   "learner id)")
    p.add_argument("--steps", type=int, help="stop after N inner steps (default: run until stopped)")
    p.add_argument("--slowdown", type=float, help="emulate a slower chip: every step takes this factor longer "
                   "(>= 1; default 1)")
    p.add_argument("--step-time-floor-ms", type=float, help="emulated accelerator step time: a step never takes "
                   "less (ms; default 0)")
    p.add_argument("--threads", type=int, help="torch threads (default 1)")
    p.add_argument("--nproc", type=int, metavar="N", help="run this learner as N data-parallel processes (torchrun "
                   "--standalone --nproc-per-node N; DDP, gloo on CPU, NCCL on CUDA, one GPU per rank): one "
                   "learner of the run with N times the tokens per step; rank 0 talks to the run")
    p.add_argument("--group-sharding", choices=["auto", "ddp", "fsdp"], help="with --nproc: ddp (every rank holds "
                   "the whole model), fsdp (parameters, gradients and AdamW state sharded over the ranks: "
                   "torch's fully_shard, a unit per layer of an nn.ModuleList) or auto (fsdp on a GPU where "
                   "16 B per parameter would take over 70%% of its memory; default)")
    p.add_argument("--device", help="auto (cuda if available), cpu, cuda, cuda:N (default auto)")
    p.add_argument("--autocast", choices=["auto", "bf16", "off"], help="mixed precision of the forward pass "
                   "(default auto: bf16 on CUDA, none on CPU)")
    p.add_argument("--peer-bind", metavar="ENDPOINT", help="endpoint serving this learner's state to joining peers "
                   "(default tcp://127.0.0.1:0; on several machines e.g. tcp://0.0.0.0:7100)")
    p.add_argument("--advertise-host", help="host other learners use to reach --peer-bind (env "
                   "DDLOCO_ADVERTISE_HOST; default: the bound address)")
    p.add_argument("--refused-exit-code", type=int, metavar="N", help="exit status when the run refuses this "
                   "learner (default 3; env DDLOCO_REFUSED_EXIT_CODE; compose sets 0 so that restart: on-failure "
                   "does not loop on a learner that will be refused again)")
    _add_metrics(p)
    p.add_argument("--standby", action="store_true", help="a hot spare: prepare (imports, run config, model, dry "
                   "run), then wait for one JSON line on stdin, {\"learner_id\": ID, \"data_shard\": N, "
                   "\"max_steps\": N, \"slowdown\": X}, and become that learner; with \"fork\": true, \"log\": "
                   "PATH, \"reply\": PATH in the line it forks a copy that becomes the learner (pid written to "
                   "reply, exit status to reply.exit) and stays ready for the next (CPU only; how `ddloco up` "
                   "replaces failed learners fast)")
    p.set_defaults(func=cmd_learner)

    sub.add_parser("sim", help="goodput simulator at paper scale (ddloco sim --help)", add_help=False)
    sub.add_parser("bench", help="micro benchmarks: codec, wire, merge, broker, curve; sync: the daemons at scale; group: a torchrun learner per rank, DDP vs FSDP (ddloco bench --help)",
                   add_help=False)
    sub.add_parser("export", help="write the global model (live run or checkpoints) to a safetensors file "
                   "(ddloco export --help)", add_help=False)
    sub.add_parser("chaos", help="inject seeded failures into a running cluster on this machine and measure "
                   "them (ddloco chaos --help)", add_help=False)
    sub.add_parser("compare", help="quality at equal tokens: DDP, one learner, sync DiLoCo, our cluster "
                   "(ddloco compare --help)", add_help=False)
    sub.add_parser("fuzz", help="seeded random and mutated frames thrown at a running cluster's endpoints "
                   "(ddloco fuzz --help)", add_help=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        return cmd_sim(argv[1:])
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    if argv and argv[0] == "compare":
        return cmd_compare(argv[1:])
    if argv and argv[0] == "export":
        return cmd_export(argv[1:])
    if argv and argv[0] == "fuzz":
        from ddloco.fuzz import main as fuzz_main
        return fuzz_main(argv[1:])
    if argv and argv[0] == "chaos":
        from ddloco.chaos import main as chaos_main
        return chaos_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    _allow_tasks_from_env()
    try:
        _check_flag_values(args)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not isinstance(e, _usage_errors()):
            raise
        print(f"ddloco {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE


def _allow_tasks_from_env() -> None:
    """DDLOCO_TASKS_ALLOWED (MODULE:ATTR, comma separated): tasks this process may import when the
    run's config names them (a learner joining without --task); nothing from Redis is trusted."""
    raw = os.environ.get("DDLOCO_TASKS_ALLOWED", "")
    if raw.strip():
        from common.task import allow_tasks
        allow_tasks(raw.split(","))


def _usage_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's input (exit 2, one line): taken from the modules that define
    them only when those were imported (an error cannot come from a module never loaded), so
    that `status` or the broker do not import torch through `common.fragments` or the tasks."""
    out: list[type[BaseException]] = [ConfigError]
    for module, name in (("common.fragments", "FragmentationError"), ("common.task", "TaskError"),
                         ("common.security", "SecurityError")):
        if module in sys.modules:
            out.append(getattr(sys.modules[module], name))
    return tuple(out)


if __name__ == "__main__":
    sys.exit(main())
