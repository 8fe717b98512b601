"""Checks of single config values: the error type, and what makes an endpoint or a Redis URL.

Shared by every config dataclass (``common.config``, ``common.options``) and by the entry points
that check a flag before any socket sees it. Pure functions; no I/O.
"""
from __future__ import annotations

import re
from typing import Any, Callable


class ConfigError(ValueError):
    """A configuration value is out of range or unknown."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


ZMQ_ENDPOINT_FORMS = "tcp://HOST:PORT, ipc://PATH or inproc://NAME"
"""The ZeroMQ endpoints a daemon binds or connects to (HOST may be * or [IPv6] to bind; PORT 0 or *: any)."""

IPC_PATH_MAX_BYTES = 107
"""Longest ipc:// path (Linux: a Unix socket's address holds 108 bytes with the closing zero); libzmq
refuses a longer one at bind and at connect, deep inside a daemon."""

REDIS_URL_FORMS = "redis://[USER:PASSWORD@]HOST:PORT/DB, rediss://... (TLS) or unix://PATH"
"""The Redis URLs a process connects to."""


def redact_url(url: str) -> str:
    """``url`` without its password, for messages and logs (``redis://user:***@host:6379/0``)."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url or "")


def check_value(name: str, value: Any, problem: Callable[[Any], str]) -> None:
    """ConfigError "NAME 'VALUE': why" when ``problem(value)`` says what is wrong (NAME: a flag or
    a field; a URL is shown without its password)."""
    why = problem(value)
    if why:
        raise ConfigError(f"{name} {redact_url(value) if isinstance(value, str) else value!r}: {why}")


def endpoint_problem(endpoint: Any) -> str:
    """Why ``endpoint`` is not a ZeroMQ endpoint (``ZMQ_ENDPOINT_FORMS``); "" when it is one. The
    one check of every endpoint flag and field, before any socket sees it."""
    if not isinstance(endpoint, str):
        return f"not a ZeroMQ endpoint ({ZMQ_ENDPOINT_FORMS}): a {type(endpoint).__name__}"
    transport, sep, address = endpoint.partition("://")
    if not sep or transport not in ("tcp", "ipc", "inproc"):
        return f"not a ZeroMQ endpoint (expected {ZMQ_ENDPOINT_FORMS})"
    if not address or any(c.isspace() for c in address):
        what = {"tcp": "HOST:PORT", "ipc": "PATH", "inproc": "NAME"}[transport]
        return f"{transport}:// needs a {what} without spaces"
    if transport == "ipc" and len(address.encode()) > IPC_PATH_MAX_BYTES:
        return (f"an ipc path holds at most {IPC_PATH_MAX_BYTES} bytes (a Unix socket's address), this one "
                f"{len(address.encode())}: choose a shorter one")
    if transport == "tcp":
        m = re.fullmatch(r"(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\*|\d{1,5})", address)
        if m is None:
            return "a tcp endpoint is tcp://HOST:PORT (HOST a name, an address, * or [IPv6])"
        if m.group(2) != "*" and int(m.group(2)) > 65535:
            return f"port {m.group(2)} is above 65535"
    return ""


def redis_url_problem(url: Any) -> str:
    """Why ``url`` is not a Redis URL (``REDIS_URL_FORMS``); "" when it is one."""
    if not isinstance(url, str):
        return f"not a Redis URL ({REDIS_URL_FORMS}): a {type(url).__name__}"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "rediss", "unix"):
        return f"not a Redis URL (expected {REDIS_URL_FORMS})"
    if scheme == "unix":
        return "" if rest.split("?")[0] else "unix:// needs the socket's path"
    from urllib.parse import urlsplit
    try:
        urlsplit(url).port   # a port that is not a number, or out of range, raises
    except ValueError as e:
        return f"bad port ({e})"
    return ""
