"""`ddloco fuzz`: seeded random and wire-aware mutated frames thrown at a running cluster.

    ddloco fuzz --config runs/<run>/config.toml --count 1000000 --seconds 600 --report DIR

Targets (found through Redis): the broker's publisher side, every shard's fragment RPC and every
learner's peer endpoint. Inputs are real messages of the run (answers, copies, broadcasts,
requests, peer state requests, built with the run's fragment sizes) mutated the way a broken or
hostile peer would (bytes flipped, frames cut, added, dropped or swapped, header fields given
huge, negative, non-finite or wrongly typed values, checksums fixed up after a mutation so the
payload decoders are reached), plus purely random frames, plus fresh connections with unlisted
keys or no CURVE at all. With keys the fuzzer is a listed learner (``fuzzer``: a compromised
member, the strongest position short of a stolen shard key); its key is added to the allow list.

Every 2 s it samples the cluster's processes (from Redis, and the broker by its port): a process
gone is a crash, a live process whose heartbeat stopped is a hang, resident memory is compared
with the start (growth), and training must go on (merges and learner steps keep rising).
Writes DIR/fuzz.json; exit code 0 only with no crash, no hang and training going on.

``--insider``: instead, a compromised learner's attacks, one after another (``--attack``; see
``ddloco/insider.py``), each judged; DIR/insider.json, exit code 0 only if every one was defended.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import zmq

from common import control
from common import exits
from common.config import Endpoints
from common.keys import Keys
from ddloco.cluster_watch import ClusterWatch, FuzzReport, Sample, _take  # noqa: F401 (their old home)
from ddloco.fuzz_frames import mutate, random_frames, templates


class _Targets:
    """The fuzzer's sockets: one PUB at the broker, a DEALER per shard and per learner peer endpoint
    (found through Redis, refreshed every 2 s), and fresh one-off connections."""

    def __init__(self, endpoints: Endpoints, r: Any, keys: Keys, sec: Any) -> None:
        self.endpoints, self.r, self.keys, self.sec = endpoints, r, keys, sec
        self.ctx = zmq.Context()
        self.pub = self.sock(zmq.PUB, endpoints.broker_pub, "broker")
        self.dealers: dict[str, zmq.Socket] = {}

    def sock(self, kind: int, endpoint: str, server: str | None, mode: str = "listed") -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10_000)
        if self.sec is not None and mode != "plain":
            if mode == "listed":
                self.sec.client(s, server)
            else:                                   # a key nobody listed
                s.curve_serverkey = self.sec.allow.public(server)
                s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        s.connect(endpoint)
        return s

    def refresh(self) -> None:
        _, eps = control.shard_endpoints(self.r, self.keys)
        for k, ep in eps.items():
            name = f"shard{k}"
            if name not in self.dealers:
                self.dealers[name] = self.sock(zmq.DEALER, ep, name)
        for lid, h in control.live_learners(self.r, self.keys).items():
            if h.get("peer") and lid not in self.dealers and lid != "fuzzer":
                self.dealers[lid] = self.sock(zmq.DEALER, h["peer"], lid)

    def drain(self) -> None:
        for d in list(self.dealers.values()):    # replies (GET answers, "busy") are read and dropped
            while d.poll(0):
                d.recv_multipart()


def _throw(rng: random.Random, by_target: dict[str, list[list[bytes]]], targets: _Targets,
           rep: FuzzReport) -> bool:
    """One input, counted in ``rep``; True for a fresh connection (an unlisted key or no CURVE)."""
    roll = rng.random()
    if roll < 0.0005:                        # a fresh connection: unlisted key or no CURVE
        mode = rng.choice(["unlisted", "plain"])
        s = targets.sock(zmq.PUB, targets.endpoints.broker_pub, "broker", mode)
        try:
            s.send_multipart(rng.choice(by_target["broker"]), zmq.NOBLOCK)
        except zmq.Again:
            pass
        s.close(linger=0)
        rep.handshakes_tried += 1
        rep.inputs["handshake"] += 1
        return True
    if roll < 0.6:
        target, s = "broker", targets.pub
    else:
        names = list(targets.dealers)
        if not names:
            target, s = "broker", targets.pub
        else:
            name = rng.choice(names)
            target, s = ("shard" if name.startswith("shard") else "peer"), targets.dealers[name]
    if rng.random() < 0.1:
        frames, bucket = random_frames(rng), "random"
        if target == "broker" and rng.random() < 0.5:   # a routable topic, random rest
            frames[0] = rng.choice(by_target["broker"])[0]
    else:
        frames, bucket = mutate(rng.choice(by_target[target]), rng), target
    if not frames or (target == "broker" and len(frames) < 1):
        frames = [b""]
    try:
        s.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        rep.dropped_at_send += 1
    rep.inputs[bucket] += 1
    return False


def _storm(rng: random.Random, by_target: dict[str, list[list[bytes]]], targets: _Targets, rep: FuzzReport,
           watch: ClusterWatch, *, count: int, seconds: float, t0: float, say: Callable[[str], None]) -> None:
    """``count`` inputs or ``seconds``, whichever ends first; the cluster sampled every 2 s."""
    n = 0
    last_sample = t0
    while n < count and time.monotonic() - t0 < seconds:
        n += 1
        if _throw(rng, by_target, targets, rep):
            continue
        if n % 256 == 0:
            targets.drain()
        now = time.monotonic()
        if now - last_sample >= 2.0:
            last_sample = now
            _take(watch.sample(), rep)
            say(f"[{now - t0:6.1f}s] {n:,} inputs | merges {rep.merges[1]:,} | steps {rep.learner_steps[1]:,}"
                    f" | crashes {len(rep.crashes)} | hangs {len(rep.hangs)}")
            targets.refresh()


def _after_storm(watch: ClusterWatch, rep: FuzzReport, r: Any, keys: Keys, t0: float) -> None:
    """Does training go on (merges and steps still rising, within 6 s)? And what was refused."""
    end = time.monotonic() + 6.0
    s0 = s1 = watch.sample()
    _take(s0, rep)
    while time.monotonic() < end:
        time.sleep(0.5)
        s1 = watch.sample()
        _take(s1, rep)
        if s1.merges > s0.merges and s1.steps > s0.steps:
            break
    rep.training_went_on = rep.merges[1] > rep.merges[0] and rep.learner_steps[1] > rep.learner_steps[0] \
        and s1.merges > s0.merges
    rep.seconds = round(time.monotonic() - t0, 2)
    from common.entries import parse_broker_entry
    broker = parse_broker_entry(r.hgetall(keys.broker))   # any member can write it: parsed, never trusted
    rep.broker = {"refused": broker["broker_refused"], "auth_failures": broker["auth_failures_by_reason"]}
    for k, sh in control.shard_table(r, keys).items():
        for key, v in sh.items():
            if key.startswith("rejected_") or key in ("malformed", "wrong_run", "dropped"):
                rep.shards_refused[key] = rep.shards_refused.get(key, 0) + int(float(v))


def run_fuzz(endpoints: Endpoints, *, count: int, seconds: float, seed: int = 0, say: Callable[[str], None] = print,
             watch: ClusterWatch | None = None, numels: Sequence[int] | None = None) -> FuzzReport:
    """Throw ``count`` inputs (or for ``seconds``, whichever ends first) at the run's endpoints."""
    from common.security import Security, create_keys
    rng = random.Random(seed)
    r = control.connect(endpoints.redis_url)
    keys = Keys(endpoints.run_id)
    if numels is None:
        from common.fragments import model_plan
        from common.task import bind_task, build_model
        task, run = bind_task(control.fetch_run_config(r, keys, redis_url=endpoints.redis_url), shared=True)
        numels = [f.numel for f in model_plan(build_model(task, run.task.seed), task.embedding_names,
                                             run.algo.fragments)]
    sec = None
    if endpoints.keys_dir:
        create_keys(endpoints.keys_dir, learners=["fuzzer"], broker=False, monitors=())
        sec = Security(endpoints.keys_dir, "fuzzer")
    watch = watch or ClusterWatch(r, keys, endpoints.broker_pub)
    rep = FuzzReport(seed=seed, inputs={"broker": 0, "shard": 0, "peer": 0, "random": 0, "handshake": 0})
    tmpl = templates(endpoints.run_id, "fuzzer", numels, rng)
    by_target = {t: [f for tt, f in tmpl if tt == t] for t in ("broker", "shard", "peer")}
    targets = _Targets(endpoints, r, keys, sec)
    targets.refresh()
    first = watch.sample()
    rep.rss_kb_start = dict(first.rss_kb)
    rep.rss_kb_max = dict(first.rss_kb)
    rep.merges = (first.merges, first.merges)
    rep.learner_steps = (first.steps, first.steps)
    t0 = time.monotonic()
    say(f"fuzz       seed {seed}: up to {count:,} inputs for up to {seconds:g}s at the broker, "
        f"{sum(1 for d in targets.dealers if d.startswith('shard'))} shard(s), "
        f"{sum(1 for d in targets.dealers if not d.startswith('shard'))} learner peer endpoint(s); CURVE "
        + ("on (as listed learner 'fuzzer')" if sec else "off"))
    try:
        _storm(rng, by_target, targets, rep, watch, count=count, seconds=seconds, t0=t0, say=say)
        _after_storm(watch, rep, r, keys, t0)
    finally:
        targets.ctx.destroy(linger=0)
    return rep


