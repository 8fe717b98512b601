"""CurveZMQ keys, the ZAP handler that admits only the run's keys, and who may send what.

Layout of a keys directory (made by ``ddloco keys``, pyzmq's own certificate helpers)::

    DIR/public/broker/broker.key        the allow list: one public certificate per member,
    DIR/public/shard/shard0.key         in a folder named after its role; copy the whole
    DIR/public/learner/<id>.key         public/ tree to every host
    DIR/public/monitor/monitor.key
    DIR/secret/<name>.key_secret        each member's own secret certificate (mode 0600);
                                        a host needs only the ones of the members it runs

A member is named by its id: the broker ``broker``, shard k ``shard<k>``, a learner its learner
id, the ``ddloco up`` / ``ddloco export`` monitor ``monitor``. Every bound socket is a CURVE
server (broker XSUB/XPUB, shard RPC ROUTER, learner peer ROUTER) whose ZAP handler admits a
client only if its public key is in ``public/<role>/`` for a role that socket serves, and tags
its messages with the User-Id ``<role>:<id>``; the broker then checks that a message's kind
suits the role and that its header's sender is that id (``authorize``). Adding a member is adding
its public file before the member starts (libzmq does not retry a refused handshake); revoking one
is deleting it (refused at its next connection: connections already open stay open).

Threads: a ``ZapHandler`` runs on its own thread, which alone writes its ``failures`` and
``admitted`` counts (a daemon's loop reads copies) and reloads the ``AllowList`` when a key file
changes; the member's thread reloads it too when it needs a name not read yet (``public``). A
reload replaces whole dicts, never edits them, so a reader sees the old list or the new one.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import zmq
import zmq.auth

from common import wire
from common.keys import Keys
from common.wire import topic_fragment, topic_kind

ROLES = ("broker", "shard", "learner", "monitor")
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")

DOMAINS = {
    "broker": ("shard", "learner", "monitor"),   # broker XSUB/XPUB: every member
    "shard": ("learner", "monitor", "shard"),    # a shard's fragment RPC
    "peer": ("learner",),                        # a learner's state for joining peers
}
"""ZAP domain of a server socket -> the roles it admits."""

SENDS = {wire.OPEN: "shard", wire.FRAG: "shard", wire.NEED: "shard", wire.UPDATE: "learner", wire.HAVE: "learner"}
"""Message kind published through the broker -> the only role that may publish it."""


class SecurityError(RuntimeError):
    """Keys missing, unreadable or not made for this member."""


def create_keys(directory: str | os.PathLike, *, learners: Iterable[str] = (), shards: int = 0,
                monitors: Iterable[str] = ("monitor",), broker: bool = True, overwrite: bool = False) -> list[str]:
    """Create a key pair per member (pyzmq's ``create_certificates``) in the layout above.
    Existing pairs are kept unless ``overwrite``. Returns the names created."""
    root = Path(directory)
    members = ([("broker", "broker")] if broker else []) + [("shard", f"shard{k}") for k in range(shards)] \
        + [("learner", str(x)) for x in learners] + [("monitor", str(x)) for x in monitors]
    (root / "secret").mkdir(parents=True, exist_ok=True)
    os.chmod(root / "secret", 0o700)
    made = []
    for role, name in members:
        if not NAME_RE.fullmatch(name):
            raise SecurityError(f"member name {name!r}: use 1-64 characters of A-Z a-z 0-9 . _ -")
        pub_dir = root / "public" / role
        pub_dir.mkdir(parents=True, exist_ok=True)
        if (root / "secret" / f"{name}.key_secret").exists() and not overwrite:
            continue
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            pub, sec = zmq.auth.create_certificates(tmp, name)
            os.chmod(sec, 0o600)
            shutil.move(sec, root / "secret" / f"{name}.key_secret")
            shutil.move(pub, pub_dir / f"{name}.key")
        made.append(f"{role}/{name}")
    return made


@dataclass
class AllowList:
    """The public keys of the run's members, by role (read from ``public/<role>/*.key``)."""

    root: Path
    by_key: dict[bytes, tuple[str, str]] = field(default_factory=dict)
    by_name: dict[str, bytes] = field(default_factory=dict)
    loaded_at: float = 0.0
    signature: tuple = ()

    def load(self) -> "AllowList":
        sig = self._signature()
        by_key: dict[bytes, tuple[str, str]] = {}
        by_name: dict[str, bytes] = {}
        for role in ROLES:
            d = self.root / "public" / role
            if not d.is_dir():
                continue
            for f in sorted(d.glob("*.key")):
                try:
                    public, _ = zmq.auth.load_certificate(f)
                except (OSError, ValueError):
                    continue
                by_key[public] = (role, f.stem)
                by_name[f.stem] = public
        self.by_key, self.by_name, self.loaded_at = by_key, by_name, time.monotonic()
        self.signature = sig
        return self

    def _signature(self) -> tuple:
        """What changes when a public key file is added, removed or replaced."""
        out = []
        for role in ROLES:
            d = self.root / "public" / role
            try:
                out.append((role, d.stat().st_mtime_ns, tuple(sorted((f.name, f.stat().st_mtime_ns)
                                                                     for f in os.scandir(d)))))
            except OSError:
                out.append((role, None, ()))
        return tuple(out)

    def maybe_reload(self) -> None:
        """Read the allow list again if a file in it changed (a member added or revoked)."""
        if self._signature() != self.signature:
            self.load()

    def public(self, name: str) -> bytes:
        try:
            return self.by_name[name]
        except KeyError:
            self.load()
            if name not in self.by_name:
                raise SecurityError(f"no public key for {name!r} under {self.root / 'public'}") from None
            return self.by_name[name]


def check_keys_dir(keys_dir: str | os.PathLike) -> Path:
    """``keys_dir`` as a Path; SecurityError when it is not a folder (a mistyped --keys or
    DDLOCO_KEYS is told as such, not as one member's missing secret)."""
    root = Path(keys_dir)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise SecurityError(f"keys folder {root} {what} (make one with `ddloco keys --dir {root} ...`; "
                            f"see docs/SECURITY.md)")
    return root


class Security:
    """One member's CURVE identity and the run's allow list; ``server``/``client`` configure
    sockets, ``start_zap`` serves authentication for a context's server sockets."""

    def __init__(self, keys_dir: str | os.PathLike, name: str) -> None:
        self.root = check_keys_dir(keys_dir)
        self.name = name
        secret_file = self.root / "secret" / f"{name}.key_secret"
        if not secret_file.exists():
            raise SecurityError(f"no secret key for {name!r}: {secret_file} is missing "
                                f"(make it with `ddloco keys --dir {self.root} ...`, or run with --insecure)")
        try:
            self.public, self.secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as e:
            raise SecurityError(f"cannot read {secret_file}: {e}") from None
        if self.secret is None:
            raise SecurityError(f"{secret_file} holds no secret key")
        self.allow = AllowList(self.root).load()
        if self.allow.by_key.get(self.public, (None, None))[1] != name:
            raise SecurityError(f"{name!r}'s public key is not in the allow list {self.root / 'public'}")
        self.role = self.allow.by_key[self.public][0]
        self._zap: dict[int, ZapHandler] = {}

    def server(self, sock: zmq.Socket, domain: str) -> None:
        """Make ``sock`` (before bind) a CURVE server admitting the roles of ``domain``."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())

    def client(self, sock: zmq.Socket, server: str) -> None:
        """Make ``sock`` (before connect) a CURVE client of member ``server``."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.allow.public(server))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)

    def start_zap(self, ctx: zmq.Context) -> "ZapHandler":
        """The context's ZAP handler (one per context; started once)."""
        h = self._zap.get(id(ctx))
        if h is None:
            h = self._zap[id(ctx)] = ZapHandler(ctx, self.allow)
            h.start()
            h.ready.wait(5.0)
        return h

    def stop_zap(self, ctx: zmq.Context) -> None:
        h = self._zap.pop(id(ctx), None)
        if h is not None:
            h.stop()


class ZapHandler(threading.Thread):
    """ZAP (RFC 27) for CURVE: admits a client whose key is listed for a role the socket's
    domain serves; counts refusals by reason (``failures``); the User-Id is ``<role>:<id>``."""

    ENDPOINT = "inproc://zeromq.zap.01"

    def __init__(self, ctx: zmq.Context, allow: AllowList) -> None:
        super().__init__(name="zap", daemon=True)
        self.ctx = ctx
        self.allow = allow
        self.failures: dict[str, int] = {}
        self.admitted = 0
        self.banned: frozenset[str] = frozenset()
        """User-Ids (``<role>:<id>``) refused at every later handshake (``ban``; the broker's evictions)."""
        self.ready = threading.Event()
        self._halt = threading.Event()

    def ban(self, user_id: str) -> None:
        """Refuse ``user_id`` from now on, for this context's lifetime (set by its owner's thread,
        read here: one reference swap)."""
        self.banned = self.banned | {user_id}

    @property
    def auth_failures(self) -> int:
        return sum(self.failures.values())

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2.0)

    def run(self) -> None:
        sock = self.ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.ENDPOINT)
        self.ready.set()
        try:
            while not self._halt.is_set():
                if not sock.poll(100):
                    continue
                try:
                    req = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                sock.send_multipart(self.reply(req))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def decide(self, domain: str, mechanism: str, credentials: list[bytes]) -> tuple[bool, str, str]:
        """(admitted, reason or user id, role)."""
        if mechanism != "CURVE":
            return False, "mechanism", ""
        if domain not in DOMAINS:
            return False, "domain", ""
        if len(credentials) != 1 or len(credentials[0]) != 32:
            return False, "credentials", ""
        self.allow.maybe_reload()
        member = self.allow.by_key.get(zmq.utils.z85.encode(credentials[0]))
        if member is None:
            return False, "unknown_key", ""
        role, name = member
        if role not in DOMAINS[domain]:
            return False, "role", role
        if f"{role}:{name}" in self.banned:
            return False, "banned", role
        return True, f"{role}:{name}", role

    def reply(self, req: list[bytes]) -> list[bytes]:
        if len(req) < 6 or req[0] != b"1.0":
            self.failures["malformed"] = self.failures.get("malformed", 0) + 1
            rid = req[1] if len(req) > 1 else b""
            return [b"1.0", rid, b"500", b"malformed ZAP request", b"", b""]
        version, rid, domain, _address, _identity, mechanism, *creds = req
        ok, what, _role = self.decide(domain.decode(errors="replace"), mechanism.decode(errors="replace"), creds)
        if not ok:
            self.failures[what] = self.failures.get(what, 0) + 1
            return [version, rid, b"400", what.encode(), b"", b""]
        self.admitted += 1
        return [version, rid, b"200", b"OK", what.encode(), b""]


