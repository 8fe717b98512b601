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

from common import retry
from common.config import RunConfig, redact_url, run_config_from_dict
from common.entries import (BAD_ENTRIES, MAX_SHARDS, parse_epoch, parse_int, parse_learner_entry,
                            parse_shard_entry, parse_shard_index, parse_version, shard_count_of)
from common.keys import CONFIG_KEY_PATTERN, EVENTS_MAXLEN, Keys, run_id_of_config_key
from common.lease import LeaseHeld, acquire_lease, lease_is_plausible, release_lease, renew_lease  # noqa: F401


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
    raw = r.hget(keys.config, "shards")
    theirs = parse_int(raw, lo=1, hi=MAX_SHARDS) if raw is not None else shards
    if theirs is None:   # not a shard count: no shard wrote it; ours replaces it
        BAD_ENTRIES.reject("config", "bad_shards", value=raw)
        r.hset(keys.config, "shards", shards)
        theirs = shards
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
    next_warning = started + warn_after_s

    def warn() -> None:
        nonlocal next_warning
        now = time.monotonic()
        if on_wait is not None and now >= next_warning:
            on_wait(describe_missing_run(r, keys, redis_url, when=" yet"))
            next_warning = now + warn_every_s

    blob = retry.until(lambda: r.hget(keys.config, "blob") or None, retry.Deadline(started + wait_s),
                       interval_s=0.2, stop=stop, between=warn)
    if blob:
        return _parse_run_config(keys, blob)
    when = f" after {time.monotonic() - started:.0f} s" if wait_s > 0 else ""
    raise RunConfigMissing(f"{describe_missing_run(r, keys, redis_url, when=when)}; a run is started by "
                           f"`ddloco up` or a syncer (check --run-id and --redis-url)")


def _parse_run_config(keys: Keys, blob: str) -> RunConfig:
    """The run config of a ``config`` blob; RunConfigMissing (one line, counted) when the blob is
    not one (a member overwrote it); a field out of range is ConfigError from the config's checks."""
    try:
        doc = json.loads(blob)
        body = doc["config"] if isinstance(doc, dict) else None
    except (ValueError, KeyError):
        body = None
    if not isinstance(body, dict):
        BAD_ENTRIES.reject("config", "not_a_run_config", run=keys.run_id)
        raise RunConfigMissing(f"the run config of run {keys.run_id!r} in Redis is not a run config "
                               f"(not JSON with a 'config' object: overwritten?); restore it by restarting a "
                               f"syncer of the run with its config")
    return run_config_from_dict(body)


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
        out[(lid, inc)] = parse_learner_entry(lid, r.hgetall(k))
    return out


def life_token_counts(r: redis.Redis, keys: Keys, *, skip: Any = frozenset()) -> dict[tuple[str, str], Any]:
    """The ``tokens`` each learner process's ``life`` hash reports, by (learner id, incarnation),
    as read (a SCAN of ``life:*``); the processes in ``skip`` (``<id>:<incarnation>``) are not read."""
    return {life: values[0] for life, values in life_fields(r, keys, ("tokens",), skip=skip).items()}


def life_fields(r: redis.Redis, keys: Keys, fields: tuple[str, ...], *,
                skip: Any = frozenset()) -> dict[tuple[str, str], list[Any]]:
    """``fields`` of each learner process's ``life`` hash, as read (a SCAN of ``life:*``), by
    (learner id, incarnation); the processes in ``skip`` (``<id>:<incarnation>``) are not read."""
    prefix = keys.prefix + "life:"
    found = []
    for k in r.scan_iter(match=prefix + "*", count=1000):
        lid, _, inc = k[len(prefix):].rpartition(":")
        if f"{lid}:{inc}" not in skip:
            found.append((lid, inc))
    pipe = r.pipeline(transaction=False)
    for lid, inc in found:
        pipe.hmget(keys.life(lid, inc), *fields)
    return dict(zip(found, pipe.execute())) if found else {}


def finished_learners(r: redis.Redis, keys: Keys, ids: Iterable[str]) -> set[str]:
    """Those of ``ids`` that left after their training ended on its own (their budget or data done:
    ``leave(..., finished=True)``); a killed learner's entry keeps its last status, one stopped
    mid-run says it did not finish."""
    ids = sorted(ids)
    if not ids:
        return set()
    pipe = r.pipeline(transaction=False)
    for m in ids:
        pipe.hmget(keys.learner(m), "status", "finished")
    return {m for m, (st, done) in zip(ids, pipe.execute()) if st == "left" and done == "1"}


def learner_ids(r: redis.Redis, keys: Keys) -> set[str]:
    """Every learner id with an entry in Redis (one SCAN): who was in the run before this process
    started watching it."""
    prefix = keys.learner("")
    return {k[len(prefix):] for k in r.scan_iter(match=prefix + "*", count=1000)}


def leave(pipe: Any, keys: Keys, learner_id: str, *, finished: bool = False) -> None:
    """Deregister a learner (graceful stop): no longer counted live (its own keys only).
    ``finished``: its training ended on its own (lock-step stops waiting for it)."""
    pipe.delete(keys.heartbeat(learner_id))
    pipe.hset(keys.learner(learner_id), mapping={"status": "left", "finished": int(finished)})


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
    return {m: parse_learner_entry(m, res[2 * i + 1]) for i, m in enumerate(members) if res[2 * i]}


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
        out[k[len(prefix):]] = parse_learner_entry(k[len(prefix):], r.hgetall(k))
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


