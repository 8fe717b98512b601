"""The insider attacks (``ddloco.insider``) run one after another against a live run, each judged.

Per attack: a window of ``seconds`` under attack, then ``settle_s`` after it (the attacker gone):
the cluster's figures in both (merges and their rate, learner steps, eval loss, crashes, hangs,
resident memory growth), the merges the attacker's answers took part in and their weight, the
shared Redis state after the settle window and what in it is not sane, and ``defended``: whether
the outcome is the one issue 26's fixes aim for (``verdict``, a pure function of the entry).
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable, Sequence

import redis

from common import control
from common.keys import Keys
from ddloco import insider as atk
from ddloco import insider_redis as rw
from ddloco.report import broker_counters

MERGE_RATE_KEPT = 0.5      # under a flood, merges go on at least at this share of the rate before
EVAL_WORSE_BOUND = 1.10    # the eval loss after a model attack at most this x the one before
FAIR_WEIGHT = 0.5          # no attacker answer above half of a round's weight
FLOOD_PASSED = 0.1         # at most this share of a flood reaches the shards (a per-member rate limit)
SLOW_PEER_STATES = 2       # states a learner serves to a peer that never reads


ATTACKS: dict[str, Callable[[atk.Insider, float], dict[str, Any]]] = {
    "spec": rw.attack_spec, "signflip": atk.attack_signflip, "signflip-adaptive": atk.attack_signflip_adaptive,
    "freerider": atk.attack_freerider, "flood": atk.attack_flood, "tokens": rw.attack_tokens, "ghosts": rw.attack_ghosts,
    "eval-busy": rw.attack_eval_busy, "epochs": rw.attack_epochs, "fake-shard": rw.attack_fake_shard,
    "shards-x": rw.attack_shards_x, "lease": rw.attack_lease, "scan": rw.attack_scan,
    "subscriptions": atk.attack_subscriptions, "bigframe": atk.attack_bigframe, "slowpeer": atk.attack_slowpeer,
}
"""Every attack by name (``ddloco.insider.ORDER``)."""


def redis_state(r: Any, keys: Keys) -> dict[str, Any]:
    """The run's shared state as it stands (read with ``r``; a read Redis refuses is noted)."""
    try:
        shards = sorted(r.smembers(keys.shards))
        leases = {}
        for s in shards:
            if s.isdigit():
                lk = keys.shard_lease(int(s))
                leases[s] = {"holder": r.get(lk), "ttl_ms": r.pttl(lk)}
        members = sorted(r.smembers(keys.learners))
        return {"tokens": int(float(r.get(keys.tokens) or 0)),
                "token_shares_sum": sum(int(float(v)) for v in r.hvals(keys.token_shares)),
                "members": members,
                "immortal_members": [m for m in members if r.pttl(keys.heartbeat(m)) == -1],
                "shards": shards, "shards_configured": int(r.hget(keys.config, "shards") or 0),
                "leases": leases, "epochs": int(r.get(keys.epochs) or 0)}
    except (redis.RedisError, ValueError) as e:
        return {"unreadable": f"{type(e).__name__}: {e}"}


def state_problems(st: dict[str, Any]) -> dict[str, str]:
    """What in ``redis_state`` no honest member would have left, by the attack that leaves it
    (empty: sane)."""
    if "unreadable" in st:
        return {"state": f"unreadable: {st['unreadable']}"}
    out = {}
    if st["tokens"] > 1.01 * st["token_shares_sum"] + 10_000:
        out["tokens"] = f"token count {st['tokens']:,} above the sum of the learners' shares {st['token_shares_sum']:,}"
    if st["immortal_members"]:
        out["ghosts"] = f"{len(st['immortal_members'])} member(s) whose heartbeat never expires"
    if "x" in st["shards"] or any(not s.isdigit() for s in st["shards"]):
        out["shards-x"] = f"shard set holds {[s for s in st['shards'] if not s.isdigit()]}"
    fake = [s for s in st["shards"] if s.isdigit() and int(s) >= max(st["shards_configured"], 1)]
    if fake:
        out["fake-shard"] = f"shard set holds {fake} (the run has {st['shards_configured']} shards)"
    for s, lease in st["leases"].items():
        if lease["holder"] is not None and (lease["ttl_ms"] < 0 or lease["holder"].count(":") != 2):
            out["lease"] = f"lease of shard {s} held by {lease['holder']!r} with ttl {lease['ttl_ms']} ms"
    if st["epochs"] >= 2**62:
        out["epochs"] = f"epochs at {st['epochs']}"
    return out


