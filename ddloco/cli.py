"""`ddloco`: the command-line front end (the only code of the tools that reads argv).

    ddloco up       a whole local cluster (Redis, broker, S shards, M learners) + report
    ddloco status   live view of a run from Redis
    ddloco keys     CurveZMQ key pairs for a run's members (the allow list)
    ddloco broker   the ZeroMQ forwarder daemon            (= python -m broker:  broker/cli.py)
    ddloco syncer   one syncer shard daemon                 (= python -m syncer:  syncer/cli.py)
    ddloco learner  one learner daemon (--task: a built-in or your MODULE:ATTR)  (= python -m learner)
    ddloco sim      goodput simulator at paper scale
    ddloco bench    micro benchmarks of the hot paths
    ddloco compare  quality: DDP, one learner, sync DiLoCo, our cluster at equal tokens, seeds
    ddloco export   the global model of a live or stopped run as a safetensors / torch file
    ddloco chaos    seeded failures injected into a running cluster, and what they cost
    ddloco fuzz     seeded random and mutated frames thrown at a running cluster's endpoints
    ddloco slurm    a run on a Slurm cluster: services job, learner and scavenger job arrays

The daemons own their entry points (they never import ddloco); `ddloco broker|syncer|learner`
hands its arguments to them, and so do the tools with their own parsers. Flags that set a config
field are made from it (``common.flags``). Runs on the main thread.

Exit codes (common.exits): 0 success, 1 runtime failure, 2 bad usage or config, 3 refused by the run.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from broker import cli as broker_cli
from common import command
from common.config import ConfigError, LearnerOptions, UpOptions, override
from common.command import check_redis_answers  # noqa: F401  (imported from here by tools before)
from common.exits import FAILURE, REFUSED, USAGE
from common.flags import ALGO_FLAGS, ENDPOINT_FLAGS, Flag, add_algo, add_common, add_flags, flag_table
from ddloco.commands import delegate
from ddloco.flags import resolve
from learner import cli as learner_cli
from syncer import cli as syncer_cli

EXIT_FAILURE, EXIT_USAGE, EXIT_REFUSED = FAILURE, USAGE, REFUSED   # names tools imported from here before
_add_common, _resolve = add_common, resolve   # (common.exits, ddloco.flags); kept importable

UP_FLAGS = (
    Flag("--learners", UpOptions, "learners"),
    Flag("--syncers", UpOptions, "syncers"),
    Flag("--steps", UpOptions, "steps", note="none when --minutes is given"),
    Flag("--minutes", UpOptions, "minutes"),
    Flag("--learner-threads", UpOptions, "learner_threads", metavar="N"),
    Flag("--eval-every-s", UpOptions, "eval_every_s", metavar="SECONDS",
         note="it fetches every fragment: make it rarer for a large model; 0: every second"),
    Flag("--report", UpOptions, "report_dir", metavar="DIR", note="DIR/report.json, PNG plots and "
         "DIR/model.safetensors (the final global model; on Ctrl-C the freshest one); DIR is created and checked "
         "writable before anything starts"),
)
"""`up`'s flags that set a field of ``common.options.UpOptions``."""
UP_LEARNER_FLAGS = (Flag("--device", LearnerOptions, "device", note="of every learner"),)

_FLAG_OF_FIELD = flag_table((*ENDPOINT_FLAGS, *ALGO_FLAGS, *UP_FLAGS, *UP_LEARNER_FLAGS, *syncer_cli.FLAGS,
                             *learner_cli.FLAGS))
"""A config field, as its range check names it, -> (argparse dest, flag) of the flag that sets it."""

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


def _setup_up_logging(args: argparse.Namespace) -> None:
    """``up``'s own process talks to a person: its log lines (the embedded Redis's) are aligned
    like its progress lines unless --log-format asks otherwise, and --quiet leaves errors only.
    Its daemons log JSON lines to runs/<run>/logs (they are started with --log-format json)."""
    from common.log import configure_logging
    configure_logging(json_output=args.log_format == "json", brief=args.log_format == "auto",
                      level="error" if args.quiet else args.log_level)


