"""`ddloco status`: live view of a run, read from Redis."""
from __future__ import annotations

import json
import sys
import time

import redis

from common import control
from common.config import Endpoints
from common.keys import Keys


def collect_status(r: redis.Redis, keys: Keys) -> dict:
    cfg = control.fetch_run_config(r, keys)
    live = control.live_learners(r, keys)
    learners = control.all_learners(r, keys)
    now = time.time()
    members = {}
    for lid, h in sorted(learners.items()):
        last = float(h.get("last_merged_at") or 0)
        members[lid] = {
            "live": lid in live, "status": h.get("status", "?") if lid in live else ("left" if h.get("status") == "left" else "gone"),
            "steps": int(float(h.get("steps", 0))), "tokens": int(float(h.get("tokens", 0))),
            "step_ema_s": float(h.get("step_ema_s", 0)), "loss_ema": float(h.get("loss_ema", 0)),
            "merged_contributions": int(h.get("merged_contributions", 0)),
            "last_contribution_age_s": round(now - last, 2) if last else None,
        }
    pipe = r.pipeline(transaction=False)
    for p in range(cfg.algo.fragments):
        pipe.hgetall(keys.fragment(p))
    frags = {p: {"version": int(h.get("version", 0)), "shard": int(h.get("shard", -1)),
                 "round": int(h.get("round", -1)), "contributors": h.get("contributors", "")}
             for p, h in enumerate(pipe.execute())}
    shards = {k: {"status": h.get("status"), "merges": int(h.get("merges", 0)), "dropped": int(h.get("dropped", 0)),
                  "rpc": h.get("rpc")} for k, h in control.shard_table(r, keys).items()}
    return {"run_id": keys.run_id, "config_digest": cfg.digest(), "live_learners": len(live),
            "learners": members, "fragments": frags, "shards": shards}


def run_status(endpoints: Endpoints, *, as_json: bool) -> int:
    r = control.connect(endpoints.redis_url)
    keys = Keys(endpoints.run_id)
    try:
        st = collect_status(r, keys)
    except redis.RedisError as e:
        print(f"ddloco status: Redis at {control.redact(endpoints.redis_url)} failed: {e}", file=sys.stderr)
        return 1
    except control.RunConfigMissing as e:
        print(f"ddloco status: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    print(f"run {st['run_id']} (config {st['config_digest']}): {st['live_learners']} live learner(s)")
    print(f"{'learner':<20} {'status':<9} {'steps':>7} {'tokens':>10} {'step_s':>7} {'loss':>6} {'merged':>7} {'last':>7}")
    for lid, m in st["learners"].items():
        last = "-" if m["last_contribution_age_s"] is None else f"{m['last_contribution_age_s']:.0f}s"
        print(f"{lid:<20} {m['status']:<9} {m['steps']:>7} {m['tokens']:>10} {m['step_ema_s']:>7.3f} "
              f"{m['loss_ema']:>6.3f} {m['merged_contributions']:>7} {last:>7}")
    print("fragments (p:version): " + " ".join(f"{p}:{f['version']}" for p, f in st["fragments"].items()))
    for k, s in st["shards"].items():
        print(f"shard {k}: {s['status']} merges={s['merges']} dropped={s['dropped']} rpc={s['rpc']}")
    return 0
