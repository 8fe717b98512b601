"""The steps every daemon's command line shares, after its flags are parsed: resolve the config
(TOML file, then flags, then the environment the entry point hands in), check URLs, endpoints,
keys and Redis before anything starts, set up logging, and turn the user's errors into one line.

    cfg = resolve(args, env, flags)                 # ConfigFile; a bad value names its flag
    opts = override_by_flags(args, cfg.syncer, flags, **metrics_options(args, env))
    return run_command("ddloco syncer", args, env, cmd_syncer)   # exit 2 + one line on bad input

Only entry points read the environment: each passes ``os.environ`` (``env``) down; nothing here
reads argv or the environment itself. Exit codes are ``common.exits``. Threads: the entry
point's main thread; the one mutable state, the cache of compiled field-name patterns
(``_field_names``), only ever gains the same entries.
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

from common.config import (ConfigError, ConfigFile, Endpoints, TaskConfig, check_value, endpoint_problem,
                           load_config, override, redact_url, redis_url_problem)
from common.exits import USAGE
from common.flags import ALGO_FLAGS, ENDPOINT_FLAGS, Flag, changes, flag_table, given

Env = Mapping[str, str]


@functools.cache
def _field_names(fields: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(r"(?<![\w.])(" + "|".join(re.escape(f) for f in sorted(fields, key=len, reverse=True))
                      + r")(?!\w)")


def name_flags(message: str, args: argparse.Namespace, flags: Iterable[Flag]) -> str:
    """``message`` with each config field it names (``up.learners``) replaced by the flag that set
    it (``--learners``) when that flag was given: the user reads what they typed."""
    table = flag_table(flags)
    if not table:
        return message

    def named(m: re.Match[str]) -> str:
        dest, flag = table[m.group(1)]
        value = getattr(args, dest, None)
        return flag if value is not None and value is not False else m.group(1)   # 0 is a value
    return _field_names(tuple(table)).sub(named, message)


def override_by_flags(args: argparse.Namespace, obj: Any, flags: Iterable[Flag], **extra: Any) -> Any:
    """``override(obj, ...)`` with the fields the flags given set (and ``extra``, which wins): a
    value out of range is named by the flag the user typed (``--learners must be >= 1``), not by
    the config field that holds it (``up.learners``, which names a value from the TOML file)."""
    flags = tuple(flags)
    try:
        return override(obj, **{**changes(args, flags, type(obj)), **extra})
    except ConfigError as e:
        raise ConfigError(name_flags(str(e), args, flags)) from None


def task_from_args(args: argparse.Namespace, env: Env, task: TaskConfig) -> TaskConfig:
    """--task / --task-arg, else DDLOCO_TASK / DDLOCO_TASK_ARGS, over the TOML [task] table."""
    from common.task import TaskError, parse_task_args
    spec = getattr(args, "task", None) or env.get("DDLOCO_TASK") or None
    items = getattr(args, "task_arg", None)
    if items is None and env.get("DDLOCO_TASK_ARGS"):
        items = env["DDLOCO_TASK_ARGS"].split()
    try:
        extra = parse_task_args(items or [])
    except TaskError as e:
        raise ConfigError(str(e)) from None
    if spec is not None and spec != task.spec:
        task = override(task, spec=spec, args={})  # another task: the TOML's args were for the old one
    return override(task, args={**task.args, **extra}) if extra else task


def resolve(args: argparse.Namespace, env: Env, flags: Iterable[Flag] = ()) -> ConfigFile:
    """The TOML file (--config), then the cluster flags (and DDLOCO_REDIS_URL, DDLOCO_KEYS), then
    the algorithm and task flags of a command that has them; ``flags``: the command's own, to
    name them in errors."""
    flags = (*ENDPOINT_FLAGS, *ALGO_FLAGS, *flags)
    cfg = load_config(args.config)
    endpoints = override_by_flags(args, cfg.endpoints, flags, redis_url=args.redis_url or env.get("DDLOCO_REDIS_URL")
                                  or None, broker_pub=args.broker_pub, broker_sub=args.broker_sub,
                                  keys_dir=getattr(args, "keys", None) or env.get("DDLOCO_KEYS") or None)
    run = cfg.run
    if hasattr(args, "quorum"):
        algo = override_by_flags(args, run.algo, flags)
        task = override_by_flags(args, run.task, flags)
        run = override(run, algo=algo, task=task_from_args(args, env, task))
    return override(cfg, run=run, endpoints=endpoints)


def algo_given(args: argparse.Namespace) -> bool:
    """A config file or an algorithm flag: the process brings a whole run config (which must
    equal the run's, or starts the run)."""
    return args.config is not None or given(args, ALGO_FLAGS)


def task_given(args: argparse.Namespace, env: Env) -> bool:
    return bool(getattr(args, "task", None) or getattr(args, "task_arg", None) or env.get("DDLOCO_TASK"))


def run_and_task(cfg: ConfigFile, args: argparse.Namespace, env: Env, *, starts_run: bool) -> tuple[Any, Any]:
    """What a daemon brings to the run: the whole run config (``starts_run``, a config file or
    algorithm flags), or only its task (``--task``: joins with the run's settings, checked to be
    the same task), or nothing (the run's config and task, from Redis)."""
    if starts_run or algo_given(args):
        return cfg.run, None
    if task_given(args, env):
        from common.task import allow_tasks, load_task
        allow_tasks([cfg.run.task.spec])   # named by this process: the run's spec may be recorded as it
        return None, load_task(cfg.run.task.spec, cfg.run.task.args)
    return None, None


_ENDPOINT_FLAGS = (("redis_url", "--redis-url", redis_url_problem), ("broker_pub", "--broker-pub", endpoint_problem),
                   ("broker_sub", "--broker-sub", endpoint_problem), ("xsub", "--xsub", endpoint_problem),
                   ("xpub", "--xpub", endpoint_problem), ("rpc_bind", "--rpc-bind", endpoint_problem),
                   ("peer_bind", "--peer-bind", endpoint_problem))
"""Flags holding a Redis URL or a ZeroMQ endpoint, and the check of each (common.config)."""


def check_flag_values(args: argparse.Namespace, env: Env) -> None:
    """Every URL and endpoint flag (and DDLOCO_REDIS_URL) before anything starts: a bad one is one
    line naming the flag and the value (exit 2), not a traceback from deep inside a socket."""
    for attr, flag, problem in _ENDPOINT_FLAGS:
        if getattr(args, attr, None) is not None:
            check_value(flag, getattr(args, attr), problem)
    if hasattr(args, "redis_url") and args.redis_url is None and env.get("DDLOCO_REDIS_URL"):
        check_value("DDLOCO_REDIS_URL", env["DDLOCO_REDIS_URL"], redis_url_problem)


def redis_url_source(args: argparse.Namespace, env: Env) -> str:
    """Where the Redis URL came from, as an error names it."""
    if args.redis_url is not None:
        return "--redis-url"
    if env.get("DDLOCO_REDIS_URL"):
        return "DDLOCO_REDIS_URL"
    return f"[endpoints] redis_url of {args.config}" if args.config else "--redis-url (default)"


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
        raise ConfigError(f"{source} {redact_url(url)!r}: Redis does not answer there ({e})") from None


def metrics_options(args: argparse.Namespace, env: Env) -> dict[str, Any]:
    """--metrics-port / --metrics-host, else DDLOCO_METRICS_PORT / DDLOCO_METRICS_HOST (None: the
    options' defaults, no endpoint)."""
    port = args.metrics_port
    raw = env.get("DDLOCO_METRICS_PORT", "")
    if port is None and raw:
        try:
            port = int(raw)
        except ValueError:
            raise ConfigError(f"DDLOCO_METRICS_PORT must be a port number, got {raw!r}") from None
    return {"metrics_port": port, "metrics_host": args.metrics_host or env.get("DDLOCO_METRICS_HOST") or None}


def advertise_host(args: argparse.Namespace, env: Env) -> str | None:
    """--advertise-host, else DDLOCO_ADVERTISE_HOST (how compose passes the host's address)."""
    return args.advertise_host or env.get("DDLOCO_ADVERTISE_HOST") or None


def insecure(args: argparse.Namespace, env: Env) -> bool:
    return bool(getattr(args, "insecure", False)) or env.get("DDLOCO_INSECURE", "") not in ("", "0")


def security_check(endpoints: Endpoints, args: argparse.Namespace, env: Env, who: str, member: str = "") -> None:
    """Secure by default: a daemon without keys refuses to start unless --insecure says so; with
    keys, ``member``'s secret and listing are checked before anything else starts."""
    from common.log import get_logger
    if endpoints.keys_dir:
        from common.security import Security, check_keys_dir
        check_keys_dir(endpoints.keys_dir)   # SecurityError: exit 2 (a standby's member is known later)
        if member:
            Security(endpoints.keys_dir, member)  # SecurityError: exit 2 with what is missing
        return
    if not insecure(args, env):
        raise ConfigError("no CurveZMQ keys: pass --keys DIR (make them with `ddloco keys --dir DIR ...`) "
                          "or run with --insecure")
    get_logger(who).warning(f"{who}.insecure", detail="--insecure: ZeroMQ traffic is neither authenticated nor "
                            "encrypted; anyone who reaches the endpoints can join, read and publish")


def setup_logging(args: argparse.Namespace, env: Env | None = None) -> None:
    """structlog as ``--log-format`` and ``--log-level`` say; a daemon (``env`` given) first imports
    redis and structlog without the optional packages it never uses (``common.lean``)."""
    fmt = {"auto": None, "json": True, "console": False}[args.log_format]
    if env is not None:
        from common.lean import lean_start
        lean_start(env, json_logs=fmt if fmt is not None else not sys.stderr.isatty())
    from common.log import configure_logging
    configure_logging(json_output=fmt, level=args.log_level)


def allow_tasks_from_env(env: Env) -> None:
    """DDLOCO_TASKS_ALLOWED (MODULE:ATTR, comma separated): tasks this process may import when the
    run's config names them (a learner joining without --task); nothing from Redis is trusted."""
    raw = env.get("DDLOCO_TASKS_ALLOWED", "")
    if raw.strip():
        from common.task import allow_tasks
        allow_tasks(raw.split(","))


def usage_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's input (exit 2, one line): taken from the modules that define
    them only when those were imported (an error cannot come from a module never loaded), so
    that `status` or the broker do not import torch through `common.fragments` or the tasks."""
    out: list[type[BaseException]] = [ConfigError]
    for module, name in (("common.fragments", "FragmentationError"), ("common.task", "TaskError"),
                         ("common.security", "SecurityError")):
        if module in sys.modules:
            out.append(getattr(sys.modules[module], name))
    return tuple(out)


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)`` as `ddloco`'s parser answers a daemon's arguments: one it does
    not know is refused with `ddloco`'s usage line (exit 2), as `ddloco COMMAND` always did."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        argparse.ArgumentParser(prog="ddloco", usage="%(prog)s [-h] COMMAND ...").error(
            f"unrecognized arguments: {' '.join(unknown)}")
    return args


def daemon_main(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None, env: Env,
                func: Callable[[argparse.Namespace, Env], int]) -> int:
    """A daemon's ``main``: parse ``argv`` (default: the process's) as `ddloco COMMAND` would, keep
    it on ``args.argv``, then ``run_command`` with ``func(args, env)``; the exit code (common.exits)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(parser, argv)
    args.argv = argv
    return run_command(prog, args, env, lambda a: func(a, env))


def run_command(prog: str, args: argparse.Namespace, env: Env,
                func: Callable[[argparse.Namespace], int]) -> int:
    """Run a parsed command: the tasks the environment allows, every URL and endpoint flag
    checked, then ``func``; the user's errors are one line ``PROG: why`` and exit 2, Ctrl-C 130."""
    allow_tasks_from_env(env)
    try:
        check_flag_values(args, env)
        return func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not isinstance(e, usage_errors()):
            raise
        print(f"{prog}: {e}", file=sys.stderr)
        return USAGE