# ---------------------------------------------------------------------------- up
def _up_resume(args: argparse.Namespace) -> Path | None:
    """--resume: the stopped run's work directory, its run id and (without --config) its settings;
    else a new run id unless one is given. A refused resume creates nothing."""
    from ddloco.up import new_run_id, resolve_resume
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
    return resume


def _up_extra(args: argparse.Namespace) -> tuple[int, float, float] | None:
    """--extra-learners N --extra-at SECONDS --extra-for SECONDS: temporary learners."""
    if not args.extra_learners:
        return None
    if args.extra_learners < 0 or args.extra_at is None or args.extra_for is None or args.extra_for <= 0:
        raise ConfigError("--extra-learners N needs --extra-at SECONDS and --extra-for SECONDS (> 0)")
    return (args.extra_learners, args.extra_at, args.extra_for)


def _up_slowdowns(args: argparse.Namespace) -> list[float] | None:
    """--slowdowns 1,1,1.18: a factor per learner."""
    if not args.slowdowns:
        return None
    try:
        slow = [float(x) for x in args.slowdowns.split(",")]
    except ValueError:
        raise ConfigError(f"--slowdowns must be a comma list of numbers >= 1, got {args.slowdowns!r}") from None
    if any(x < 1 for x in slow):
        raise ConfigError("--slowdowns factors must be >= 1")
    return slow


def cmd_up(args: argparse.Namespace) -> int:
    from ddloco.up import run_up
    if args.tensorboard:  # an optional package: refuse before anything starts
        from ddloco.tensorboard_log import tensorboard_missing
        missing = tensorboard_missing()
        if missing:
            print(missing, file=sys.stderr)
            return USAGE
    if args.wandb:
        from ddloco.wandb_log import wandb_missing
        missing = wandb_missing()
        if missing:
            print(missing, file=sys.stderr)
            return USAGE
    resume = _up_resume(args)
    cfg = resolve(args, (*UP_FLAGS, *UP_LEARNER_FLAGS))
    _setup_up_logging(args)  # library logs (embedded Redis) to stderr; progress lines go to stdout
    if args.redis_url is not None:   # an external Redis must answer before anything starts
        command.check_redis_answers(cfg.endpoints.redis_url, command.redis_url_source(args, os.environ))
    steps = args.steps
    if steps is None and args.minutes is not None:
        steps = 0  # --minutes alone: train for that long (no step budget)
    up = command.override_by_flags(args, cfg.up, UP_FLAGS, steps=steps)
    chaos = None
    if args.chaos:
        from ddloco.chaos import parse_chaos
        chaos = parse_chaos(args.chaos)
    extra = _up_extra(args)
    if cfg.run.algo.lockstep and args.quorum is None:  # the synchronous baseline waits for every learner
        cfg = override(cfg, run=override(cfg.run, algo=override(cfg.run.algo, quorum=up.learners)))
    slow = _up_slowdowns(args)
    cfg = override(cfg, learner=command.override_by_flags(args, cfg.learner, UP_LEARNER_FLAGS))
    rc = run_up(override(cfg, up=up), external_redis=args.redis_url is not None,
                step_time_floor_ms=args.step_time_floor_ms, slowdowns=slow, quiet=args.quiet, resume=resume,
                chaos=chaos, extra=extra, insecure=command.insecure(args, os.environ), tensorboard=args.tensorboard,
                broker_pub=args.broker_pub or "", broker_sub=args.broker_sub or "",
                wandb=args.wandb, wandb_name=os.environ.get("WANDB_NAME"), dashboard=_up_dashboard(args))
    # Everything is written and every child and Redis stopped. Rarely (after `--chaos`, on a loaded
    # machine) the interpreter's own shutdown aborted in native code ("terminate called without an
    # active exception", exit -6) after all of that; leave without it so the exit code is the run's.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ---------------------------------------------------------------------------- status, keys
