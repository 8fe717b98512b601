"""Container health checks that cost milliseconds: ``python -m common.health redis|http ...``.

A health check runs every few seconds in every container, so it must not import torch (which
``ddloco`` does): this module needs the standard library and ``common.redis_server`` (redis-py)
only.

- ``python -m common.health redis --port 6379 --password-file /keys/secret/redis.password``:
  healthy when Redis answers PING (after AUTH).
- ``python -m common.health http http://127.0.0.1:9100/metrics``: healthy when the daemon's
  metrics endpoint answers 200 and reports ``ddloco_up`` 1 (the daemon finished starting).

Exit status 0 healthy, 1 not (one line on stderr says why): what Docker and podman expect.
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from common import exits
from common.redis_server import ping

UP_METRIC = "ddloco_up"


def redis_healthy(host: str, port: int, password: str, timeout_s: float) -> str:
    """'' when Redis answers PING, else why not."""
    return "" if ping(host, port, timeout_s, password) else f"no PONG from Redis at {host}:{port}"


def http_healthy(url: str, timeout_s: float) -> str:
    """'' when ``url`` answers 200 with a ``ddloco_up`` sample of 1, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            body = reply.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{url}: {e}"
    for line in body.splitlines():
        if line.startswith(UP_METRIC) and line.split()[-1] in ("1", "1.0"):
            return ""
    return f"{url}: answered, but no `{UP_METRIC} 1` sample (still starting?)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.health", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("redis", help="PING a Redis server")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=6379)
    r.add_argument("--password-file", help="file holding the password (read at each check)")
    h = sub.add_parser("http", help="GET a daemon's metrics endpoint")
    h.add_argument("url")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    args = parser.parse_args(argv)
    if args.what == "redis":
        password = ""
        if args.password_file:
            try:
                with open(args.password_file, encoding="utf-8") as f:
                    password = f.read().strip()
            except OSError as e:
                print(f"unhealthy: cannot read {args.password_file}: {e}", file=sys.stderr)
                return exits.FAILURE
        why = redis_healthy(args.host, args.port, password, args.timeout)
    else:
        why = http_healthy(args.url, args.timeout)
    if why:
        print(f"unhealthy: {why}", file=sys.stderr)
        return exits.FAILURE
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
