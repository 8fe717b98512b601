"""Redis entries as typed values: one parser per kind of entry, and the count of the ones refused.

Every member's Redis user can write every key of the run (until per-member ACL users), so a value
read back is input, like a wire message: each parser returns a typed value or None, and what it
refuses is counted by kind and reason (``BAD_ENTRIES``), logged once per kind and reason, and
ignored: no reader dies on it. Pure functions (no Redis here): ``common/control.py`` reads, these
parse.
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Mapping

MAX_SHARDS = 4096
"""No run has more shards than this: a shard index or count beyond it is not a shard's entry."""
MAX_VERSION = 2**53
"""No fragment version, epoch or counter a run reaches (2^53: exact in a float, far from INCR's
2^63 overflow)."""
LEASE_TTL_MAX_S = 600.0
"""No shard writes a lease longer than this (``syncer.lease_ttl_s`` is seconds): a lease with a
longer TTL, or none, was not written by a shard."""
LEARNER_NUMBERS = ("merged_contributions", "last_merged_at", "steps", "tokens", "step_ema_s", "loss_ema", "lr",
                   "answers", "merges_applied", "updated_at", "started_at", "stopped_at", "data_position",
                   "position_ahead", "train_s", "blocked_s", "boot_s", "flush_s",
                   "bytes_up", "bytes_down", "last_contrib_at", "schedule_tokens", "cpu_s", "cpu_s_at_joined",
                   "peak_rss_mb", "version_gaps", "versions_regressed", "fetches", "malformed", "flushed",
                   "unflushed", "bytes_fetched", "chunks_fetched", "bootstraps_served", "schedule_regressions",
                   "answers_replaced", "pid", "stale_opens", "bad_entries",
                   "d2h_copies", "d2h_ms", "h2d_copies", "h2d_ms", "stream_waits", "stream_wait_ms", "gpu_peak_mb")
"""Fields of a learner's hash that hold a number (``Learner._counters``, the shards' counts): a
value that is not a finite number of magnitude below ``MAX_VERSION`` (a loss may be negative) is
dropped from the entry (readers see it missing)."""
LEARNER_INTS = ("steps", "tokens", "answers", "merges_applied", "merged_contributions", "data_position",
                "position_ahead", "pid", "schedule_tokens", "bad_entries")
"""Of those, the ones that hold a count: an integral value is kept as its canonical digits
(readers may ``int()`` it), any other is dropped."""
SHARD_TEXTS = ("rpc", "plan", "checkpoint", "status")
"""Fields of a shard's hash that hold text; every other field holds a number."""
TEXT_MAX_CHARS = 256
"""A text field of an entry (status, host, peer, ...) longer than this is dropped."""


class BadEntries:
    """Malformed Redis entries this process ignored, by ``kind.reason`` (a bounded set of names:
    the kinds and reasons are this module's, never the input's). Each ``kind.reason`` is logged
    once (a flood of the same bad entry is one line and a count). Read and written by any thread:
    the lock guards ``_counts``."""

    def __init__(self) -> None:
        self._counts_lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def reject(self, kind: str, reason: str, **context: Any) -> None:
        name = f"{kind}.{reason}"
        with self._counts_lock:
            first = name not in self._counts
            self._counts[name] = self._counts.get(name, 0) + 1
        if first:
            import sys

            import structlog
            # a tool that set up no logging (`status --json`: its stdout is the JSON) logs to stderr
            log = structlog.get_logger("control") if structlog.is_configured() else structlog.wrap_logger(
                structlog.PrintLogger(sys.stderr))
            log.warning("control.bad_entry", kind=kind, reason=reason, **{k: str(v)[:120] for k, v in context.items()})

    def snapshot(self) -> dict[str, int]:
        with self._counts_lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._counts_lock:
            return sum(self._counts.values())


BAD_ENTRIES = BadEntries()
"""This process's count of ignored Redis entries (its stats and metrics expose ``snapshot()``)."""