def cmd_status(args: argparse.Namespace) -> int:
    from ddloco.status import run_status
    cfg = resolve(args)
    if args.watch is not None and (args.json or args.watch <= 0):
        raise ConfigError("--watch SECONDS must be > 0, without --json")
    if args.count < 0:
        raise ConfigError("--count must be >= 0")
    if args.watch is None:   # --watch shows a Redis that fails in its view and asks again
        command.check_redis_answers(cfg.endpoints.redis_url, command.redis_url_source(args, os.environ))
    return run_status(cfg.endpoints, as_json=args.json, watch_s=args.watch, count=args.count)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from common.files import read_env_file
    from ddloco.dashboard.cli import run_dashboard
    if args.access and not args.redis_url:   # the access file's Redis URL (the operator's) unless one is given
        args.redis_url = read_env_file(args.access).get("DDLOCO_REDIS_URL") or None
    cfg = resolve(args)
    command.check_redis_answers(cfg.endpoints.redis_url, command.redis_url_source(args, os.environ))
    return run_dashboard(cfg.endpoints, host=args.host, port=args.port, actions=args.actions, access=args.access)


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
        return USAGE
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
        return FAILURE
    for lid, url in urls.items():
        path = os.path.join(root, "secret", f"{lid}.redis.env")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
            fh.write(f"DDLOCO_REDIS_URL={url}\n")
    print(f"redis      {len(urls)} learner Redis user(s) for run {run_id!r}" + (
          " (each writes only its own keys)" if own else " (Redis < 7.0: the URL given)")
          + f": {root}/secret/<id>.redis.env (0600; `set -a; . FILE; set +a` on the learner's host)")
    return 0




# ---------------------------------------------------------------------------- parser
_UP_DESCRIPTION = ("Start Redis (embedded unless --redis-url), the broker (on free ports unless "
                   "--broker-pub/--broker-sub), --syncers shards and --learners learners as separate processes; show "
                   "progress; stop everything at the end or on Ctrl-C; write --report DIR/report.json and plots. "
                   "Secure by default: CURVE keys per member and, for the embedded Redis, a password, made for the "
                   "run (--insecure: none).")


def _add_up(sub: Any) -> None:
    p = sub.add_parser("up", help="run a whole local cluster and write a report", description=_UP_DESCRIPTION)
    add_common(p, "up")
    add_algo(p)
    add_flags(p, UP_FLAGS)
    p.add_argument("--step-time-floor-ms", type=float, default=None,
                   help="emulated accelerator step time of every learner: a step never takes less (ms)")
    p.add_argument("--slowdowns", default=None, help="comma list of per-learner slowdown factors, e.g. 1,1,1.18,1.18")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors (no progress or log lines, no digest of "
                   "the daemons' warnings)")
    p.add_argument("--resume", metavar="RUN_ID|DIR", help="continue a stopped run: its config, the shards' "
                   "checkpoints (fragment versions, momentum) and the learners' data positions, from its work "
                   "directory DIR (runs/<run-id>-<time>) or the one directory of RUN_ID (several: refused, "
                   "listing them)")
    add_flags(p, UP_LEARNER_FLAGS)
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
    p.add_argument("--wandb", metavar="PROJECT", help="also log the run to Weights & Biases project PROJECT as it "
                   "goes (eval/loss, merges, goodput, step times vs tokens); needs the wandb package; "
                   "WANDB_ENTITY, WANDB_NAME, WANDB_MODE=offline ... as usual")
    p.add_argument("--dashboard", type=int, nargs="?", const=8470, metavar="PORT", help="serve the run's live page "
                   "on 127.0.0.1:PORT (default 8470; 0: a free port), printed at the start (ddloco dashboard --help)")
    p.add_argument("--dashboard-actions", action="store_true", help="with --dashboard: its operator buttons (stall, "
                   "kill, add learners, checkpoint, stop), which need the token up prints and writes to access.env")
    p.set_defaults(func=cmd_up)


def _up_dashboard(args: argparse.Namespace) -> Any:
    if args.dashboard is None:
        if args.dashboard_actions:
            raise ConfigError("--dashboard-actions needs --dashboard")
        return None
    if not 0 <= args.dashboard <= 65535:
        raise ConfigError(f"--dashboard PORT must be 0-65535, got {args.dashboard}")
    from ddloco.up_dashboard import UpDashboard
    return UpDashboard(args.dashboard, actions=args.dashboard_actions)


