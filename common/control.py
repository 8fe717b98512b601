"""Control-plane operations on Redis: run config, membership, heartbeats, events.

Every write helper accepts a pipeline so callers batch their round trips. Redis is
coordination only: each daemon re-writes its own entries periodically, so a Redis that
restarts empty is rebuilt without losing training progress.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterable, Mapping

import redis

from common.config import RunConfig, redact_url, run_config_from_dict
from common.keys import CONFIG_KEY_PATTERN, EVENTS_MAXLEN, Keys, run_id_of_config_key


class ConfigMismatch(RuntimeError):
    """This process's run config differs from the one the run was started with."""


class RunConfigMissing(RuntimeError):
    """No run config in Redis (the run was not started, or wrong run id / Redis URL)."""


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs (``redis://user:***@host:6379/0``)."""
    return redact_url(url)


def connect(url: str, *, timeout_s: float = 2.0) -> redis.Redis:
    """A Redis client with bounded timeouts (a lost Redis must never hang a daemon). A refused
    connection is retried for about 2 s (Redis restarting: a process starting in that window
    must not exit); a timeout is not retried."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s, health_check_interval=10,
                                retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 7),
                                retry_on_error=[redis.ConnectionError])


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def describe_difference(ours: RunConfig, theirs: RunConfig) -> str:
    """Human-readable list of the fields that differ, e.g. 'algo.quorum=2 (run has 1)'."""
    a, b = _flatten(ours.identity()), _flatten(theirs.identity())
    diffs = [f"{k}={a.get(k)!r} (run has {b.get(k)!r})" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if ours.task.data_digest != theirs.task.data_digest:
        diffs.append(f"this process's data: {ours.task.data_source or 'not described'}; the run's: "
                     f"{theirs.task.data_source or 'not recorded'}")
    return ", ".join(diffs) or "no field differs (digest mismatch)"


def _config_blob(cfg: RunConfig) -> str:
    return json.dumps({"digest": cfg.digest(), "config": cfg.to_dict(), "created_at": time.time()}, sort_keys=True)


def publish_run_config(r: Any, keys: Keys, cfg: RunConfig) -> None:
    """Record the run config once (one atomic HSETNX); raise ConfigMismatch if the run already
    has another one. Also usable on a pipeline to re-publish after Redis restarted empty."""
    created = r.hsetnx(keys.config, "blob", _config_blob(cfg))
    if created or not isinstance(created, (int, bool)):  # pipeline: checked on the next call
        return
    theirs = fetch_run_config(r, keys)
    if theirs.digest() != cfg.digest():
        raise ConfigMismatch(f"refused: config of run {keys.run_id!r} differs: {describe_difference(cfg, theirs)}")


def claim_shard_count(r: redis.Redis, keys: Keys, shards: int) -> None:
    """The number of shards is fixed for a run (ownership is p % S): refuse another S."""
    r.hsetnx(keys.config, "shards", shards)
    theirs = int(r.hget(keys.config, "shards") or shards)
    if theirs != shards:
        raise ConfigMismatch(f"refused: run {keys.run_id!r} has {theirs} shards, this shard was started with "
                             f"--shards {shards}")


RUNS_LISTED = 20
"""At most this many run ids are named when a run id is not found."""


def runs_in_redis(r: redis.Redis, *, limit: int = RUNS_LISTED) -> list[str] | None:
    """Run ids that have a config in this Redis (sorted, at most ``limit``, from a SCAN of the
    config key pattern); None when the listing fails (an ACL user may not scan)."""
    found: set[str] = set()
    try:
        for key in r.scan_iter(match=CONFIG_KEY_PATTERN, count=1000):
            run_id = run_id_of_config_key(key)
            if run_id is not None:
                found.add(run_id)
                if len(found) >= limit:
                    break
    except redis.RedisError:
        return None
    return sorted(found)


def describe_missing_run(r: redis.Redis, keys: Keys, redis_url: str, *, when: str = "") -> str:
    """Why a run config is not found, for a person: the run id, where we looked (``when``: " yet",
    " after 120 s"), the runs that are there."""
    runs = runs_in_redis(r)
    if runs is None:
        seen = "(cannot list them)"
    else:
        seen = (", ".join(runs) + (", ..." if len(runs) >= RUNS_LISTED else "")) if runs else "none"
    where = f" at {redact(redis_url)}" if redis_url else ""
    return (f"no run config for run id {keys.run_id!r} in Redis{where}{when}: is the run id right? "
            f"runs seen there: {seen}")


def fetch_run_config(r: redis.Redis, keys: Keys, *, wait_s: float = 0.0, stop: Any | None = None,
                     redis_url: str = "", on_wait: Callable[[str], None] | None = None,
                     warn_after_s: float = 3.0, warn_every_s: float = 30.0) -> RunConfig:
    """Read the run config; wait up to ``wait_s`` for it to appear. While it waits, ``on_wait``
    gets ``describe_missing_run`` (the run id, ``redis_url``, the runs that are there) once
    ``warn_after_s`` have passed, then every ``warn_every_s``: a mistyped run id is told within
    seconds, not when the wait gives up."""
    started = time.monotonic()
    deadline = started + wait_s
    next_warning = started + warn_after_s
    while True:
        blob = r.hget(keys.config, "blob")
        if blob:
            return run_config_from_dict(json.loads(blob)["config"])
        now = time.monotonic()
        if now >= deadline or (stop is not None and stop.is_set()):
            when = f" after {now - started:.0f} s" if wait_s > 0 else ""
            raise RunConfigMissing(f"{describe_missing_run(r, keys, redis_url, when=when)}; a run is started by "
                                   f"`ddloco up` or a syncer (check --run-id and --redis-url)")
        if on_wait is not None and now >= next_warning:
            on_wait(describe_missing_run(r, keys, redis_url, when=" yet"))
            next_warning = now + warn_every_s
        (stop.wait(0.2) if stop is not None else time.sleep(0.2))


LIFE_TTL_S = 24 * 3600


def beat(pipe: Any, keys: Keys, learner_id: str, fields: Mapping[str, Any], ttl_s: float) -> None:
    """Heartbeat + counters of a learner, batched on ``pipe`` (its own keys only: the shards keep
    the membership set, ``sync_members``); the counters also go to the process's own ``life``
    hash (a restart under the same id overwrites the first)."""
    pipe.hset(keys.learner(learner_id), mapping=dict(fields))
    pipe.set(keys.heartbeat(learner_id), "1", px=int(ttl_s * 1000))
    if fields.get("incarnation"):
        life = keys.life(learner_id, str(fields["incarnation"]))
        pipe.hset(life, mapping=dict(fields))
        pipe.expire(life, LIFE_TTL_S)


def learner_lives(r: redis.Redis, keys: Keys) -> dict[tuple[str, str], dict[str, str]]:
    """The last counters of every learner process of the run, by (learner id, incarnation)."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    prefix = keys.prefix + "life:"
    for k in r.scan_iter(match=prefix + "*", count=500):
        lid, _, inc = k[len(prefix):].rpartition(":")
        out[(lid, inc)] = r.hgetall(k)
    return out


def life_token_counts(r: redis.Redis, keys: Keys, *, skip: Any = frozenset()) -> dict[tuple[str, str], Any]:
    """The ``tokens`` each learner process's ``life`` hash reports, by (learner id, incarnation),
    as read (a SCAN of ``life:*``); the processes in ``skip`` (``<id>:<incarnation>``) are not read."""
    prefix = keys.prefix + "life:"
    found = []
    for k in r.scan_iter(match=prefix + "*", count=1000):
        lid, _, inc = k[len(prefix):].rpartition(":")
        if f"{lid}:{inc}" not in skip:
            found.append((lid, inc))
    pipe = r.pipeline(transaction=False)
    for lid, inc in found:
        pipe.hget(keys.life(lid, inc), "tokens")
    return dict(zip(found, pipe.execute())) if found else {}


def leave(pipe: Any, keys: Keys, learner_id: str) -> None:
    """Deregister a learner (graceful stop): no longer counted live (its own keys only)."""
    pipe.delete(keys.heartbeat(learner_id))
    pipe.hset(keys.learner(learner_id), "status", "left")


def live_learners(r: redis.Redis, keys: Keys) -> dict[str, dict[str, str]]:
    """Members with a fresh heartbeat, with their counters."""
    members = sorted(r.smembers(keys.learners))
    if not members:
        return {}
    pipe = r.pipeline(transaction=False)
    for m in members:
        pipe.exists(keys.heartbeat(m))
        pipe.hgetall(keys.learner(m))
    res = pipe.execute()
    return {m: res[2 * i + 1] for i, m in enumerate(members) if res[2 * i]}


def sync_members(r: redis.Redis, keys: Keys) -> set[str]:
    """The membership set as the shards keep it (a learner writes only its own keys): the ids
    with a heartbeat key (one SCAN of ``hb:*``) are added, members without one removed, so a
    member that stopped leaves no ghost. Returns the ids with a heartbeat."""
    prefix = keys.heartbeat("")
    beating = {k[len(prefix):] for k in r.scan_iter(match=prefix + "*", count=1000)}
    members = set(r.smembers(keys.learners))
    pipe = r.pipeline(transaction=False)
    if beating - members:
        pipe.sadd(keys.learners, *sorted(beating - members))
    if members - beating:
        pipe.srem(keys.learners, *sorted(members - beating))
    pipe.execute()
    return beating


def all_learners(r: redis.Redis, keys: Keys) -> dict[str, dict[str, str]]:
    """Every learner hash of the run (live or not), found by scanning learner:* keys."""
    out: dict[str, dict[str, str]] = {}
    prefix = keys.learner("")
    for k in r.scan_iter(match=prefix + "*", count=500):
        out[k[len(prefix):]] = r.hgetall(k)
    return out


def add_event(r_or_pipe: Any, keys: Keys, kind: str, **fields: Any) -> None:
    """Append to the capped events stream (join, leave, merge, drop, refuse, failure)."""
    entry = {"kind": kind, "t": f"{time.time():.6f}"}
    for k, v in fields.items():
        entry[k] = v if isinstance(v, (str, int, float)) else json.dumps(v)
    r_or_pipe.xadd(keys.events, entry, maxlen=EVENTS_MAXLEN, approximate=True)


LEARNER_EVENTS_MAXLEN = 1_000


def add_learner_event(r_or_pipe: Any, keys: Keys, learner_id: str, kind: str, **fields: Any) -> None:
    """A learner's event (join, leave, refuse) in its own capped stream: a learner writes no shared key."""
    entry = {"kind": kind, "t": f"{time.time():.6f}"}
    for k, v in fields.items():
        entry[k] = v if isinstance(v, (str, int, float)) else json.dumps(v)
    entry["learner"] = learner_id
    r_or_pipe.xadd(keys.learner_events(learner_id), entry, maxlen=LEARNER_EVENTS_MAXLEN, approximate=True)


def learner_event_streams(r: redis.Redis, keys: Keys) -> dict[str, str]:
    """Every learner's own event stream, by learner id (a SCAN of ``events:*``)."""
    prefix = keys.learner_events("")
    return {k[len(prefix):]: k for k in r.scan_iter(match=prefix + "*", count=1000)}


def read_events(r: redis.Redis, keys: Keys, *, kind: str | None = None) -> list[dict[str, Any]]:
    """Every event of the run (oldest first): the shared stream and every learner's own, whose
    entries name that learner whatever they say; optionally of one kind."""
    out = []
    for _id, e in r.xrange(keys.events):
        if kind is None or e.get("kind") == kind:
            out.append(e)
    for lid, key in learner_event_streams(r, keys).items():
        for _id, e in r.xrange(key):
            if kind is None or e.get("kind") == kind:
                out.append({**e, "learner": lid})
    return sorted(out, key=lambda e: _event_time(e))


def _event_time(e: Mapping[str, Any]) -> float:
    try:
        return float(e.get("t", 0.0))
    except (TypeError, ValueError):
        return 0.0


def check_run_config(r: redis.Redis, keys: Keys, cfg: RunConfig, **wait: Any) -> RunConfig:
    """A member started with its own config: wait for the run's (``fetch_run_config``'s
    ``wait``), which only the shards and the operator write, and raise ConfigMismatch if it
    differs from ``cfg``. Returns the run's."""
    theirs = fetch_run_config(r, keys, **wait)
    if theirs.digest() != cfg.digest():
        raise ConfigMismatch(f"refused: config of run {keys.run_id!r} differs: {describe_difference(cfg, theirs)}")
    return theirs


class LeaseHeld(RuntimeError):
    """Another live process holds this shard's lease (two shards must never own one fragment)."""


_RENEW_LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not cur then return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 1 or 0 end
return 0
"""


def acquire_lease(r: redis.Redis, key: str, holder: str, *, ttl_s: float, wait_s: float) -> None:
    """Take the lease, waiting up to ``wait_s`` for a crashed holder's lease to expire."""
    deadline = time.monotonic() + wait_s
    while not r.set(key, holder, nx=True, px=int(ttl_s * 1000)):
        if time.monotonic() >= deadline:
            raise LeaseHeld(f"refused: {key} is held by {r.get(key)!r} (is this shard already running?)")
        time.sleep(min(0.2, ttl_s / 4))


def renew_lease(r: redis.Redis, key: str, holder: str, *, ttl_s: float) -> bool:
    """Extend our lease (re-take it if Redis lost it); False if another process holds it."""
    return bool(r.eval(_RENEW_LEASE, 1, key, holder, int(ttl_s * 1000)))


def release_lease(r: redis.Redis, key: str, holder: str) -> None:
    """Give the lease up if it is still ours (graceful stop: a successor starts at once)."""
    r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
           1, key, holder)