def parse_int(raw: Any, *, lo: int = 0, hi: int = MAX_VERSION) -> int | None:
    """``raw`` (a Redis string) as an int in [lo, hi] (an integral float string like "3.0" too);
    None when it is not one."""
    if isinstance(raw, bool) or raw is None:
        return None
    if isinstance(raw, int):
        value = raw
    else:
        try:
            text = str(raw).strip()
            value = int(text) if text.lstrip("-").isdigit() else int(float(text)) if float(text).is_integer() else None
        except (ValueError, OverflowError):
            return None
    return value if value is not None and lo <= value <= hi else None


def parse_number(raw: Any, *, lo: float = 0.0, hi: float = float(MAX_VERSION)) -> float | None:
    """``raw`` as a finite float in [lo, hi]; None when it is not one."""
    if isinstance(raw, bool) or raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError, OverflowError):
        return None
    return value if math.isfinite(value) and lo <= value <= hi else None


def parse_shard_index(raw: Any) -> int | None:
    """A member of the ``shards`` set: a shard index in [0, MAX_SHARDS); else counted, None."""
    k = parse_int(raw, hi=MAX_SHARDS - 1)
    if k is None:
        BAD_ENTRIES.reject("shards", "not_an_index", value=raw)
    return k


def parse_shard_entry(k: int, h: Mapping[str, str]) -> dict[str, str] | None:
    """Shard k's hash if it is one a shard writes: an rpc endpoint, a shard count in
    [1, MAX_SHARDS] above k; else counted and None."""
    from common.config import endpoint_problem
    shards = parse_int(h.get("shards"), lo=1, hi=MAX_SHARDS)
    if shards is None or k >= shards:
        BAD_ENTRIES.reject("shard", "bad_count", shard=k, shards=h.get("shards"))
        return None
    if not h.get("rpc") or endpoint_problem(h["rpc"]):
        BAD_ENTRIES.reject("shard", "bad_endpoint", shard=k, rpc=h.get("rpc"))
        return None
    out = {"shards": str(shards)}
    for key, value in h.items():
        if key in SHARD_TEXTS:
            if len(str(value)) <= TEXT_MAX_CHARS:
                out[key] = value
            continue
        number = parse_number(value)
        if number is None:
            if key != "shards":
                BAD_ENTRIES.reject("shard", "bad_number", shard=k, field=key, value=value)
        elif key != "shards":
            out[key] = str(int(number)) if number.is_integer() else repr(number)
    return out


def parse_fragment_entry(p: int, h: Mapping[str, str]) -> dict[str, Any]:
    """Fragment p's hash (``frag:<p>``) as numbers (version, shard, round, failed_rounds; a missing
    or malformed one, counted, reads as its default) and text (contributors, problem)."""
    out: dict[str, Any] = {}
    for key, default, lo in (("version", 0, 0), ("shard", -1, -1), ("round", -1, -1), ("failed_rounds", 0, 0)):
        raw = h.get(key)
        value = parse_int(raw, lo=lo) if raw is not None else default
        if value is None:
            BAD_ENTRIES.reject("fragment", f"bad_{key}", fragment=p, value=raw)
            value = default
        out[key] = value
    for key in ("contributors", "problem"):
        out[key] = str(h.get(key, ""))[:TEXT_MAX_CHARS * 16]
    return out


def parse_eval_entry(h: Mapping[str, str]) -> dict[str, float] | None:
    """``up``'s last evaluation (the ``eval`` hash) as numbers: loss, initial_loss, tokens, at;
    None when there is none or it is malformed (counted)."""
    if not h.get("loss"):
        return None
    loss = parse_number(h.get("loss"), lo=-1e30, hi=1e30)
    initial = parse_number(h.get("initial_loss", h.get("loss")), lo=-1e30, hi=1e30)
    tokens = parse_number(h.get("tokens", 0))
    at = parse_number(h.get("at", time.time()))
    if None in (loss, initial, tokens, at):
        BAD_ENTRIES.reject("eval", "bad_number")
        return None
    return {"loss": loss, "initial_loss": initial, "tokens": tokens, "at": at}