def main(argv: Sequence[str]) -> int:
    from ddloco.flags import add_common as _add_common, resolve as _resolve
    ap = argparse.ArgumentParser(prog="ddloco fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(ap)
    ap.add_argument("--count", type=int, default=100_000, help="inputs to send (default 100,000)")
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long (default 300; with "
                    "--insider: each attack's length, default 20)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    ap.add_argument("--report", metavar="DIR", help="write DIR/fuzz.json (with --insider DIR/insider.json)")
    _add_insider(ap)
    args = ap.parse_args(list(argv))
    cfg = _resolve(args)
    if args.insider:
        return _main_insider(args, cfg)
    args.seconds = 300.0 if args.seconds is None else args.seconds
    import redis
    try:
        rep = run_fuzz(cfg.endpoints, count=args.count, seconds=args.seconds, seed=args.seed)
    except redis.RedisError as e:
        print(f"ddloco fuzz: Redis at {control.redact(cfg.endpoints.redis_url)}: {e}", file=sys.stderr)
        return exits.FAILURE
    except control.RunConfigMissing as e:   # a run id that is not in this Redis: the user's input
        print(f"ddloco fuzz: {e}", file=sys.stderr)
        return exits.USAGE
    d = rep.to_dict()
    if args.report:
        os.makedirs(args.report, exist_ok=True)
        Path(args.report, "fuzz.json").write_text(json.dumps(d, indent=2, default=str))
    growth = d["memory_growth_kb"]
    print(f"done       {rep.total:,} inputs in {rep.seconds:g}s ({ {k: v for k, v in rep.inputs.items() if v} }); "
          f"crashes {rep.crashes or 0}, hangs {rep.hangs or 0}; memory growth "
          + ", ".join(f"{k} {v / 1024:+.1f} MiB" for k, v in sorted(growth.items()))
          + f"; merges {rep.merges[0]:,} -> {rep.merges[1]:,}, learner steps {rep.learner_steps[0]:,} -> "
          f"{rep.learner_steps[1]:,}: training went on: {rep.training_went_on}")
    print(f"refused    broker {rep.broker}; shards {rep.shards_refused}")
    return exits.OK if rep.ok else exits.FAILURE


def _add_insider(ap: argparse.ArgumentParser) -> None:
    from ddloco.insider import GROUPS, ORDER
    g = ap.add_argument_group("insider: a compromised learner's attacks (ddloco/insider.py; its key is the "
                              "listed learner 'fuzzer', its Redis URL a learner's: env DDLOCO_REDIS_URL)")
    g.add_argument("--insider", action="store_true", help="run the attacks of --attack instead of mutated frames")
    g.add_argument("--attack", default="all", metavar="NAME[,NAME...]",
                   help=f"attacks or groups ({', '.join(GROUPS)}): {', '.join(ORDER)} (default all)")
    g.add_argument("--settle-seconds", type=float, default=5.0,
                   help="the cluster watched this long after each attack, the attacker gone (default 5)")
    g.add_argument("--observer-redis-url", default=os.environ.get("DDLOCO_OBSERVER_REDIS_URL", ""),
                   help="the Redis URL the cluster's figures are read with (env DDLOCO_OBSERVER_REDIS_URL; "
                        "default: the attacker's own)")
    g.add_argument("--flood-rate", type=int, default=20_000, help="flood: answers per second (default 20,000)")
    g.add_argument("--bigframe-mib", type=int, default=512, help="bigframe: frame size in MiB (default 512)")
    g.add_argument("--subscriptions", type=int, default=100_000, help="subscriptions: how many (default 100,000)")
    g.add_argument("--busy-seconds", type=float, default=3.0, help="eval-busy: the script's length (default 3)")


def _main_insider(args: argparse.Namespace, cfg: Any) -> int:
    import redis

    from ddloco.insider import parse_attacks
    from ddloco.insider_report import insider_from, run_insider
    try:
        attacks = parse_attacks(args.attack)
    except ValueError as e:
        print(f"ddloco fuzz: --attack: {e}", file=sys.stderr)
        return exits.USAGE
    if min(args.flood_rate, args.bigframe_mib, args.subscriptions) < 1 or args.settle_seconds < 0 \
            or args.busy_seconds <= 0 or (args.seconds is not None and args.seconds <= 0):
        print("ddloco fuzz: --seconds, --flood-rate, --bigframe-mib, --subscriptions and --busy-seconds must be "
              "> 0, --settle-seconds >= 0", file=sys.stderr)
        return exits.USAGE
    out = Path(args.report or ".")
    try:
        control.fetch_run_config(control.connect(cfg.endpoints.redis_url), Keys(cfg.endpoints.run_id),
                                 redis_url=cfg.endpoints.redis_url)              # is the run there at all?
        ins, observer = insider_from(cfg.endpoints, cfg.run, observer_url=args.observer_redis_url,
                                     marker_dir=str(out), flood_rate=args.flood_rate, busy_s=args.busy_seconds,
                                     bigframe_mib=args.bigframe_mib, subscriptions=args.subscriptions)
        rep = run_insider(ins, attacks, seconds=20.0 if args.seconds is None else args.seconds,
                          settle_s=args.settle_seconds, observer=observer)
    except redis.RedisError as e:
        print(f"ddloco fuzz: Redis at {control.redact(cfg.endpoints.redis_url)}: {e}", file=sys.stderr)
        return exits.FAILURE
    except control.RunConfigMissing as e:
        print(f"ddloco fuzz: {e}", file=sys.stderr)
        return exits.USAGE
    if args.report:
        out.mkdir(parents=True, exist_ok=True)
        (out / "insider.json").write_text(json.dumps(rep, indent=2, default=str))
    print(f"done       defended: {', '.join(rep['defended']) or 'none'}; NOT defended: "
          f"{', '.join(rep['not_defended']) or 'none'}" + (f"; {out / 'insider.json'}" if args.report else ""))
    return exits.OK if not rep["not_defended"] else exits.FAILURE
