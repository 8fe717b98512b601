"""What `ddloco fuzz` and `--insider` watch while they attack a run: the cluster's processes
(alive, heartbeating, resident memory) and whether training goes on, sampled through Redis and
/proc, and the report they fill (``FuzzReport``). Owning thread: the caller's; nothing here
starts a thread."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from common import control
from common.keys import Keys


@dataclass
class Sample:
    t: float
    alive: dict[str, bool]
    rss_kb: dict[str, int]
    merges: int
    steps: int
    beats: dict[str, bool]


@dataclass
class FuzzReport:
    seed: int
    inputs: dict[str, int] = field(default_factory=dict)
    dropped_at_send: int = 0
    handshakes_tried: int = 0
    seconds: float = 0.0
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    rss_kb_start: dict[str, int] = field(default_factory=dict)
    rss_kb_end: dict[str, int] = field(default_factory=dict)
    rss_kb_max: dict[str, int] = field(default_factory=dict)
    merges: tuple[int, int] = (0, 0)
    learner_steps: tuple[int, int] = (0, 0)
    training_went_on: bool = False
    broker: dict[str, Any] = field(default_factory=dict)
    shards_refused: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.inputs.values())

    @property
    def ok(self) -> bool:
        return not self.crashes and not self.hangs and self.training_went_on

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(total=self.total, ok=self.ok, memory_growth_kb={
            k: self.rss_kb_end.get(k, 0) - v for k, v in self.rss_kb_start.items()})
        return d


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class ClusterWatch:
    """Samples the run's processes through Redis (and the broker by its port on this machine)."""

    def __init__(self, r: Any, keys: Keys, broker_pub: str, *, pids: Callable[[], dict[str, int]] | None = None):
        self.r = r
        self.keys = keys
        self.broker_pub = broker_pub
        self._pids = pids
        self.known: dict[str, int] = {}

    def pids(self) -> dict[str, int]:
        if self._pids is not None:
            return self._pids()
        out = {}
        for k, h in control.shard_table(self.r, self.keys).items():
            if h.get("pid") and h.get("status") != "stopped":
                out[f"shard{k}"] = int(h["pid"])
        for lid, h in control.live_learners(self.r, self.keys).items():
            if h.get("pid"):
                out[lid] = int(h["pid"])
        from ddloco.chaos import ProcessTargets
        bp = ProcessTargets(self.r, self.keys, redis_url="", broker_pub=self.broker_pub, log_dir=Path(".")).pid("broker")
        if bp:
            out["broker"] = bp
        return out

    def sample(self) -> Sample:
        now = time.time()
        if not self.known:
            self.known = self.pids()
        alive = {n: Path(f"/proc/{p}").exists() and _state(p) != "Z" for n, p in self.known.items()}
        beats: dict[str, bool] = {}
        shards = control.shard_table(self.r, self.keys)
        for n in self.known:
            if n.startswith("shard"):
                h = shards.get(int(n.removeprefix("shard")), {})
                beats[n] = now - float(h.get("heartbeat_at") or 0) < 10.0
            elif n != "broker":
                beats[n] = bool(self.r.exists(self.keys.heartbeat(n)))
        merges = sum(int(h.get("merges") or 0) for h in shards.values())
        steps = sum(int(float(h.get("steps") or 0)) for h in control.live_learners(self.r, self.keys).values())
        return Sample(now, alive, {n: _rss_kb(p) for n, p in self.known.items()}, merges, steps, beats)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def _take(s: Sample, rep: FuzzReport) -> None:
    for name, ok in s.alive.items():
        if not ok and name not in rep.crashes:
            rep.crashes.append(name)
    for name, ok in s.beats.items():
        if s.alive.get(name) and not ok and name not in rep.hangs:
            rep.hangs.append(name)
    for name, kb in s.rss_kb.items():
        if kb:
            rep.rss_kb_end[name] = kb
            rep.rss_kb_max[name] = max(rep.rss_kb_max.get(name, 0), kb)
    rep.merges = (rep.merges[0], max(rep.merges[1], s.merges))
    rep.learner_steps = (rep.learner_steps[0], max(rep.learner_steps[1], s.steps))
