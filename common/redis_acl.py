"""Redis users of a run: who may write which keys (docs/SECURITY.md "Redis").

On Redis >= 7.0 (ACL key permissions ``%R~`` / ``%W~``) every learner id has its own user,
``learner.<id>``: it reads the run's keys and writes only its own (``learner:<id>``,
``hb:<id>``, ``life:<id>:*``, ``events:<id>``), with a short list of data commands (no
scripting, no SCAN/KEYS, no pub/sub, no SELECT/MOVE/SWAPDB, nothing of @admin or @dangerous).
Everything shared (config, membership, shard table, leases, epochs, fragment versions, the token
count, the events stream) is written by the shards, the broker or the operator.

On Redis < 7 a user's key patterns allow reading and writing alike: ``up`` then falls back to
one user per role (``role_rules``) and says what is lost (``FALLBACK_WARNING``).
"""
from __future__ import annotations

import re
import secrets
from typing import Any

from common.keys import Keys

MIN_VERSION = (7, 0)
"""The first Redis with per-pattern read/write key permissions."""

FALLBACK_WARNING = ("Redis {version} < 7.0: no per-learner Redis users (ACL %R~/%W~ key permissions need "
                    "Redis >= 7.0); learners share one role user that can write every key of the run "
                    "(config, membership, token count, shard table): use Redis >= 7.0 to confine them")

LEARNER_READS = ("get", "exists", "hget", "hmget", "hgetall", "smembers", "xrange", "ttl", "pttl", "type")
LEARNER_WRITES = ("set", "hset", "del", "expire", "pexpire", "xadd")
LEARNER_OTHER = ("ping", "echo")
"""Every command a learner sends (learner/core.py and the control helpers it calls)."""

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")   # common.security.NAME_RE: no glob character, no ':'


def parse_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of ``7.0.15`` or of a ``redis-server --version`` line (``v=7.0.15``);
    (0, 0) when there is none."""
    m = re.search(r"(?:v=|^)(\d+)\.(\d+)", text.strip())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def server_version(r: Any) -> tuple[int, int]:
    """The version of the Redis behind client ``r`` (INFO server)."""
    return parse_version(str(r.info("server").get("redis_version", "")))


def has_selectors(version: tuple[int, int]) -> bool:
    return version >= MIN_VERSION


def learner_user(learner_id: str) -> str:
    """The Redis user of one learner id."""
    return f"learner.{learner_id}"


def learner_rules(run_id: str, learner_id: str) -> str:
    """ACL rules (without ``on`` and the password) of learner ``learner_id``'s user (Redis >= 7)."""
    if not _NAME_RE.fullmatch(learner_id):
        raise ValueError(f"learner id {learner_id!r}: use 1-64 characters of A-Z a-z 0-9 . _ -")
    keys = Keys(run_id)
    own = (keys.learner(learner_id), keys.heartbeat(learner_id), keys.life(learner_id, "*"),
           keys.learner_events(learner_id))
    commands = " ".join(f"+{c}" for c in (*LEARNER_READS, *LEARNER_WRITES, *LEARNER_OTHER))
    return (f"resetkeys resetchannels %R~{keys.prefix}* " + " ".join(f"~{k}" for k in own)
            + f" -@all {commands}")


def reader_rules(run_id: str) -> str:
    """A user that reads the run's keys and writes none (``up``'s standby learners before they
    are told which learner to become; Redis >= 7)."""
    commands = " ".join(f"+{c}" for c in (*LEARNER_READS, *LEARNER_OTHER))
    return f"resetkeys resetchannels %R~{Keys(run_id).prefix}* -@all {commands}"


def role_rules(run_id: str) -> str:
    """A trusted role's user (broker, shard; every member on Redis < 7): the run's keys, every
    data command but the admin and dangerous ones (``common.security.redis_acl_rules``)."""
    from common.security import redis_acl_rules
    return redis_acl_rules(run_id)


def add_learner_user(admin: Any, run_id: str, learner_id: str, password: str = "") -> str:
    """Create (or reset) learner ``learner_id``'s user through an admin client; returns its
    password (a new random one unless given). Raises ValueError on a Redis < 7."""
    version = server_version(admin)
    if not has_selectors(version):
        raise ValueError(FALLBACK_WARNING.format(version=".".join(map(str, version))))
    password = password or secrets.token_urlsafe(24)
    admin.execute_command("ACL", "SETUSER", learner_user(learner_id), "reset", "on", f">{password}",
                          *learner_rules(run_id, learner_id).split())
    return password


def user_url(url: str, user: str, password: str) -> str:
    """``url`` (``redis://[user:pw@]host:port/db?...``) with ``user``'s credentials instead."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a Redis URL: {url!r}")
    hostpart = rest.split("@", 1)[1] if "@" in rest.split("/", 1)[0] else rest
    return f"{scheme}://{user}:{password}@{hostpart}"
