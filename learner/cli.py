"""`python -m learner` (= `ddloco learner`): one learner daemon, from its flags.

Joins the run named by --run-id through --redis-url and the broker. The flags are made from the
config (``common.flags``); the shared steps (config, checks, one-line errors) are
``common.command``; how the process comes to be (standby, fork factory, torchrun) is
``learner.launch``. This module and ``learner.launch`` are the learner's only readers of argv and
the environment. Runs on the main thread.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any, Mapping, Sequence

from common import command
from common.config import LearnerOptions
from common.exits import FAILURE, REFUSED
from common.flags import Flag, add_algo, add_common, add_flags, add_metrics, metrics_flags

PROG = "ddloco learner"
HELP = "run one learner daemon (--task: built-in or MODULE:ATTR)"
DESCRIPTION = ("Joins the run named by --run-id through --redis-url and the broker; takes the run's config from "
               "Redis (with --config or algorithm flags it must match; --task must report the run's task name, "
               "config and data digest). A run id not in Redis is warned about within seconds, with the runs "
               "that are there.")

OWN_FLAGS = (
    Flag("--learner-id", LearnerOptions, "learner_id"),
    Flag("--data-shard", LearnerOptions, "data_shard"),
    Flag("--steps", LearnerOptions, "max_steps"),
    Flag("--slowdown", LearnerOptions, "slowdown"),
    Flag("--step-time-floor-ms", LearnerOptions, "step_time_floor_ms"),
    Flag("--step-noise", LearnerOptions, "step_noise"),
    Flag("--threads", LearnerOptions, "threads"),
    Flag("--group-sharding", LearnerOptions, "group_sharding", choices=("auto", "ddp", "fsdp")),
    Flag("--device", LearnerOptions, "device"),
    Flag("--autocast", LearnerOptions, "autocast", choices=("auto", "bf16", "off")),
    Flag("--peer-bind", LearnerOptions, "peer_bind", metavar="ENDPOINT",
         note="on several machines e.g. tcp://0.0.0.0:7100"),
    Flag("--advertise-host", LearnerOptions, "advertise_host", note="env DDLOCO_ADVERTISE_HOST"),
    Flag("--batch-log", LearnerOptions, "batch_log", metavar="PATH"),
    Flag("--position-writes", LearnerOptions, "position_writes", choices=("auto", "step", "heartbeat")),
)
FLAGS = (*OWN_FLAGS, *metrics_flags(LearnerOptions))
"""The learner's flags that set a field of its options (``common.options.LearnerOptions``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of the learner, on ``p`` (its own parser, or `ddloco`'s subcommand)."""
    add_common(p, "learner")
    add_algo(p)
    add_flags(p, OWN_FLAGS)
    p.add_argument("--nproc", type=int, metavar="N", help="run this learner as N data-parallel processes (torchrun "
                   "--standalone --nproc-per-node N; DDP, gloo on CPU, NCCL on CUDA, one GPU per rank): one "
                   "learner of the run with N times the tokens per step; rank 0 talks to the run")
    p.add_argument("--refused-exit-code", type=int, metavar="N", help="exit status when the run refuses this "
                   "learner (default 3; env DDLOCO_REFUSED_EXIT_CODE; compose sets 0 so that restart: on-failure "
                   "does not loop on a learner that will be refused again)")
    add_metrics(p, LearnerOptions)
    p.add_argument("--standby", action="store_true", help="a hot spare: prepare (imports, run config, model, dry "
                   "run), then wait for one JSON line on stdin, {\"learner_id\": ID, \"data_shard\": N, "
                   "\"max_steps\": N, \"slowdown\": X}, and become that learner; with \"fork\": true, \"log\": "
                   "PATH, \"reply\": PATH in the line it forks a copy that becomes the learner (pid written to "
                   "reply, exit status to reply.exit) and stays ready for the next (CPU only; how `ddloco up` "
                   "replaces failed learners fast)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the learner; the exit code (common.exits)."""
    from common.lean import pause_gc, quiet_blas
    quiet_blas(os.environ)   # a start without idle threads or needless collections (common/lean.py);
    pause_gc(os.environ)     # the collector on again once the imports are done (Joining._prepare)
    return command.daemon_main(PROG, build_parser(), argv, os.environ, cmd_learner)


