"""The insider's writes with a learner's Redis credentials, and its task-spec attack (the
attacks' list and what each does: ``ddloco/insider.py``)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import redis

from ddloco.insider import Insider, hold, shard_endpoints


def _try(fn: Callable[[], Any]) -> dict[str, Any]:
    """Whether Redis let the learner's user do ``fn``: allowed, or refused with the server's reason."""
    try:
        fn()
        return {"allowed": True}
    except redis.RedisError as e:
        return {"allowed": False, "refused": f"{type(e).__name__}: {str(e)[:200]}"}


def attack_tokens(ins: Insider, seconds: float) -> dict[str, Any]:
    out = _try(lambda: ins.r.set(ins.keys.tokens, 10**15))
    hold(ins, seconds)
    return out


def attack_ghosts(ins: Insider, seconds: float) -> dict[str, Any]:
    def write() -> None:
        pipe = ins.r.pipeline(transaction=False)
        for i in range(20):
            lid = f"ghost-{i}"
            pipe.sadd(ins.keys.learners, lid)
            pipe.set(ins.keys.heartbeat(lid), "1")            # no TTL: never expires
            pipe.hset(ins.keys.learner(lid), mapping={"status": "training", "step_ema_s": 100.0})
        pipe.execute()
    out = _try(write)
    hold(ins, seconds)
    return out


_BUSY = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat local n = redis.call('TIME') until n[1] * 1000000 + n[2] - start > tonumber(ARGV[1]) * 1000000
return 1
"""


def attack_eval_busy(ins: Insider, seconds: float) -> dict[str, Any]:
    """A script that spins ``busy_s`` seconds; how long another client's PING waited meanwhile."""
    def conn() -> Any:
        return redis.Redis.from_url(ins.endpoints.redis_url, socket_timeout=ins.busy_s + 10, socket_connect_timeout=5,
                                    decode_responses=True)
    attacker = conn()
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(_try(lambda: attacker.eval(_BUSY, 0, ins.busy_s))), daemon=True)
    t.start()
    threading.Event().wait(0.2)
    other = conn()
    t0 = time.monotonic()
    while True:
        try:
            other.ping()
            break
        except redis.BusyLoadingError:
            pass
        except redis.ResponseError as e:   # BUSY: a script runs past lua-time-limit
            if "BUSY" not in str(e) or time.monotonic() - t0 > 60:
                break
        threading.Event().wait(0.05)
    frozen = time.monotonic() - t0
    t.join(ins.busy_s + 15)
    attacker.close()
    other.close()
    hold(ins, seconds)
    return {**result, "other_client_waited_s": round(frozen, 3)}


def attack_epochs(ins: Insider, seconds: float) -> dict[str, Any]:
    out = _try(lambda: ins.r.set(ins.keys.epochs, 2**63 - 1))
    hold(ins, seconds)
    return out


def attack_fake_shard(ins: Insider, seconds: float) -> dict[str, Any]:
    """Shard S (one past the last): its endpoint, a key nobody listed, S + 1 shards claimed."""
    n, _ = shard_endpoints(ins)

    def write() -> None:
        pipe = ins.r.pipeline(transaction=False)
        pipe.sadd(ins.keys.shards, n)
        pipe.hset(ins.keys.shard(n), mapping={"rpc": "tcp://127.0.0.1:9", "shards": n + 1, "pid": 1,
                                              "status": "running", "heartbeat_at": time.time()})
        pipe.execute()
    out = _try(write)
    hold(ins, seconds)
    return {**out, "shard": n}


def attack_shards_x(ins: Insider, seconds: float) -> dict[str, Any]:
    out = _try(lambda: ins.r.sadd(ins.keys.shards, "x"))
    hold(ins, seconds)
    return out


def attack_lease(ins: Insider, seconds: float) -> dict[str, Any]:
    n, _ = shard_endpoints(ins)
    k = max(n - 1, 0)
    out = _try(lambda: ins.r.set(ins.keys.shard_lease(k), "evil"))
    hold(ins, seconds)
    return {**out, "shard": k}


def attack_scan(ins: Insider, seconds: float) -> dict[str, Any]:
    """Keys of other runs the learner's user can list (and read)."""
    foreign: list[str] = []
    out = _try(lambda: foreign.extend(k for k in ins.r.scan_iter(match="*", count=1000)
                                      if not k.startswith(ins.keys.prefix)))
    read = 0
    for k in foreign[:50]:
        if _try(lambda k=k: ins.r.type(k) and ins.r.dump(k))["allowed"]:
            read += 1
    return {**out, "allowed": out["allowed"] and bool(foreign), "scan_allowed": out["allowed"],
            "foreign_keys": len(foreign), "foreign_keys_read": read, "examples": foreign[:5]}


# ----------------------------------------------------------------------------- the task spec
def attack_spec(ins: Insider, seconds: float,
                trigger: Callable[[Path], dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The run's stored task spec names ``subprocess:getoutput`` with ``touch MARKER``; watch for
    the marker for ``seconds`` (``trigger(marker)``: run victims, e.g. a process joining without
    --task, and say what they did); the original config is written back afterwards."""
    marker = (ins.marker_dir / f"insider-spec-marker-{ins.endpoints.run_id}").absolute()
    marker.unlink(missing_ok=True)
    original = ins.r.hget(ins.keys.config, "blob")
    blob = json.loads(original)
    blob["config"]["task"]["spec"] = "subprocess:getoutput"
    blob["config"]["task"]["args"] = {"cmd": f"touch {marker}"}
    out = _try(lambda: ins.r.hset(ins.keys.config, "blob", json.dumps(blob, sort_keys=True)))
    try:
        if trigger is not None:
            out.update(trigger(marker) or {})
        hold(ins, seconds, None)
    finally:
        if out["allowed"]:
            _try(lambda: ins.r.hset(ins.keys.config, "blob", original))
    return {**out, "marker": str(marker), "marker_appeared": marker.exists() or bool(out.get("ran_it"))}
