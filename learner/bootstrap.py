"""Peer bootstrap, the training thread's side (ALGORITHM §8): a joining learner takes a training
peer's merged bases, AdamW state and place in the per-life ramp; a training learner snapshots
them for a joiner at a step boundary. The bytes travel on the network thread
(learner/peer_link.py; frame layout in common/wire.py).

``PeerBootstrap`` is a part of ``Learner`` (learner/core.py); everything here runs on the
training thread and touches only what it owns. ``_serve_watch`` is its own state.
"""
from __future__ import annotations

import queue
import random
import socket
import time
from typing import Any

import redis
import torch

from common import control
from common.fragments import scatter
from learner.messages import AskPeer, FragmentArrived, PeerState, PeerStateArrived, PeerStateWanted, RoundOpened
from learner.peer_link import optimizer_digest

SERVE_COST_STEPS = 20
"""Steps over which a learner that served its state to a joiner measures what it cost it."""
PEER_STATE_FORMAT = 1
"""The layout of the state dict (inside the wire's peer format)."""
LOOPBACK = ("tcp://127.", "tcp://localhost:", "ipc://", "inproc://")


def reachable_peers(live: dict[str, dict[str, str]], *, me: str, here: str,
                    fresh_after: float) -> list[tuple[str, str]]:
    """(learner id, peer endpoint) of the training learners this one can ask, sorted: heartbeat
    newer than ``fresh_after`` (not a frozen one), and a loopback endpoint only on this host."""
    return sorted((lid, h["peer"]) for lid, h in live.items()
                  if lid != me and h.get("status") == "training" and h.get("peer")
                  and float(h.get("updated_at") or 0) >= fresh_after
                  and (h.get("host") == here or not h["peer"].startswith(LOOPBACK)))


class PeerBootstrap:
    """Both sides of peer bootstrap on the training thread; see the module docstring."""

    _serve_watch: dict[str, Any] | None = None

    # ------------------------------------------------------------------ serving a joiner
    def _peer_snapshot(self, want: PeerStateWanted) -> PeerState:
        """At a step boundary (training thread): copies of what a joiner needs to continue like
        us: the merged bases and their versions (not our unmerged steps: those are ours to
        answer), AdamW state, our place in the per-life ramp. Serialised off this thread."""
        opt, rc = self._opt, self.receipt
        sharded = self.group is not None and self.group.sharded   # AdamW state is spread over the ranks
        if opt is None or sharded or any(v is None for v in rc.base_values) or self.status != "training":
            return PeerState(want.identity, want.requester, None)
        t0 = time.perf_counter()
        opt_state = opt.state_dict()
        opt_state = {"state": {i: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                   for k, v in st.items()} for i, st in opt_state["state"].items()},
                     "param_groups": opt_state["param_groups"]}
        state = {"format": PEER_STATE_FORMAT, "peer": self.id, "plan": self.plan_digest,
                 "versions": [int(v) for v in rc.base_version], "epochs": [int(e) for e in rc.base_epoch],
                 "bases": list(rc.base_values),  # merged values: replaced, never written in place
                 "optimizer": opt_state, "life_steps": int(self._sched.last_epoch), "steps": self._stats.steps}
        self._stats.bootstraps_served += 1
        self._serve_watch = {"to": want.requester, "ema_before": self._stats.step_ema_s, "iters": []}
        return PeerState(want.identity, want.requester, state, time.perf_counter() - t0)

    def _watch_serve_cost(self, iter_s: float, n: int = SERVE_COST_STEPS) -> None:
        """What serving a joiner cost our own training: the mean of the next ``n`` iterations
        (the one that took the snapshot included) against the step time before it."""
        w = self._serve_watch
        if w is None:
            return
        w["iters"].append(iter_s)
        if len(w["iters"]) < n:
            return
        self._serve_watch = None
        mean = sum(w["iters"]) / len(w["iters"])
        before = w["ema_before"]
        self.log.info("learner.bootstrap_serve_cost", to=w["to"], steps=n, mean_step_s=round(mean, 5),
                      step_before_s=round(before, 5), slowdown=round(mean / before - 1.0, 4) if before else None)

    # ------------------------------------------------------------------ joining from a peer
    def _bootstrap_from_peer(self) -> bool:
        """Take a training peer's state (bases at their versions, AdamW state, ramp position);
        False when there is no peer or none answers within ``peer_timeout_s`` (then the shards)."""
        try:
            live = control.live_learners(self.redis, self.keys)
        except redis.RedisError:
            return False
        fresh = time.time() - 2 * self.options.heartbeat_interval_s - 0.5   # not a frozen one
        peers = reachable_peers(live, me=self.id, here=socket.gethostname(), fresh_after=fresh)
        if not peers:
            return False
        peer, endpoint = random.Random(self.incarnation).choice(peers)
        t0 = time.monotonic()
        self._outbox.put(AskPeer(peer, endpoint))
        arrived, stash = self._await_peer_state(t0)
        ok = arrived is not None and arrived.state is not None and self._adopt_peer_state(arrived)
        if not ok:
            why = "no answer" if arrived is None else (arrived.error or "state refused")
            self.log.warning("learner.bootstrap_fallback", peer=peer, reason=why,
                             waited_s=round(time.monotonic() - t0, 3))
        for item in stash:  # what arrived meanwhile: newer merges, open rounds
            if isinstance(item, FragmentArrived):
                if ok:
                    self._apply(item)
            elif isinstance(item, RoundOpened):
                self.receipt.keep_open(item)
            else:
                self._handle(item)
        if ok:
            self._stats.bootstrap = f"peer {peer}"
            self.log.info("learner.bootstrapped", peer=peer, bytes=arrived.nbytes,
                          seconds=round(time.monotonic() - t0, 3), versions_max=int(self.receipt.base_version.max()),
                          optimizer_digest=optimizer_digest(self._boot_optimizer))
            self._fetch_behind()
        return ok

    def _await_peer_state(self, t0: float) -> tuple[PeerStateArrived | None, list[Any]]:
        """The peer's reply (None: none within ``peer_timeout_s`` of the request or of the last part
        of the state that arrived) and the other messages that arrived meanwhile, in order."""
        stash: list[Any] = []
        while not self.stop.is_set() and time.monotonic() - max(t0, self.net.peer_progress_at) < \
                self.options.peer_timeout_s:
            try:
                item = self._inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(item, PeerStateArrived):
                return item, stash
            stash.append(item)
        return None, stash

    def _adopt_peer_state(self, arrived: PeerStateArrived) -> bool:
        st = arrived.state
        try:
            if (st.get("format") != PEER_STATE_FORMAT or st.get("plan") != self.plan_digest
                    or len(st["bases"]) != len(self.plan)):
                self.log.warning("learner.bootstrap_refused", peer=arrived.peer, reason="another model layout")
                return False
            values = [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in st["bases"]]
            if any(v.numel() != f.numel for v, f in zip(values, self.plan)):
                return False
            versions, epochs = list(st["versions"]), list(st["epochs"])
            opt_state, life = st["optimizer"], int(st["life_steps"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        for frag, v in zip(self.plan, values):
            scatter(self.tensors, frag, v)
        self.receipt.adopt(values, versions, epochs)
        self._boot_optimizer, self._boot_life_steps = opt_state, life
        return True

    def _fetch_behind(self) -> None:
        """Fragments the run has merged past the peer's copy: ask their shards now."""
        try:
            recorded = control.fragment_versions(self.redis, self.keys, range(len(self.plan)))
        except redis.RedisError:
            return
        self.receipt.fetch_behind(recorded, time.monotonic())
        self._send_fetches()