def register_shard(pipe: Any, keys: Keys, shard: int, fields: Mapping[str, Any]) -> None:
    """Shard entry (rpc endpoint, shard count, counters); re-written periodically."""
    pipe.sadd(keys.shards, shard)
    pipe.hset(keys.shard(shard), mapping=dict(fields))


def shard_table(r: redis.Redis, keys: Keys) -> dict[int, dict[str, str]]:
    """Every registered shard's hash, by shard index; members and hashes that are not a shard's
    (``parse_shard_index``, ``parse_shard_entry``) are counted and left out."""
    ids = sorted({k for k in map(parse_shard_index, r.smembers(keys.shards)) if k is not None})
    pipe = r.pipeline(transaction=False)
    for k in ids:
        pipe.hgetall(keys.shard(k))
    table = {k: parse_shard_entry(k, h) for k, h in zip(ids, pipe.execute()) if h}
    return {k: h for k, h in table.items() if h is not None}


def shard_endpoints(r: redis.Redis, keys: Keys) -> tuple[int, dict[int, str]]:
    """(S, {shard: rpc endpoint}) of the registered shards; S = 0 when none registered."""
    table = shard_table(r, keys)
    n = shard_count_of(table)
    for k, h in table.items():
        if int(h["shards"]) != n:
            BAD_ENTRIES.reject("shard", "count_disagrees", shard=k, shards=h["shards"], run_shards=n)
    return n, {k: h["rpc"] for k, h in table.items() if int(h["shards"]) == n}


def record_layout(r: Any, keys: Keys, layout: list[tuple[str, tuple[int, ...], str]]) -> None:
    """Record the run's model state layout (name, shape, kind) once, so that a refused process
    can be told the first tensor that differs."""
    r.hsetnx(keys.config, "layout", json.dumps([[n, list(s), k] for n, s, k in layout]))


def run_layout(r: redis.Redis, keys: Keys) -> list[tuple[str, tuple[int, ...], str]] | None:
    """The layout recorded by ``record_layout`` (None if none yet)."""
    blob = r.hget(keys.config, "layout")
    if not blob:
        return None
    try:
        return [(str(n), tuple(int(d) for d in s), str(k)) for n, s, k in json.loads(blob)]
    except (ValueError, TypeError):   # not a layout (a member overwrote it): as if none was recorded
        BAD_ENTRIES.reject("config", "bad_layout", run=keys.run_id)
        return None


def fragment_versions(r: redis.Redis, keys: Keys, fragments: Iterable[int]) -> dict[int, int | None]:
    """The version the run recorded for each fragment (None: not recorded, e.g. Redis restarted)."""
    fragments = list(fragments)
    pipe = r.pipeline(transaction=False)
    for p in fragments:
        pipe.hget(keys.fragment(p), "version")
    return {p: parse_version(p, v) for p, v in zip(fragments, pipe.execute())}


_RAISE = "local v = tonumber(redis.call('GET', KEYS[1]) or '0') if not v or v < tonumber(ARGV[1]) then " \
         "redis.call('SET', KEYS[1], ARGV[1]) return tonumber(ARGV[1]) end return v"


def raise_counter(r: Any, key: str, value: int) -> Any:
    """Atomically set ``key`` to ``value`` if it holds less (the run's epoch counter is put back
    after Redis lost it, never moved back). Returns the value now held (on a pipeline: its
    entry in ``execute()``)."""
    res = r.eval(_RAISE, 1, key, int(value))
    return int(res) if isinstance(res, (int, str, bytes)) else res


def take_epoch(r: redis.Redis, keys: Keys, floor: int) -> int:
    """A starting shard's epoch: the run's counter, put back to at least ``floor`` (its checkpoint's
    epoch) and to the epochs the shards' entries state, then incremented. A counter that is not an
    epoch (not an int, negative, beyond MAX_VERSION: INCR would fail at 2^63) is counted, logged
    and replaced by that floor, so no value a member writes there stops a shard from starting."""
    raw = r.get(keys.epochs)
    stated = [parse_int(h.get("epoch")) for h in shard_table(r, keys).values()]
    floor = max([floor, *(e for e in stated if e is not None)])
    if raw is not None and parse_epoch(raw) is None:
        # compare-and-set: a shard that replaced it meanwhile is not undone
        r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2]) end "
               "return 0", 1, keys.epochs, raw, int(floor))
    raise_counter(r, keys.epochs, floor)
    return int(r.incr(keys.epochs))


def restore_run_config(r: redis.Redis, keys: Keys, cfg: RunConfig,
                       layout: list[tuple[str, tuple[int, ...], str]]) -> bool:
    """A running shard's check of the run's ``config`` hash: a blob that is not this run's config
    (not JSON, another digest) or a layout that is not its layout was overwritten by a member;
    both are written back (counted ``config.rewritten``). The config is set once per run, so any
    difference is damage. True when something was written back."""
    blob = r.hget(keys.config, "blob")
    try:
        ok = blob is not None and _parse_run_config(keys, blob).digest() == cfg.digest()
    except (RunConfigMissing, ValueError, TypeError):   # ConfigError is a ValueError
        ok = False
    same_layout = run_layout(r, keys) == [(n, tuple(s), k) for n, s, k in layout]
    if ok and same_layout:
        return False
    BAD_ENTRIES.reject("config", "rewritten", run=keys.run_id)
    pipe = r.pipeline(transaction=False)
    if not ok:
        pipe.hset(keys.config, "blob", _config_blob(cfg))
    if not same_layout:
        pipe.hset(keys.config, "layout", json.dumps([[n, list(s), k] for n, s, k in layout]))
    pipe.execute()
    return True