def attacker_merges(r: Any, keys: Keys, since: float, until: float) -> dict[str, Any]:
    """Merges between ``since`` and ``until`` (wall time) and the attacker's weight in them."""
    try:
        events = r.xrange(keys.events, min=f"{int(since * 1000)}-0", max=f"{int(until * 1000)}-0")
    except redis.RedisError:
        return {}
    merges = [e for _, e in events if e.get("kind") == "merge"]
    weights = []
    for e in merges:
        who, w = json.loads(e.get("contributors") or "[]"), json.loads(e.get("weights") or "[]")
        if atk.SENDER in who and len(w) == len(who):
            total = sum(w) or 1.0
            weights.append(w[who.index(atk.SENDER)] / total)
    return {"merges": len(merges), "merges_with_attacker": len(weights),
            "attacker_weight_mean": round(sum(weights) / len(weights), 4) if weights else 0.0,
            "attacker_weight_max": round(max(weights), 4) if weights else 0.0}


def verdict(name: str, e: dict[str, Any]) -> list[str]:
    """Why the outcome of attack ``name`` is not the defended one (empty: defended)."""
    c, a, why = e["cluster"], e["attacker"], []
    if c["crashes"]:
        why.append(f"processes gone: {c['crashes']}")
    if not c["training_went_on"]:
        why.append("merges or learner steps stopped after the attack")
    if name in ("signflip", "signflip-adaptive", "freerider"):
        if e["merges"].get("attacker_weight_max", 0) > FAIR_WEIGHT + 1e-6:
            why.append(f"an attacker answer took {e['merges']['attacker_weight_max']:.0%} of a round's weight")
        before, after = c["eval_loss"][0], c.get("eval_loss_worst_during") or c["eval_loss"][1]
        if after is not None and not math.isfinite(after):
            why.append(f"eval loss {after}")
        elif before and after and after > EVAL_WORSE_BOUND * before:
            why.append(f"eval loss {before:.4g} -> {after:.4g}")
    if name == "flood":
        if c["merge_rate_during"] < MERGE_RATE_KEPT * c["merge_rate_before"]:
            why.append(f"merges/s {c['merge_rate_before']:.2f} -> {c['merge_rate_during']:.2f} under the flood")
        if a.get("shards_received", 0) > FLOOD_PASSED * a.get("answers_sent", 0):
            why.append(f"the shards took in {a['shards_received']:,} of the flood's {a['answers_sent']:,} answers")
    if name in atk.MEMORY:
        worst, bound = max(c["rss_growth_mib"].items(), key=lambda kv: kv[1], default=("", 0.0)), \
            atk.GROWTH_BOUND_MIB[name]
        if worst[1] > bound:
            why.append(f"{worst[0]} grew {worst[1]:.0f} MiB (bound {bound:.0f})")
    if name == "slowpeer":
        many = {lid: n for lid, n in a.get("states_served", {}).items() if n > SLOW_PEER_STATES}
        if many:
            why.append(f"states served to a peer that never reads: {many}")
    if name in atk.REDIS and (a.get("allowed") or a.get("scan_allowed")):
        if name == "eval-busy" and a.get("other_client_waited_s", 0) >= 1.0:
            why.append(f"Redis froze {a['other_client_waited_s']:.1f} s")
        elif name == "scan":
            why.append(f"SCAN allowed ({a['foreign_keys']} keys of other runs listed)")
        if name in e["problems_after"] or "state" in e["problems_after"]:
            why.append(f"after the attack: {e['problems_after'].get(name) or e['problems_after']['state']}")
    if name == "spec" and a.get("marker_appeared"):
        why.append("the stored task spec ran a shell command")
    return why