def parse_broker_entry(h: Mapping[str, str]) -> dict[str, Any]:
    """The broker's counters (its ``broker`` hash): auth_failures (an int), auth_failures_by_reason
    and refused (reason -> int); a malformed part is counted and reads as none."""
    failures = parse_int(h.get("auth_failures") or 0)
    if failures is None:
        BAD_ENTRIES.reject("broker", "bad_number", value=h.get("auth_failures"))
    return {"auth_failures": failures or 0, "auth_failures_by_reason": _count_map(h.get("auth_failures_by_reason")),
            "broker_refused": _count_map(h.get("refused"))}


def _count_map(raw: Any) -> dict[str, int]:
    """A JSON object of reason -> count (at most 64 reasons of 64 characters); {} and counted
    when it is not one."""
    try:
        doc = json.loads(raw or "{}")
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or len(doc) > 64:
        BAD_ENTRIES.reject("broker", "bad_counts")
        return {}
    out = {str(k)[:64]: parse_int(v) for k, v in doc.items()}
    if None in out.values():
        BAD_ENTRIES.reject("broker", "bad_counts")
    return {k: v for k, v in out.items() if v is not None}


def parse_version(p: int, raw: Any) -> int | None:
    """Fragment p's recorded version (None: none recorded, or not a version: counted)."""
    if raw is None:
        return None
    v = parse_int(raw)
    if v is None:
        BAD_ENTRIES.reject("fragment", "bad_version", fragment=p, version=raw)
    return v


def parse_learner_entry(learner_id: str, h: Mapping[str, str]) -> dict[str, str]:
    """A learner's hash with the fields a learner would not write dropped (counted): numbers that
    are not finite, negative or absurd, text over TEXT_MAX_CHARS. The rest is kept as read."""
    out: dict[str, str] = {}
    for key, value in h.items():
        if key in LEARNER_INTS and value != "":
            count = parse_int(value)
            if count is None:
                BAD_ENTRIES.reject("learner", "bad_number", learner=learner_id, field=key, value=value)
            else:
                out[key] = str(count)
        elif key in LEARNER_NUMBERS and value != "" and parse_number(value, lo=-MAX_VERSION) is None:
            BAD_ENTRIES.reject("learner", "bad_number", learner=learner_id, field=key, value=value)
        elif len(str(value)) > TEXT_MAX_CHARS and key != "boot_phases":
            BAD_ENTRIES.reject("learner", "text_too_long", learner=learner_id, field=key)
        else:
            out[key] = value
    return out


def parse_epoch(raw: Any) -> int | None:
    """The run's epoch counter (None: absent); a value that is not an int in [0, MAX_VERSION] is
    counted and None."""
    if raw is None:
        return None
    e = parse_int(raw)
    if e is None:
        BAD_ENTRIES.reject("epochs", "implausible", value=raw)
    return e


def shard_count_of(table: Mapping[int, Mapping[str, str]]) -> int:
    """The run's shard count S as the valid entries of ``shard_table`` state it: the count most of
    them give (ties: the smaller; one stray entry cannot outvote the shards); 0 when none."""
    votes: dict[int, int] = {}
    for h in table.values():
        votes[int(h["shards"])] = votes.get(int(h["shards"]), 0) + 1
    return min(votes, key=lambda s: (-votes[s], s)) if votes else 0


def parse_merge_event(e: Mapping[str, str]) -> dict[str, Any] | None:
    """A ``merge`` event of the stream as a shard writes it (t: a time, fragment: an index,
    contributors: a JSON list of ids), with those three as Python values; None and counted when
    it is not one (any member can append to the stream)."""
    t = parse_number(e.get("t"))
    p = parse_int(e.get("fragment"), hi=MAX_SHARDS * 1024)
    try:
        contributors = json.loads(e.get("contributors", "[]"))
    except ValueError:
        contributors = None
    if t is None or p is None or not isinstance(contributors, list) or len(contributors) > 100_000:
        BAD_ENTRIES.reject("events", "bad_merge")
        return None
    return {**e, "t": t, "fragment": p, "contributors": [str(c)[:TEXT_MAX_CHARS] for c in contributors]}