def cmd_learner(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from learner import launch
    from learner.group import group_from_env
    ranks = group_from_env()
    if args.nproc is not None and args.nproc != 1 and ranks is None:   # a rank ignores it
        return launch.exec_torchrun(args.nproc, args.standby, args.argv)
    code = _learner(args, env, ranks)
    if launch.forked() or ranks is not None:
        # a fork's interpreter teardown walks (and so copies, page by page) every object it
        # inherited: 2-3 s per learner, 30 s and more with 32 on two cores. A torchrun rank's
        # teardown can be aborted by gloo's threads ("terminate called without an active
        # exception", SIGABRT) after its process group was destroyed and its work was done.
        # Everything is written (Redis, logs): end here, as multiprocessing ends its children.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _learner(args: argparse.Namespace, env: Mapping[str, str], ranks: tuple[int, int, int] | None) -> int:
    """One learner process (``ranks``: its place in a torchrun learner, learner/group.py)."""
    from common.lifecycle import install_stop_handlers
    cfg = command.resolve(args, env, FLAGS)
    opts = command.override_by_flags(args, cfg.learner, FLAGS, advertise_host=command.advertise_host(args, env),
                                     **command.metrics_options(args, env))
    command.setup_logging(args, env)
    if ranks is None or ranks[0] == 0:   # other ranks of a torchrun learner never reach Redis or the broker
        # a standby's identity (and so its key) is known only when it is told whom to replace
        command.security_check(cfg.endpoints, args, env, "learner", "" if args.standby else opts.learner_id)
        command.check_redis_answers(cfg.endpoints.redis_url, command.redis_url_source(args, env))
    stop = threading.Event()
    install_stop_handlers(stop)
    run, task = command.run_and_task(cfg, args, env, starts_run=False)
    import torch
    # the daemon's cores (`up` shares them between its learners); a standby prepares on one, as
    # a process that ran OpenMP on several cannot fork (the copy hangs in its first parallel op)
    torch.set_num_threads(1 if args.standby else opts.threads)
    return _train(args, env, cfg, opts, run, task, stop)


def _train(args: argparse.Namespace, env: Mapping[str, str], cfg: Any, opts: LearnerOptions, run: Any, task: Any,
           stop: threading.Event) -> int:
    """Train (or stand by) until done or stopped; a refusal or a lost run is one line and its exit code."""
    import redis
    from common.control import RunConfigMissing, redact
    from learner import launch
    from learner.api import train
    from learner.core import JoinTimeout, LearnerRefused
    try:
        if args.standby:
            return launch.standby(cfg, opts, task, run, stop)
        train(endpoints=cfg.endpoints, task=task, options=opts, run=run, stop=stop)
    except LearnerRefused as e:
        code = refused_exit_code(args, env)
        print(f"{PROG}: {e}" + (" (exit 0: not restarting, fix the learner's config or task and start it "
                                "again)" if code == 0 else ""), file=sys.stderr)
        return code
    except (JoinTimeout, RunConfigMissing) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return FAILURE
    except redis.RedisError as e:
        print(f"{PROG}: Redis at {redact(cfg.endpoints.redis_url)} failed: {e}", file=sys.stderr)
        return FAILURE
    return 0


def refused_exit_code(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """Exit status of a refused learner: ``--refused-exit-code`` or DDLOCO_REFUSED_EXIT_CODE, else
    REFUSED. Compose sets 0 so that ``restart: on-failure`` does not restart a learner the run
    will refuse again (a refusal needs a human; a crash or a kill is retried)."""
    raw = args.refused_exit_code if args.refused_exit_code is not None else env.get("DDLOCO_REFUSED_EXIT_CODE")
    try:
        return REFUSED if raw in (None, "") else int(raw)
    except ValueError:
        return REFUSED