def _window(ins: atk.Insider, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ins.tick()
        threading.Event().wait(0.2)


def run_one(ins: atk.Insider, name: str, seconds: float, settle_s: float, observer: Any,
            before: tuple[float, int], attack: Callable[[atk.Insider, float], dict[str, Any]] | None = None
            ) -> tuple[dict[str, Any], tuple[float, int]]:
    """One attack and its settle window; ``before`` = (monotonic time, merges) at the start of the
    window before it (its merge rate is the baseline). Returns the entry and the settle window's
    (time, merges) for the next attack's baseline."""
    from ddloco.cluster_watch import FuzzReport
    ins.acc = acc = FuzzReport(seed=0)
    ins.watch.known = {}                         # this attack's processes: a restarted one is not gone again
    first = atk.sample(ins)
    acc.rss_kb_start = dict(getattr(first, "rss_kb", {}))
    m0, s0 = acc.merges[1], acc.learner_steps[1]
    acc.merges, acc.learner_steps = (m0, m0), (s0, s0)
    rate_before = (m0 - before[1]) / max(time.monotonic() - before[0], 1e-9)
    eval0, wall0, t0 = atk.eval_loss(observer, ins.keys), time.time(), time.monotonic()
    ins.evals = [eval0] if eval0 is not None else []
    try:
        result = (attack or ATTACKS[name])(ins, seconds)
    except (redis.RedisError, OSError, ValueError) as e:     # the attack itself could not run
        result = {"error": f"{type(e).__name__}: {e}"}
    ins.tick(force=True)
    t1, m1, rss_attack = time.monotonic(), acc.merges[1], dict(acc.rss_kb_max)
    during = ins.evals[1:]
    _window(ins, settle_s)
    ins.tick(force=True)
    state = redis_state(observer, ins.keys)
    entry = {"attack": name, "seconds": round(t1 - t0, 2), "attacker": result,
             "cluster": {"merges": [m0, acc.merges[1]], "merge_rate_before": round(rate_before, 3),
                         "merge_rate_during": round((m1 - m0) / max(t1 - t0, 1e-9), 3),
                         "learner_steps": list(acc.learner_steps),
                         "eval_loss": [eval0, atk.eval_loss(observer, ins.keys)],
                         "eval_loss_worst_during": max(during, key=lambda v: v if math.isfinite(v) else math.inf)
                         if during else None,
                         "crashes": list(acc.crashes), "hangs": list(acc.hangs),
                         "training_went_on": acc.merges[1] > m1 and acc.learner_steps[1] > s0,
                         "rss_growth_mib": {k: round((v - acc.rss_kb_start.get(k, v)) / 1024, 1)
                                            for k, v in rss_attack.items()},
                         "sample_errors": ins.sample_errors,
                         # the broker's refusals so far (its hash, written every second): cumulative
                         "broker_refused": broker_counters(observer, ins.keys)["broker_refused"]},
             "merges": attacker_merges(observer, ins.keys, wall0, time.time()),
             "state_after": state, "problems_after": state_problems(state)}
    entry["why_not_defended"] = verdict(name, entry)
    entry["defended"] = not entry["why_not_defended"]
    return entry, (t1, m1)


def run_insider(ins: atk.Insider, attacks: Sequence[str], *, seconds: float, settle_s: float, observer: Any,
                say: Callable[[str], None] = print,
                custom: dict[str, Callable[[atk.Insider, float], dict[str, Any]]] | None = None,
                baseline_s: float | None = None) -> dict[str, Any]:
    """Every attack of ``attacks`` in turn (``custom``: another function for a name, e.g. the spec
    attack with a victim to start), after ``baseline_s`` (default ``settle_s``) of watching the
    merge rate the first one is compared with; the report ``ddloco fuzz --insider`` writes."""
    from ddloco.cluster_watch import FuzzReport
    ins.acc = FuzzReport(seed=0)
    start = atk.sample(ins)
    before = (time.monotonic(), getattr(start, "merges", 0))
    _window(ins, settle_s if baseline_s is None else baseline_s)   # the first attack's baseline merge rate
    entries = []
    for name in attacks:
        say(f"insider    {name}: {seconds:g}s, then {settle_s:g}s without the attacker")
        entry, before = run_one(ins, name, seconds, settle_s, observer, before, (custom or {}).get(name))
        entries.append(entry)
        say(f"insider    {name}: " + ("defended" if entry["defended"] else "NOT defended: "
                                      + "; ".join(entry["why_not_defended"])))
    return {"run_id": ins.endpoints.run_id, "attacks": entries,
            "defended": [e["attack"] for e in entries if e["defended"]],
            "not_defended": [e["attack"] for e in entries if not e["defended"]]}


def insider_from(endpoints: Any, run: Any, *, observer_url: str = "", marker_dir: str = ".",
                 numels: Sequence[int] | None = None, tokens_per_step: float | None = None,
                 watch: Any = None, **limits: Any) -> tuple[atk.Insider, Any]:
    """The attacker of ``endpoints`` (a learner's Redis URL, the keys folder) and the observer's
    Redis (``observer_url``, else the learner's own): what ``ddloco fuzz --insider`` builds."""
    from pathlib import Path

    from common.security import Security, create_keys
    from ddloco.cluster_watch import ClusterWatch
    r = control.connect(endpoints.redis_url)
    observer = control.connect(observer_url) if observer_url else r
    keys = Keys(endpoints.run_id)
    if numels is None or tokens_per_step is None:
        numels, tokens_per_step = _task_figures(run)
    sec = None
    if endpoints.keys_dir:
        create_keys(endpoints.keys_dir, learners=[atk.SENDER], broker=False, monitors=())
        sec = Security(endpoints.keys_dir, atk.SENDER)
    ins = atk.Insider(endpoints=endpoints, r=r, keys=keys, run=run, numels=list(numels),
                      tokens_per_step=float(tokens_per_step), sec=sec, marker_dir=Path(marker_dir),
                      watch=watch or ClusterWatch(observer, keys, endpoints.broker_pub), **limits)
    return ins, observer


def _task_figures(run: Any) -> tuple[list[int], float]:
    """The fragments' sizes and the shards' tokens-per-step bound, from the attacker's own copy of
    the task (its config file's, never the spec stored in Redis)."""
    from common.fragments import model_plan
    from common.task import bind_task, build_model, count_tokens
    task, run = bind_task(run)
    numels = [f.numel for f in model_plan(build_model(task, run.task.seed), task.embedding_names,
                                         run.algo.fragments)]
    batch = next(iter(task.batches(0, run.task.seed, 0)))
    return numels, 2.0 * count_tokens(task, batch) * run.algo.inner_grad_accum
