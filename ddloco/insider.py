"""`ddloco fuzz --insider`: a compromised learner's attacks on a live run, one function each.

    DDLOCO_REDIS_URL=<a learner's URL> ddloco fuzz --insider --config runs/<run>/config.toml \\
        --keys runs/<run>/keys --attack signflip,freerider --seconds 30 --report DIR

The attacker holds exactly what a learner host holds: a listed learner key pair (``fuzzer``, added
to the allow list like ``ddloco fuzz`` does) and a learner's Redis URL. Every attack is a real
client speaking the real wire protocol (``common.wire``) or real Redis commands:

- ``spec``: rewrites the run's task spec in Redis to ``subprocess:getoutput`` with a shell command
  that creates a marker file; the attacker wins when the marker appears (a process that loaded
  the spec ran it). The original config is written back after the window.
- ``signflip``: answers every open round right after it opens, with the largest step and token
  claims the bounds allow and delta = -8 x the last global update of the fragment (an honest
  delta's estimate, from the broadcasts it subscribes to like a learner).
- ``signflip-adaptive``: the flipped delta scaled to just inside the norm clip (0.9 x 4 x the
  median of the observed update norms), claims 3 % under the bounds.
- ``freerider``: zero deltas, maximum claims, every round.
- ``flood``: ~20,000 well-formed answers a second to the open rounds.
- Redis writes with the learner's credentials: ``tokens`` (the run's token count set high),
  ``ghosts`` (20 members with heartbeats that never expire), ``eval-busy`` (an EVAL busy loop),
  ``epochs`` (2^63 - 1), ``fake-shard`` (a shard entry whose key nobody listed), ``shards-x``
  (``SADD shards x``), ``lease`` (``SET shard:<last>:lease evil`` without a TTL), ``scan`` (other
  runs' keys). Each says whether Redis allowed it; the state a few seconds later says whether
  anything outlived the attacker.
- ``subscriptions`` (100,000 subscriptions), ``bigframe`` (512 MiB frames to the broker and every
  shard's RPC), ``slowpeer`` (asks every learner's peer endpoint for its state in a loop and
  never reads).

The Redis writes and the spec attack live in ``ddloco/insider_redis.py``, the judging in
``ddloco/insider_report.py``. Each attack's entry says what the attacker managed, what the
cluster did (merges, learner steps, eval loss from the run's ``eval`` hash, crashes and hangs,
resident memory growth, sampled like ``ddloco fuzz``) and ``defended`` (the outcome the fixes of
issue 26 aim for).
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import redis
import torch
import zmq

from common import control, wire
from common.config import Endpoints, RunConfig
from common.keys import Keys

SENDER = "fuzzer"
WIRE = ("signflip", "signflip-adaptive", "freerider", "flood")
MEMORY = ("bigframe", "slowpeer", "subscriptions")   # the last one gets the key banned at the broker
REDIS = ("tokens", "ghosts", "eval-busy", "epochs", "fake-shard", "shards-x", "lease", "scan")
ORDER = (*WIRE, *MEMORY, *REDIS, "spec")
"""Every attack, in the order ``all`` runs them (the Redis writes and the spec last: undefended
they may leave the run broken)."""
GROUPS = {"all": ORDER, "wire": WIRE, "memory": MEMORY, "redis": REDIS}
MAX_STEPS_FACTOR = 8          # the shards' default syncer.max_steps_factor
CLIP_FACTOR = 4.0             # the shards' NormClipper.factor
GROWTH_BOUND_MIB = {"subscriptions": 8.0, "bigframe": 64.0, "slowpeer": 64.0}
"""MiB a member's traffic may grow any one process by, per attack (a cap of subscriptions per
subscriber, a maximum message size, replies never queued for a client that does not read)."""
SAMPLE_EVERY_S = 2.0


def parse_attacks(text: str) -> list[str]:
    """``signflip,redis`` -> the attack names, in ``ORDER``; ValueError names an unknown one."""
    out: set[str] = set()
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if name not in GROUPS and name not in ORDER:
            raise ValueError(f"unknown attack {name!r}: one of {', '.join((*GROUPS, *ORDER))}")
        out.update(GROUPS.get(name, (name,)))
    return [n for n in ORDER if n in out]


# ----------------------------------------------------------------------------- the attacker's position
@dataclass
class Insider:
    """What a learner host holds (its key, its Redis URL, the run's config) and the watch of the
    cluster. Owned by the one thread that runs the attacks."""

    endpoints: Endpoints
    r: Any                       # the learner's Redis credentials
    keys: Keys
    run: RunConfig
    numels: list[int]
    tokens_per_step: float
    sec: Any = None              # common.security.Security of the ``fuzzer`` learner, None without CURVE
    watch: Any = None            # ddloco.fuzz.ClusterWatch (observer's Redis)
    acc: Any = None              # ddloco.fuzz.FuzzReport: crashes, hangs, rss, merges, steps
    ctx: zmq.Context = field(default_factory=zmq.Context)
    marker_dir: Path = Path(".")
    busy_s: float = 3.0
    flood_rate: int = 20_000
    subscriptions: int = 100_000
    bigframe_mib: int = 512
    sample_errors: int = 0
    evals: list[float] = field(default_factory=list)
    """The run's eval losses seen at the samples (its ``eval`` hash, written by ``ddloco up``)."""
    _last_sample: float = 0.0
    _last_beat: float = 0.0

    def socket(self, kind: int, endpoint: str, server: str) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        if self.sec is not None:
            self.sec.client(s, server)
        s.connect(endpoint)
        return s

    def tick(self, force: bool = False) -> None:
        """Sample the cluster (every SAMPLE_EVERY_S) and keep the attacker's heartbeat."""
        now = time.monotonic()
        if force or now - self._last_sample >= SAMPLE_EVERY_S:
            self._last_sample = now
            sample(self)

    def beat(self) -> None:
        """A member's heartbeat (no incarnation: no token share, nothing the run's count sums)."""
        now = time.monotonic()
        if now - self._last_beat < 0.5:
            return
        self._last_beat = now
        try:
            pipe = self.r.pipeline(transaction=False)
            control.beat(pipe, self.keys, SENDER, {"status": "training", "step_ema_s": 0.001}, 2.5)
            pipe.execute()
        except redis.RedisError:
            pass


def sample(ins: Insider) -> Any:
    """One sample of the cluster into ``ins.acc``; a sample Redis cannot give (its entries broken)
    is counted, not raised."""
    from ddloco.cluster_watch import _take
    try:
        s = ins.watch.sample()
    except (redis.RedisError, ValueError, KeyError, TypeError) as e:
        ins.sample_errors += 1
        return e
    _take(s, ins.acc)
    loss = eval_loss(ins.watch.r, ins.keys)
    if loss is not None and (not ins.evals or loss != ins.evals[-1]):
        ins.evals.append(loss)
    return s


def eval_loss(r: Any, keys: Keys) -> float | None:
    try:
        v = r.hget(keys.eval, "loss")
        return float(v) if v is not None else None
    except (redis.RedisError, ValueError):
        return None


# ----------------------------------------------------------------------------- a learner's view of the rounds
class Replica:
    """The open rounds and the last global update of every fragment, from the ``open`` and
    ``frag`` broadcasts (socket-free: fed decoded messages)."""

    def __init__(self) -> None:
        self.opens: dict[int, wire.Message] = {}
        self.theta: dict[int, torch.Tensor] = {}
        self.update: dict[int, torch.Tensor] = {}
        self.norms: dict[int, deque] = {}

    def on_message(self, msg: wire.Message) -> None:
        p = msg.fragment
        if msg.kind == wire.OPEN:
            self.opens[p] = msg
        elif msg.kind == wire.FRAG and not msg.is_chunk and msg.numel:
            values = msg.values()
            if msg.base < 0:                    # a full value: the update is the difference
                old = self.theta.get(p)
                self.theta[p] = values
                if old is None or old.numel() != values.numel():
                    return
                values = values - old
            self.update[p] = values
            self.norms.setdefault(p, deque(maxlen=32)).append(float(values.norm()))

    def median_norm(self, p: int) -> float:
        return statistics.median(self.norms[p]) if self.norms.get(p) else 0.0


def signflip_delta(rep: Replica, p: int, numel: int) -> torch.Tensor | None:
    """-8 x the last global update (an honest delta's estimate); None before one is seen."""
    u = rep.update.get(p)
    return None if u is None or u.numel() != numel else -8.0 * u


def adaptive_delta(rep: Replica, p: int, numel: int) -> torch.Tensor | None:
    """The flipped update at 0.9 x the clip bound (CLIP_FACTOR x the median observed norm)."""
    u = rep.update.get(p)
    if u is None or u.numel() != numel or float(u.norm()) == 0.0:
        return None
    return -u / u.norm() * (0.9 * CLIP_FACTOR * rep.median_norm(p))


def zero_delta(rep: Replica, p: int, numel: int) -> torch.Tensor:
    return torch.zeros(numel)


def max_claims(ins: Insider, under: float = 1.0) -> tuple[int, int]:
    """(steps, tokens) at the shards' bounds for an answer on the current version, ``under`` x."""
    steps = max(1, int(MAX_STEPS_FACTOR * ins.run.algo.sync_every_steps * under))
    return steps, int(steps * ins.tokens_per_step * under)


def answer(ins: Insider, opened: wire.Message, delta: torch.Tensor, steps: int, tokens: int) -> list[Any]:
    """An answer to ``opened`` as a learner sends it (the run's uplink codec)."""
    return wire.encode(kind=wire.UPDATE, run=ins.endpoints.run_id, sender=SENDER, fragment=opened.fragment,
                       values=delta.float(), codec=ins.run.algo.uplink_codec, epoch=opened.epoch,
                       round=opened.round, base=opened.version, steps=steps, tokens=tokens)


def _subscriber(ins: Insider) -> zmq.Socket:
    sub = ins.socket(zmq.SUB, ins.endpoints.broker_sub, "broker")
    for kind in (wire.OPEN, wire.FRAG):
        sub.setsockopt(zmq.SUBSCRIBE, wire.topic_prefix(ins.endpoints.run_id, kind))
    return sub


def _drain(sub: zmq.Socket, rep: Replica, timeout_ms: int) -> list[wire.Message]:
    """Every message waiting (after up to ``timeout_ms`` for the first), fed to ``rep``."""
    got = []
    while sub.poll(timeout_ms):
        timeout_ms = 0
        try:
            msg = wire.decode(sub.recv_multipart(copy=False))
            rep.on_message(msg)
        except wire.WireError:
            continue
        got.append(msg)
    return got


def answer_rounds(ins: Insider, seconds: float, make_delta: Callable[[Replica, int, int], torch.Tensor | None],
                  claims: tuple[int, int]) -> dict[str, Any]:
    """Answer every round of every fragment as soon as it opens, for ``seconds``."""
    sub, pub, rep = _subscriber(ins), ins.socket(zmq.PUB, ins.endpoints.broker_pub, "broker"), Replica()
    answered: set[tuple[int, int, int]] = set()
    sent = skipped = unencodable = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            ins.beat()
            ins.tick()
            for msg in _drain(sub, rep, 20):
                key = (msg.fragment, msg.epoch, msg.round)
                if msg.kind != wire.OPEN or key in answered or msg.fragment >= len(ins.numels):
                    continue
                delta = make_delta(rep, msg.fragment, ins.numels[msg.fragment])
                if delta is None:
                    skipped += 1
                    continue
                answered.add(key)
                try:
                    frames = answer(ins, msg, delta, *claims)
                except ValueError:          # the model it broke has non-finite updates: no codec takes them
                    unencodable += 1
                    continue
                pub.send_multipart(frames, copy=False)
                sent += 1
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        _leave(ins)
    return {"answers_sent": sent, "rounds_skipped_no_update_yet": skipped, "unencodable": unencodable,
            "claims": list(claims),
            "updates_seen": sum(len(v) for v in rep.norms.values())}


def _leave(ins: Insider) -> None:
    try:
        pipe = ins.r.pipeline(transaction=False)
        control.leave(pipe, ins.keys, SENDER)
        pipe.execute()
    except redis.RedisError:
        pass


def attack_signflip(ins: Insider, seconds: float) -> dict[str, Any]:
    return answer_rounds(ins, seconds, signflip_delta, max_claims(ins))


def attack_signflip_adaptive(ins: Insider, seconds: float) -> dict[str, Any]:
    return answer_rounds(ins, seconds, adaptive_delta, max_claims(ins, under=0.97))


def attack_freerider(ins: Insider, seconds: float) -> dict[str, Any]:
    return answer_rounds(ins, seconds, zero_delta, max_claims(ins))


def attack_flood(ins: Insider, seconds: float) -> dict[str, Any]:
    """``flood_rate`` answers a second, cycling over the open rounds (small honest-looking claims)."""
    sub, pub, rep = _subscriber(ins), ins.socket(zmq.PUB, ins.endpoints.broker_pub, "broker"), Replica()
    frames: dict[int, list[Any]] = {}
    sent = dropped = 0
    received0 = _shards_received(ins)
    t0 = time.monotonic()
    try:
        while (now := time.monotonic()) < t0 + seconds:
            ins.tick()
            for msg in _drain(sub, rep, 0):
                if msg.kind == wire.OPEN and msg.fragment < len(ins.numels):
                    delta = torch.randn(ins.numels[msg.fragment]) * 1e-3
                    frames[msg.fragment] = [bytes(memoryview(f)) for f in
                                            answer(ins, msg, delta, 1, int(ins.tokens_per_step / 2))]
            due = int((now - t0) * ins.flood_rate) - sent - dropped
            for i in range(min(due, 2000) if frames else 0):
                try:
                    pub.send_multipart(frames[list(frames)[i % len(frames)]], zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    dropped += 1
            if not frames or due <= 0:
                sub.poll(5)
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
    hold(ins, 1.5)            # the shards' counters reach Redis every second
    return {"answers_sent": sent, "dropped_at_send": dropped, "rate_per_s": round(sent / max(seconds, 1e-9)),
            "shards_received": _shards_received(ins) - received0}


def _shards_received(ins: Insider) -> int:
    """Answers the shards have taken in (into a round, or counted late or on a stale base)."""
    try:
        return sum(int(float(h.get(k) or 0)) for h in control.shard_table(ins.r, ins.keys).values()
                   for k in ("answers", "late_answers", "stale_base"))
    except (redis.RedisError, ValueError):
        return 0


# ----------------------------------------------------------------------------- memory
def hold(ins: Insider, seconds: float, every: Callable[[], None] | None = None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ins.tick()
        if every is not None:
            every()
        threading.Event().wait(0.1)


def attack_subscriptions(ins: Insider, seconds: float) -> dict[str, Any]:
    """``subscriptions`` distinct topic prefixes on one SUB socket, held for ``seconds``."""
    sub = ins.socket(zmq.SUB, ins.endpoints.broker_sub, "broker")
    try:
        for i in range(ins.subscriptions):
            sub.setsockopt(zmq.SUBSCRIBE, f"{ins.endpoints.run_id}|zzz.{i:09d}".encode())
            if i % 5000 == 0:
                ins.tick()
        hold(ins, seconds)
    finally:
        sub.close(linger=0)
    return {"subscriptions": ins.subscriptions}


def attack_bigframe(ins: Insider, seconds: float) -> dict[str, Any]:
    """A ``bigframe_mib`` MiB answer to the broker and a request as large to every shard's RPC."""
    big = bytes(ins.bigframe_mib << 20)
    frames = wire.encode(kind=wire.UPDATE, run=ins.endpoints.run_id, sender=SENDER, fragment=0, codec="fp32",
                         encoded=([big], len(big) // 4), round=0, base=0, steps=1, tokens=1)
    pub = ins.socket(zmq.PUB, ins.endpoints.broker_pub, "broker")
    _, eps = shard_endpoints(ins)
    dealers = [ins.socket(zmq.DEALER, ep, f"shard{k}") for k, ep in eps.items()]
    sent = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end and sent < 3:
            pub.send_multipart(frames, copy=False)
            for d in dealers:
                d.send_multipart([frames[0].replace(b"|upd.", b"|get."), frames[1], big], copy=False)
            sent += 1
            hold(ins, min(1.0, max(end - time.monotonic(), 0)))
        hold(ins, max(end - time.monotonic(), 0))
    finally:
        for s in (pub, *dealers):
            s.close(linger=0)
    return {"frames_mib": ins.bigframe_mib, "sent_to_broker": sent, "sent_to_shards": sent * len(dealers)}


def shard_endpoints(ins: Insider) -> tuple[int, dict[int, str]]:
    try:
        return control.shard_endpoints(ins.r, ins.keys)
    except (redis.RedisError, ValueError):
        return 0, {}


def attack_slowpeer(ins: Insider, seconds: float) -> dict[str, Any]:
    """Ask every learner's peer endpoint for its state, five times a second, and never read."""
    peers = {lid: h["peer"] for lid, h in control.live_learners(ins.r, ins.keys).items()
             if h.get("peer") and lid != SENDER}
    socks = {}
    for lid, ep in peers.items():
        s = ins.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
        if ins.sec is not None:
            ins.sec.client(s, lid)
        s.connect(ep)
        socks[lid] = s
    asked = [0]
    served0 = _states_served(ins)

    def ask() -> None:
        for s in socks.values():
            try:
                s.send_multipart(wire.encode_peer_ask(SENDER), zmq.NOBLOCK)
                asked[0] += 1
            except zmq.Again:
                pass
    try:
        hold(ins, seconds, ask)
    finally:
        for s in socks.values():
            s.close(linger=0)
    served = _states_served(ins)
    return {"peers": sorted(peers), "requests": asked[0],
            "states_served": {lid: served.get(lid, 0) - served0.get(lid, 0) for lid in peers}}


def _states_served(ins: Insider) -> dict[str, int]:
    """States each learner has served to joining peers (its ``bootstraps_served``)."""
    try:
        return {lid: int(float(h.get("bootstraps_served") or 0))
                for lid, h in control.live_learners(ins.r, ins.keys).items()}
    except (redis.RedisError, ValueError):
        return {}
