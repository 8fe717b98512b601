"""`python -m syncer` (= `ddloco syncer`): one syncer shard daemon, from its flags.

Owns fragments p with p % shards == shard. The flags are made from the config (``common.flags``);
the shared steps (config, checks, one-line errors) are ``common.command``. This module is the
shard's only reader of argv and the environment. Runs on the main thread.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Mapping, Sequence

from common import command
from common.config import SyncerOptions
from common.exits import FAILURE, REFUSED
from common.flags import Flag, add_algo, add_common, add_flags, add_metrics, metrics_flags

PROG = "ddloco syncer"
HELP = "run one syncer shard daemon"
DESCRIPTION = ("Owns fragments p with p % shards == shard. Publishes its run config to Redis (refused if the run "
               "has another one) unless --join takes the run's.")

OWN_FLAGS = (
    Flag("--shard", SyncerOptions, "shard"),
    Flag("--shards", SyncerOptions, "shards"),
    Flag("--checkpoint-dir", SyncerOptions, "checkpoint_dir"),
    Flag("--checkpoint-every", SyncerOptions, "checkpoint_every_merges"),
    Flag("--checkpoint-interval-s", SyncerOptions, "checkpoint_interval_s"),
    Flag("--rpc-bind", SyncerOptions, "rpc_bind", metavar="ENDPOINT"),
    Flag("--advertise-host", SyncerOptions, "advertise_host", note="env DDLOCO_ADVERTISE_HOST"),
    Flag("--merge-threads", SyncerOptions, "merge_threads"),
)
FRESH = Flag("--fresh", SyncerOptions, "fresh", sets=True)
FLAGS = (*OWN_FLAGS, FRESH, *metrics_flags(SyncerOptions))
"""The shard's flags that set a field of its options (``common.options.SyncerOptions``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of the shard, on ``p`` (its own parser, or `ddloco`'s subcommand)."""
    add_common(p, "syncer")
    add_algo(p)
    add_flags(p, OWN_FLAGS)
    p.add_argument("--join", action="store_true", help="take the run config from Redis instead of publishing one")
    add_metrics(p, SyncerOptions)
    FRESH.add_to(p)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the shard; the exit code (common.exits)."""
    return command.daemon_main(PROG, build_parser(), argv, os.environ, cmd_syncer)


def cmd_syncer(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from common.lifecycle import install_stop_handlers
    cfg = command.resolve(args, env, FLAGS)
    opts = command.override_by_flags(args, cfg.syncer, FLAGS, advertise_host=command.advertise_host(args, env),
                                     **command.metrics_options(args, env))
    command.setup_logging(args, env)
    command.security_check(cfg.endpoints, args, env, "syncer", f"shard{opts.shard}")
    command.check_redis_answers(cfg.endpoints.redis_url, command.redis_url_source(args, env))
    stop, checkpoint_now = threading.Event(), threading.Event()
    install_stop_handlers(stop)
    # SIGUSR1: write a checkpoint now (the dashboard's and an operator's `kill -USR1`), off the loop
    signal.signal(signal.SIGUSR1, lambda *_: checkpoint_now.set())
    run, task = command.run_and_task(cfg, args, env, starts_run=not args.join)
    from common.lifecycle import tune_allocator
    tune_allocator()   # each merge's fresh tensors reuse freed fragments' memory, without page faults
    return _serve(cfg, opts, run, task, stop, checkpoint_now)


def _serve(cfg: command.ConfigFile, opts: SyncerOptions, run: object, task: object, stop: threading.Event,
           checkpoint_now: threading.Event | None = None) -> int:
    """The shard's loop until stopped (``checkpoint_now``: set, a checkpoint is written and it is
    cleared); a refusal or a lost Redis is one line and its exit code."""
    import redis
    from common.control import ConfigMismatch, LeaseHeld, RunConfigMissing, redact
    from syncer.shard import CheckpointMismatch, Shard
    try:
        with Shard(endpoints=cfg.endpoints, options=opts, run=run, task=task) as shard:
            while not stop.is_set():
                shard.poll_once(20)
                if checkpoint_now is not None and checkpoint_now.is_set():
                    checkpoint_now.clear()
                    shard.checkpoint(reason="requested")
    except (ConfigMismatch, CheckpointMismatch, LeaseHeld) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return REFUSED
    except RunConfigMissing as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return FAILURE
    except redis.RedisError as e:
        print(f"{PROG}: Redis at {redact(cfg.endpoints.redis_url)} failed: {e}", file=sys.stderr)
        return FAILURE
    return 0