def frame_user_id(frame: Any) -> str:
    """The member a received ZeroMQ frame came from (ZAP's User-Id, ``<role>:<id>``); "" without
    CURVE, or for a frame that carries no properties (received with ``copy=True``)."""
    try:
        return frame.get("User-Id") or ""
    except (zmq.ZMQError, AttributeError):
        return ""


REFUSE_REASONS = ("unauthenticated", "wrong_role", "sender_mismatch", "unknown_kind", "malformed")
LIMIT_REASONS = ("not_owner", "shards_unknown", "rate_limited", "too_many_frames", "evicted")
"""Further refusals of the broker (``owner_refusal``, ``broker.limits``), counted with the above."""


def authorize(user_id: str, topic: bytes, header: bytes) -> str | None:
    """Broker rule for one published message: None if ``user_id`` (``<role>:<id>``) may publish
    it, else the reason (one of ``REFUSE_REASONS``). Only shards publish open/frag/need, only
    learners upd/have, and the header's sender must be the authenticated id."""
    role, _, name = user_id.partition(":")
    if not role or not name:
        return "unauthenticated"
    need = SENDS.get(topic_kind(topic))
    if need is None:
        return "unknown_kind"
    if role != need:
        return "wrong_role"
    try:
        sender = wire.peek_sender(header)
    except wire.HeaderError:
        return "malformed"
    if sender != name:
        return "sender_mismatch" if isinstance(sender, str) else "malformed"
    return None