def register_shard(pipe: Any, keys: Keys, shard: int, fields: Mapping[str, Any]) -> None:
    """Shard entry (rpc endpoint, shard count, counters); re-written periodically."""
    pipe.sadd(keys.shards, shard)
    pipe.hset(keys.shard(shard), mapping=dict(fields))


def shard_table(r: redis.Redis, keys: Keys) -> dict[int, dict[str, str]]:
    """Every registered shard's hash, by shard index."""
    ids = sorted(int(k) for k in r.smembers(keys.shards))
    pipe = r.pipeline(transaction=False)
    for k in ids:
        pipe.hgetall(keys.shard(k))
    return {k: h for k, h in zip(ids, pipe.execute()) if h}


def shard_endpoints(r: redis.Redis, keys: Keys) -> tuple[int, dict[int, str]]:
    """(S, {shard: rpc endpoint}) of the registered shards; S = 0 when none registered."""
    table = shard_table(r, keys)
    counts = {int(h.get("shards", 0)) for h in table.values()}
    n = max(counts) if counts else 0
    return n, {k: h["rpc"] for k, h in table.items() if h.get("rpc") and k < n}


def record_layout(r: Any, keys: Keys, layout: list[tuple[str, tuple[int, ...], str]]) -> None:
    """Record the run's model state layout (name, shape, kind) once, so that a refused process
    can be told the first tensor that differs."""
    r.hsetnx(keys.config, "layout", json.dumps([[n, list(s), k] for n, s, k in layout]))