def _add_status(sub: Any) -> None:
    p = sub.add_parser("status", help="live view of a run from Redis",
                       description="Members, their steps and last contribution, fragment versions, shards "
                                   "(reads Redis only; a run id that is not there is told with the runs that are).")
    add_common(p, "status")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", type=float, nargs="?", const=1.0, metavar="SECONDS", help="a live view redrawn every "
                   "SECONDS (default 1) until Ctrl-C; a Redis that fails is shown in the view and asked again")
    p.add_argument("--count", type=int, default=0, metavar="N", help="with --watch: leave after N refreshes "
                   "(exit 0 if the last one read the run)")
    p.set_defaults(func=cmd_status)


def _add_dashboard(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="the run's live web page: merges, membership, fragments, learners",
                       description="Serves the run's live page (reads Redis about once a second, whatever the "
                                   "number of pages): eval loss, throughput and goodput, each learner's lane, a "
                                   "fragment x time heatmap, every merge's quorum, grace, contributors, weights, "
                                   "staleness and alignment. Operator actions (stall or kill a learner, checkpoint) "
                                   "only with --actions and the run's operator token. `ddloco up --dashboard` "
                                   "starts the same inside up (with adding learners and stopping the run).")
    add_common(p, "dashboard")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8470, help="port (default 8470)")
    p.add_argument("--actions", action="store_true", help="allow operator actions (needs the operator token)")
    p.add_argument("--access", metavar="FILE", help="the run's access file (runs/<run>/access.env, written by up): "
                   "its operator token and Redis URL (default: DDLOCO_OPERATOR_TOKEN, the usual Redis URL)")
    p.set_defaults(func=cmd_dashboard)


def _add_keys(sub: Any) -> None:
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


_HELP_ONLY = {
    "sim": "goodput simulator at paper scale (ddloco sim --help)",
    "bench": "micro benchmarks: codec, wire, merge, broker, curve; sync: the daemons at scale; group: a torchrun "
             "learner per rank, DDP vs FSDP (ddloco bench --help)",
    "export": "write the global model (live run or checkpoints) to a safetensors file (ddloco export --help)",
    "chaos": "inject seeded failures into a running cluster on this machine and measure them (ddloco chaos --help)",
    "compare": "quality at equal tokens: DDP, one learner, sync DiLoCo, our cluster (ddloco compare --help)",
    "fuzz": "seeded random and mutated frames thrown at a running cluster's endpoints (ddloco fuzz --help)",
    "data": "data prepare: tokenize text/json/parquet files into a corpus read in place (ddloco data --help)",
    "slurm": "a run on a Slurm cluster: submit services, learner and scavenger arrays; add; report; stop "
             "(ddloco slurm --help)",
}
"""Commands whose flags their own parser lists (``ddloco.commands.DELEGATED``)."""


def build_parser() -> argparse.ArgumentParser:
    """Every command: `up`, `status`, `keys` run here; the daemons' flags are their packages'
    (``learner.cli`` ...), listed here for --help; the rest only name themselves."""
    ap = argparse.ArgumentParser(prog="ddloco", description="Decoupled DiLoCo: asynchronous, failure-tolerant "
                                 "distributed pre-training.",
                                 epilog="Exit codes: 0 success, 1 runtime failure, 2 bad usage or config (one line "
                                        "naming the flag or field), 3 refused by the run.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND",
                            help="`ddloco COMMAND --help` lists its flags")
    _add_up(sub)
    _add_status(sub)
    _add_dashboard(sub)
    _add_keys(sub)
    for daemon in (broker_cli, syncer_cli, learner_cli):
        daemon.add_arguments(sub.add_parser(daemon.PROG.split()[-1], help=daemon.HELP, description=daemon.DESCRIPTION))
    for name, text in _HELP_ONLY.items():
        sub.add_parser(name, help=text, add_help=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    code = delegate(argv)
    if code is not None:
        return code
    args = build_parser().parse_args(argv)
    args.argv = argv
    return command.run_command(f"ddloco {args.command}", args, os.environ, args.func)


if __name__ == "__main__":
    sys.exit(main())