OWNED_KINDS = (wire.OPEN, wire.FRAG, wire.NEED)
"""Kinds a shard publishes about one fragment: only the fragment's owner may."""


def owner_name(fragment: int, shards: int) -> str:
    """The member that owns ``fragment`` in a run of ``shards`` shards: ``shard<p % S>``."""
    return f"shard{fragment % shards}"


def owner_refusal(user_id: str, topic: bytes, shards: int) -> str | None:
    """Broker rule after ``authorize``: a shard's ``open``/``frag``/``need`` goes on only from the
    fragment's owner. None when allowed; ``shards_unknown`` while the broker does not know S
    (refused: an unknown S must not let any shard speak for every fragment); ``not_owner``."""
    if topic_kind(topic) not in OWNED_KINDS:
        return None
    if shards < 1:
        return "shards_unknown"
    fragment = topic_fragment(topic)
    if fragment is None or user_id.partition(":")[2] != owner_name(fragment, shards):
        return "not_owner"
    return None


def sent_by_owner(sender: str, fragment: int, shards: int) -> bool:
    """A learner's check of a shard's message (the broker verified ``sender`` is the publisher's
    key): True only when ``sender`` owns ``fragment`` and S is known."""
    return shards >= 1 and fragment >= 0 and sender == owner_name(fragment, shards)


def redis_acl_rules(run_id: str) -> str:
    """ACL rules of a member's Redis user (Redis >= 6): this run's keys only (``ddl:{run}:*``),
    every data command, none of the admin or dangerous ones (CONFIG, FLUSHALL, KEYS, DEBUG,
    SHUTDOWN, ACL, ...). Redis 6 cannot separate read from write per key pattern, so a member
    with it can still write another member's entries of the same run: on Redis >= 7 learners get
    users of their own instead (common/redis_acl.py, docs/SECURITY.md)."""
    return f"~{Keys(run_id).prefix}* +@all -@dangerous -@admin"


def from_options(keys_dir: str, name: str, insecure: bool) -> Security | None:
    """A member's security: ``None`` when ``insecure``; keys required otherwise."""
    if insecure:
        return None
    if not keys_dir:
        raise SecurityError("no CURVE keys: pass --keys DIR (made by `ddloco keys`) or run with --insecure")
    return Security(keys_dir, name)
