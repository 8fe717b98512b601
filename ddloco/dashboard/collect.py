"""What the dashboard shows, read from the run's Redis: the learners' and shards' hashes, the
fragments, ``up``'s evaluation and the events streams (ALGORITHM §9's goodput from the learners'
own counters). Nothing here runs on a daemon's hot path: one reader polls Redis about once a
second (``RunView.poll``), whatever the number of open pages.

Threads: a ``RunView`` is owned by the dashboard's poller (one thread); pages get the immutable
snapshot dicts it returns.
"""
from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

import redis

from common import control, entries
from common.keys import Keys

MERGES_KEPT = 50           # the merge table's rows
HEAT_KEPT = 20_000         # the fragment heatmap's merges (t, fragment)
HEAT_SPAN_S = 300.0        # what the page's heatmap shows (and so what a snapshot carries)
POINTS_KEPT = 3_600        # loss and throughput points (an hour at one a second)
MARKS_KEPT = 500
MARK_KINDS = ("join", "leave", "refuse", "shard_start", "shard_stop", "recover", "action", "chaos")


def _num(v: Any, default: float = 0.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _list(v: Any) -> list[Any]:
    if isinstance(v, list):
        return v
    try:
        out = json.loads(v) if isinstance(v, str) and v else []
    except ValueError:
        return []
    return out if isinstance(out, list) else []


def merge_row(e: dict[str, Any]) -> dict[str, Any]:
    """A ``merge`` event as the page's merge table shows it (fields a past version lacks are empty)."""
    contributors = [str(c) for c in _list(e.get("contributors"))]
    alignment = e.get("alignment")
    return {"t": _num(e.get("t")), "fragment": int(_num(e.get("fragment"), -1)), "version": int(_num(e.get("version"))),
            "shard": int(_num(e.get("shard"))), "quorum": len(contributors), "contributors": contributors,
            "weights": [_num(w) for w in _list(e.get("weights"))],
            "staleness": [int(_num(s)) for s in _list(e.get("staleness"))],
            "norms": [_num(n) for n in _list(e.get("norms"))], "clipped": [str(c) for c in _list(e.get("clipped"))],
            "grace_waited_s": _num(e.get("grace_waited_s")), "grace_s": _num(e.get("grace_s")),
            "reason": str(e.get("reason", "")), "late": int(_num(e.get("late"))),
            "alignment": None if alignment in (None, "") else _num(alignment)}


class RunView:
    """The run's live picture, one ``poll`` at a time. ``poll`` reads only what changed in the
    streams since the last call (XRANGE from the last id seen) and the small hashes."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self.started = time.time()
        self.config: dict[str, Any] = {}
        self.loss: deque[tuple[float, float, float]] = deque(maxlen=POINTS_KEPT)    # (t, tokens, loss)
        self.rates: deque[tuple[float, float, float]] = deque(maxlen=POINTS_KEPT)   # (t, tokens/s, merges/s)
        self.merges: deque[dict[str, Any]] = deque(maxlen=MERGES_KEPT)
        self.heat: deque[tuple[float, int]] = deque(maxlen=HEAT_KEPT)     # (t, fragment) of each merge
        self.marks: deque[dict[str, Any]] = deque(maxlen=MARKS_KEPT)
        self.lanes: dict[str, list[list[Any]]] = {}    # learner -> [[t_from, t_to, state], ...]
        self._last_ids: dict[str, str] = {}
        self._prev: tuple[float, float, int] | None = None   # (t, tokens, merges) at the last poll
        self._merge_count = 0
        self._bootstraps: dict[str, tuple[str, str]] = {}   # learner -> (incarnation, where its state came from)
        self.error = ""

    def poll(self, now: float | None = None) -> dict[str, Any]:
        """Read Redis once and return the snapshot the page draws (``error`` names a failure)."""
        now = time.time() if now is None else now
        try:
            if not self.config:
                self.config = self._read_config()
            learners = self._read_learners(now)
            self._read_events()
            shards = {str(k): {"status": h.get("status", "?"), "merges": int(_num(h.get("merges"))),
                               "dropped": int(_num(h.get("dropped"))), "checkpoints": int(_num(h.get("checkpoints")))}
                      for k, h in control.shard_table(self.r, self.keys).items()}
            ev = entries.parse_eval_entry(self.r.hgetall(self.keys.eval))
            fragments = self._read_fragments()
            self.error = ""
        except (redis.RedisError, OSError) as e:
            self.error = f"Redis: {e}"
            return {"run_id": self.keys.run_id, "t": now, "error": self.error}
        if ev is not None and (not self.loss or self.loss[-1][0] != ev["at"]):
            self.loss.append((ev["at"], ev["tokens"], ev["loss"]))
        overview = self._overview(now, learners, ev)
        return {"run_id": self.keys.run_id, "t": now, "error": "", "config": self.config, "overview": overview,
                "learners": learners, "shards": shards, "fragments": fragments,
                "loss": list(self.loss), "rates": list(self.rates)[-600:], "merges": list(self.merges), "heat": [h for h in self.heat if h[0] >= now - HEAT_SPAN_S], "merges_seen": self._merge_count,
                "marks": list(self.marks), "lanes": self.lanes}

    def _read_config(self) -> dict[str, Any]:
        cfg = control.fetch_run_config(self.r, self.keys)
        algo = {k: v for k, v in vars(cfg.algo).items() if isinstance(v, (bool, int, float, str))}
        return {**algo, "digest": cfg.digest()}

    def _read_learners(self, now: float) -> dict[str, dict[str, Any]]:
        live = control.live_learners(self.r, self.keys)
        out = {}
        for lid, h in sorted(control.all_learners(self.r, self.keys).items()):
            status = h.get("status", "?") if lid in live else ("left" if h.get("status") == "left" else "gone")
            last = _num(h.get("last_merged_at"))
            out[lid] = {"status": status, "live": lid in live, "incarnation": h.get("incarnation", ""),
                        "steps": int(_num(h.get("steps"))), "tokens": int(_num(h.get("tokens"))),
                        "step_s": _num(h.get("step_ema_s")), "loss": _num(h.get("loss_ema")),
                        "answers": int(_num(h.get("answers"))), "merged": int(_num(h.get("merged_contributions"))),
                        "applied": int(_num(h.get("merges_applied"))), "bytes_up": int(_num(h.get("bytes_up"))),
                        "bytes_down": int(_num(h.get("bytes_down"))),
                        "train_s": _num(h.get("train_s")), "started_at": _num(h.get("started_at")),
                        "updated_at": _num(h.get("updated_at")),
                        "last_contribution_age_s": round(now - last, 1) if last else None}
            self._lane(lid, status, now)
            self._bootstrap_mark(lid, h.get("incarnation", ""), h.get("bootstrap", ""), now)
        return out

    def _bootstrap_mark(self, lid: str, incarnation: str, source: str, now: float) -> None:
        """A life's state source (``peer <id>`` or ``shards``), marked once per incarnation."""
        if source and self._bootstraps.get(lid) != (incarnation, source):
            self._bootstraps[lid] = (incarnation, source)
            self.marks.append({"t": now, "kind": "bootstrap", "learner": lid, "shard": "", "text": source})

    def _lane(self, lid: str, status: str, now: float) -> None:
        """Extend the learner's timeline lane with its state now (a new segment when it changed)."""
        state = {"training": "training", "blocked": "blocked", "joining": "booting", "booting": "booting",
                 "bootstrapping": "booting"}.get(status, "gone" if status in ("gone", "left", "stopped") else status)
        lane = self.lanes.setdefault(lid, [])
        if lane and lane[-1][2] == state:
            lane[-1][1] = now
        else:
            if lane:
                lane[-1][1] = now
            lane.append([now, now, state])
            del lane[:-200]

    def _read_events(self) -> None:
        streams = {"": self.keys.events, **control.learner_event_streams(self.r, self.keys)}
        for lid, key in streams.items():
            start = self._last_ids.get(key)
            rows = self.r.xrange(key, min=f"({start}" if start else "-", count=2000)
            for entry_id, e in rows:
                self._event(e if not lid else {**e, "learner": lid})
            if rows:
                self._last_ids[key] = rows[-1][0]

    def _event(self, e: dict[str, Any]) -> None:
        kind = e.get("kind", "")
        if kind == "merge":
            row = merge_row(e)
            self.merges.append(row)
            self.heat.append((round(row["t"], 2), row["fragment"]))
            self._merge_count += 1
        elif kind in MARK_KINDS:
            text = f"{e.get('action')}: {e.get('reason', '')}" if kind in ("action", "chaos") else e.get("reason", "")
            if kind == "leave" and e.get("learner"):   # a life ended (however fast the next one joined)
                t = _num(e.get("t"))
                self.lanes.setdefault(e["learner"], []).append([t, t, "gone"])
            self.marks.append({"t": _num(e.get("t")), "kind": kind, "learner": e.get("learner", "") or e.get("target", ""),
                               "shard": e.get("shard", ""), "text": text})

    def _read_fragments(self) -> dict[str, dict[str, Any]]:
        n = int(self.config.get("fragments") or 0)
        pipe = self.r.pipeline(transaction=False)
        for p in range(n):
            pipe.hgetall(self.keys.fragment(p))
        return {str(p): {"version": int(_num(h.get("version"))), "shard": h.get("shard", ""),
                         "merged_at": _num(h.get("merged_at")), "problem": h.get("problem", "")}
                for p, h in enumerate(pipe.execute() if n else [])}

    def _overview(self, now: float, learners: dict[str, dict[str, Any]], ev: dict[str, float] | None) -> dict[str, Any]:
        tokens = float(sum(v["tokens"] for v in learners.values()))
        if self._prev is not None and now > self._prev[0]:
            dt = now - self._prev[0]
            self.rates.append((now, max(0.0, tokens - self._prev[1]) / dt, (self._merge_count - self._prev[2]) / dt))
        self._prev = (now, tokens, self._merge_count)
        recent = [r for r in self.rates if r[0] >= now - 30]
        live = [v for v in learners.values() if v["live"] and v["started_at"] > 0]
        provisioned = sum(max(0.0, v["updated_at"] - v["started_at"]) for v in live)
        up_b, down_b = sum(v["bytes_up"] for v in learners.values()), sum(v["bytes_down"] for v in learners.values())
        return {"eval_loss": ev["loss"] if ev else None, "initial_loss": ev["initial_loss"] if ev else None,
                "eval_tokens": int(ev["tokens"]) if ev else None, "tokens": int(tokens),
                "tokens_per_s": sum(r[1] for r in recent) / len(recent) if recent else 0.0,
                "merges_per_s": sum(r[2] for r in recent) / len(recent) if recent else 0.0,
                "goodput": sum(v["train_s"] for v in live) / provisioned if provisioned > 0 else None,
                "live_learners": sum(1 for v in learners.values() if v["live"]),
                "bytes_up_per_token": up_b / tokens if tokens else None,
                "bytes_down_per_token": down_b / tokens if tokens else None,
                "watching_s": round(now - self.started, 1)}