def run_layout(r: redis.Redis, keys: Keys) -> list[tuple[str, tuple[int, ...], str]] | None:
    """The layout recorded by ``record_layout`` (None if none yet)."""
    blob = r.hget(keys.config, "layout")
    return None if not blob else [(n, tuple(s), k) for n, s, k in json.loads(blob)]


def fragment_versions(r: redis.Redis, keys: Keys, fragments: Iterable[int]) -> dict[int, int | None]:
    """The version the run recorded for each fragment (None: not recorded, e.g. Redis restarted)."""
    fragments = list(fragments)
    pipe = r.pipeline(transaction=False)
    for p in fragments:
        pipe.hget(keys.fragment(p), "version")
    return {p: None if v is None else int(v) for p, v in zip(fragments, pipe.execute())}


def data_position(r: redis.Redis, keys: Keys, learner_id: str) -> int:
    """Batches this learner id consumed in earlier lives (0 if unknown: a new id)."""
    return int(float(r.hget(keys.learner(learner_id), "data_position") or 0))


_RAISE = "local v = tonumber(redis.call('GET', KEYS[1]) or '0') if v < tonumber(ARGV[1]) then " \
         "redis.call('SET', KEYS[1], ARGV[1]) return tonumber(ARGV[1]) end return v"


def raise_counter(r: Any, key: str, value: int) -> Any:
    """Atomically set ``key`` to ``value`` if it holds less (the run's epoch counter is put back
    after Redis lost it, never moved back). Returns the value now held (on a pipeline: its
    entry in ``execute()``)."""
    res = r.eval(_RAISE, 1, key, int(value))
    return int(res) if isinstance(res, (int, str, bytes)) else res
