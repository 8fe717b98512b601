"""`python -m broker` (= `ddloco broker`): the ZeroMQ forwarder daemon, from its flags.

The broker's own flags are declared here, once each (its options, ``broker.daemon.BrokerOptions``,
are not imported to build the parser: `--help` stays a fraction of a second); the cluster flags
and the shared steps are ``common.flags`` and ``common.command``. This module is the broker's only
reader of argv and the environment. Runs on the main thread.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Mapping, Sequence

from common import command
from common.exits import USAGE
from common.flags import add_common, add_metrics

PROG = "ddloco broker"
HELP = "run the ZeroMQ forwarder daemon"
DESCRIPTION = ("Forwards every published message to every subscriber: learners and shards publish to --xsub (their "
               "--broker-pub) and subscribe at --xpub (their --broker-sub). With --keys only the run's listed keys "
               "connect; with --run-id its counters go to the run's Redis.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of the broker, on ``p`` (its own parser, or `ddloco`'s subcommand)."""
    add_common(p, "broker")
    p.add_argument("--xsub", metavar="ENDPOINT", default="tcp://0.0.0.0:5555",
                   help="bind endpoint for publishers (default tcp://0.0.0.0:5555)")
    p.add_argument("--xpub", metavar="ENDPOINT", default="tcp://0.0.0.0:5556",
                   help="bind endpoint for subscribers (default tcp://0.0.0.0:5556)")
    add_metrics(p)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the broker; the exit code (common.exits)."""
    return command.daemon_main(PROG, build_parser(), argv, os.environ, cmd_broker)


def cmd_broker(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from broker.daemon import BrokerOptions, run_broker
    from common.config import override
    from common.lifecycle import install_stop_handlers
    from common.security import SecurityError
    command.setup_logging(args, env)
    cfg = command.resolve(args, env)
    command.security_check(cfg.endpoints, args, env, "broker", "broker")
    if cfg.endpoints.keys_dir and not args.shards and not args.run_id:
        print(f"{PROG}: with CURVE keys it forwards a shard's messages only from the fragment's owner, so it "
              "needs the run's shard count: pass --shards S, or --run-id (and --redis-url) to read it from the run's "
              "config", file=sys.stderr)
        return USAGE
    if args.run_id:  # its counters go to the run's Redis
        command.check_redis_answers(cfg.endpoints.redis_url, command.redis_url_source(args, env))
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        run_broker(override(BrokerOptions(xsub_bind=args.xsub, xpub_bind=args.xpub, hwm_messages=args.hwm,
                                          keys_dir=cfg.endpoints.keys_dir, shards=args.shards,
                                          fragments=args.fragments, max_subscriptions=args.max_subscriptions,
                                          max_message_bytes=int(args.max_message_mb * (1 << 20)),
                                          redis_url=cfg.endpoints.redis_url if args.run_id else "",
                                          run_id=args.run_id or ""), **command.metrics_options(args, env)), stop)
    except SecurityError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return USAGE
    return 0
