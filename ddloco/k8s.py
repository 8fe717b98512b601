"""Kubernetes: the run's Secrets, and each pod's own keys out of them (docs/deploy.md "Kubernetes").

    python -m ddloco.k8s secrets --keys DIR --run-id RUN --learners 16 --shards 2 > secrets.yaml
    python -m ddloco.k8s unpack --from /all-keys --to /keys --member learner-3   (an init container)

``secrets`` makes the CurveZMQ keys (``ddloco keys``) for the broker, the shards, learners
``learner-0`` .. ``learner-(N-1)`` (the learner StatefulSet's pods, so ``kubectl scale`` up to N) and
the monitor, an admin Redis password and a password per learner, and prints two Secrets:
``ddloco-keys`` (every key, flat: a Secret's keys cannot hold ``/``; plus each learner's Redis
URL) and ``ddloco-redis`` (Redis's ACL file, in which each learner's user writes only its own keys,
and the admin URL the shards use). Kept in DIR: running it again keeps every key and password.

``unpack`` (each pod's init container, which alone mounts ``ddloco-keys``) rebuilds the key
layout the daemons read in an ``emptyDir``: every public key, and the secret key and Redis URL of
``--member`` only. The daemon's own container never sees another member's secret.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

REDIS_SERVICE = "ddloco-redis"
REDIS_PORT = 6379
LEARNER_PREFIX = "learner-"
SEP = "--"
"""A flat Secret key ``public--<role>--<name>.key`` is the file public/<role>/<name>.key."""


def _password(path: Path) -> str:
    """The password kept in ``path`` (made, 0600, on first use)."""
    if not path.exists():
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(secrets.token_urlsafe(24) + "\n")
    return path.read_text().strip()


def _secret(name: str, data: dict[str, str], namespace: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/part-of": "ddloco"}}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(data.items())}}


def render_secrets(keys: Path, *, run_id: str, learners: int, shards: int, namespace: str = "") -> list[dict[str, Any]]:
    """The two Secrets (and the keys and passwords they hold, made in ``keys`` when missing)."""
    from common import redis_acl
    from common.security import create_keys
    ids = [f"{LEARNER_PREFIX}{i}" for i in range(learners)]
    create_keys(keys, learners=ids, shards=shards)
    admin = _password(keys / "secret" / "redis.password")
    files: dict[str, str] = {}
    for path in sorted(keys.rglob("*")):
        if path.is_file() and path.suffix in (".key", ".key_secret"):
            files[SEP.join(path.relative_to(keys).parts)] = path.read_text()
    acl = [f"user default on >{admin} ~* &* +@all"]
    for lid in ids:
        pw = _password(keys / "secret" / f"{lid}.redis.password")
        user = redis_acl.learner_user(lid)
        acl.append(f"user {user} on >{pw} {redis_acl.learner_rules(run_id, lid)}")
        files[SEP.join(("secret", f"{lid}.redis.env"))] = \
            f"DDLOCO_REDIS_URL=redis://{user}:{pw}@{REDIS_SERVICE}:{REDIS_PORT}/0\n"
    return [_secret("ddloco-keys", files, namespace),
            _secret("ddloco-redis", {"users.acl": "\n".join(acl) + "\n", "admin-password": admin,
                                     "admin-url": f"redis://:{admin}@{REDIS_SERVICE}:{REDIS_PORT}/0"}, namespace)]


def unpack(src: Path, dst: Path, member: str) -> list[str]:
    """The key layout for ``member`` in ``dst`` from the flat files of ``src``; returns what was
    written. Every public key; of the secrets, only ``member``'s."""
    written = []
    for f in sorted(src.iterdir()):
        parts = f.name.split(SEP)
        if f.name.startswith(".") or len(parts) < 2:
            continue   # a mounted Secret's ..data links
        if parts[0] == "secret" and parts[-1] not in (f"{member}.key_secret", f"{member}.redis.env"):
            continue
        target = dst.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(target.parent, 0o700 if parts[0] == "secret" else 0o755)
        shutil.copyfile(f, target)
        os.chmod(target, 0o600 if parts[0] == "secret" else 0o644)
        written.append("/".join(parts))
    if f"secret/{member}.key_secret" not in written:
        raise SystemExit(f"error: no secret key for {member!r} in {src}: make it with "
                         f"`python -m ddloco.k8s secrets --learners N` (N above this pod's ordinal)")
    return written


def _yaml(docs: list[dict[str, Any]]) -> str:
    """JSON is YAML: one document per object, no YAML library needed."""
    return "".join("---\n" + json.dumps(d, indent=2) + "\n" for d in docs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddloco.k8s", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    s = sub.add_parser("secrets", help="make keys and passwords in DIR, print the two Secrets")
    s.add_argument("--keys", required=True, help="where the keys and passwords are kept (made)")
    s.add_argument("--run-id", default="k8s", help="the run id of the manifests (default k8s)")
    s.add_argument("--learners", type=int, default=16, help="learner ids learner-0..N-1: the most pods (default 16)")
    s.add_argument("--shards", type=int, default=2, help="the syncer StatefulSet's replicas (default 2)")
    s.add_argument("--namespace", default="", help="metadata.namespace of the Secrets (default: none)")
    u = sub.add_parser("unpack", help="an init container: this pod's keys from the flat Secret")
    u.add_argument("--from", dest="src", required=True)
    u.add_argument("--to", dest="dst", required=True)
    u.add_argument("--member", required=True, help="broker, shard<k>, learner-<i>, monitor; "
                   "a trailing -<ordinal> of a pod name is read as shard<k> or learner-<i> with --ordinal-of")
    u.add_argument("--ordinal-of", default="", help="a pod name (e.g. $HOSTNAME): --member gets its ordinal appended")
    args = ap.parse_args(argv)
    if args.action == "secrets":
        keys = Path(args.keys)
        keys.mkdir(parents=True, exist_ok=True)
        os.chmod(keys, 0o700)
        sys.stdout.write(_yaml(render_secrets(keys, run_id=args.run_id, learners=args.learners, shards=args.shards,
                                              namespace=args.namespace)))
        return 0
    member = args.member + (args.ordinal_of.rsplit("-", 1)[-1] if args.ordinal_of else "")
    written = unpack(Path(args.src), Path(args.dst), member)
    print(f"keys for {member}: {len(written)} files in {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
