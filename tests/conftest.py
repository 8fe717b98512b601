"""Shared fixtures: a real redis-server per test, a broker and shards in threads, wait_until."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
import torch

from common import retry
from common.config import Endpoints, LearnerOptions, RunConfig, SyncerOptions
from common.lifecycle import stop_processes  # noqa: F401  (tests import it from here: one way to stop a process)
from common.redis_server import EmbeddedRedis, free_port
from common.task import Task
from ddloco.tasks.gpt import Batch

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):   # no test downloads, nor waits for the hub
    os.environ.setdefault(_var, "1")

TINY_TOML = """
[task]
n_layer = 1
n_embd = 16
n_head = 2
seq_len = 16
batch_size = 4
eval_batches = 2
corpus_max_bytes = 300000
[algo]
fragments = 4
sync_every_steps = 4
inner_warmup_steps = 2
"""
"""A tiny built-in task for tests that run the real daemons as processes."""


@dataclass
class HeldMerge:
    """Fragment ``index``'s next merge, held on its merge worker until ``release`` is set
    (``hold_merge``); ``entered`` is set once the worker holds it, ``clipper`` is what its job carried."""

    index: int = 0
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    clipper: Any = None


def hold_merge(monkeypatch: pytest.MonkeyPatch, index: int = 0) -> HeldMerge:
    """Patch ``syncer.merging.compute_merge`` so that fragment ``index``'s merge waits (at most 30 s)
    on its worker thread until the returned ``HeldMerge.release`` is set; other merges run."""
    from syncer import merging
    held, compute = HeldMerge(index), merging.compute_merge

    def holding(job: Any) -> Any:
        if job.spec.index == held.index and not held.release.is_set():
            held.clipper = job.clipper
            held.entered.set()
            held.release.wait(30)
        return compute(job)
    monkeypatch.setattr(merging, "compute_merge", holding)
    return held


def wait_until(predicate: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.02,
               what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail loudly with ``what`` on timeout."""
    value = retry.until(lambda: predicate() or None, retry.Deadline.after(timeout_s), interval_s=interval_s)
    if value is None:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
    return value


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


# ----------------------------------------------------------------------------- a tiny model
class TinyNet(torch.nn.Module):
    """Deterministic small regression net with 4 parameter tensors."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def tiny_batches(stream: int, batch_size: int = 16) -> Iterator[Batch]:
    """Infinite deterministic regression batches; ``stream`` selects an independent sequence."""
    g = torch.Generator().manual_seed(1000 + stream)
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    while True:
        x = torch.randn(batch_size, 8, generator=g)
        yield Batch(inputs=x, targets=x @ w, tokens=batch_size)


def tiny_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch.inputs), batch.targets)


def tiny_task(model: Callable[[], torch.nn.Module] = TinyNet, name: str = "tiny") -> Task:
    """A Task around ``model`` on the tiny regression streams (``start`` skips batches)."""
    def batches(stream: int, seed: int, start: int) -> Iterator[Batch]:
        it = tiny_batches(stream)
        for _ in range(start):
            next(it)
        return it
    return Task(name=name, model=model, batches=batches, loss=tiny_loss)


def start_guarded(errors: list[BaseException], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> threading.Thread:
    """``fn(*args, **kwargs)`` on a daemon thread; whatever it raises lands in ``errors`` (the test asserts it empty)."""
    def body() -> None:
        try:
            fn(*args, **kwargs)
        except BaseException as e:  # surfaced by the test through errors
            errors.append(e)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


# ----------------------------------------------------------------------------- in-process cluster
@dataclass
class Cluster:
    """Broker + shards in threads of this process, against a real Redis and real sockets."""

    endpoints: Endpoints
    run: RunConfig
    task: Task
    checkpoint_dir: str
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    shards: dict[int, Any] = field(default_factory=dict)
    shard_stops: dict[int, threading.Event] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # surfaced by the test through cluster.errors
                self.errors.append(e)
        return run

    def start_broker(self, **opts: Any) -> None:
        from broker.daemon import Broker, BrokerOptions
        opts = BrokerOptions(xsub_bind=self.endpoints.broker_pub, xpub_bind=self.endpoints.broker_sub,
                             keys_dir=self.endpoints.keys_dir, **opts)
        ready = threading.Event()

        def loop() -> None:
            with Broker(opts) as b:
                self.broker = b
                ready.set()
                while not self.stop.is_set():
                    b.poll_once(20)
        t = threading.Thread(target=self._guard(loop), daemon=True)
        t.start()
        self.threads.append(t)
        wait_until(lambda: ready.is_set() or self.errors, 10, what="broker up")
        if self.errors:
            raise self.errors[-1]

    def start_shard(self, k: int, shards: int, **opts: Any) -> Any:
        from syncer.shard import Shard
        stop = threading.Event()
        self.shard_stops[k] = stop
        ready = threading.Event()
        options = SyncerOptions(shard=k, shards=shards, checkpoint_dir=self.checkpoint_dir,
                                initial_step_time_s=0.02, **opts)

        def loop() -> None:
            with Shard(endpoints=self.endpoints, options=options, run=self.run, task=self.task) as s:
                self.shards[k] = s
                ready.set()
                while not (stop.is_set() or self.stop.is_set()):
                    s.poll_once(5)
        t = threading.Thread(target=self._guard(loop), daemon=True)
        t.start()
        self.threads.append(t)
        wait_until(lambda: ready.is_set() or self.errors, 20, what=f"shard {k} up")
        if self.errors:
            raise self.errors[0]
        return self.shards[k]

    def stop_shard(self, k: int) -> None:
        self.shard_stops[k].set()

    def learner(self, learner_id: str, stream: int, *, max_steps: int = 0, run: RunConfig | None = None,
                **opts: Any) -> Any:
        from learner.core import Learner
        if self.endpoints.keys_dir:   # a listed key for every learner the test makes
            from common.security import create_keys
            create_keys(self.endpoints.keys_dir, learners=[learner_id], broker=False, monitors=())
        return Learner(endpoints=self.endpoints, options=LearnerOptions(learner_id=learner_id, max_steps=max_steps,
                                                                       data_shard=stream, heartbeat_interval_s=0.1,
                                                                       **opts),
                       task=self.task, run=run or self.run, stop=self.stop)

    def start_learner(self, learner: Any) -> threading.Thread:
        t = threading.Thread(target=self._guard(learner.run), daemon=True)
        t.start()
        self.threads.append(t)
        return t

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)


@pytest.fixture
def make_cluster(redis_server: EmbeddedRedis, tmp_path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(run: RunConfig, *, run_id: str = "t", task: Task | None = None, secure: bool = False,
             broker: dict[str, Any] | None = None) -> Cluster:
        """``secure``: CURVE keys for the broker, 2 shards and the monitor (learners get theirs
        from ``Cluster.learner``), every socket authenticated and encrypted. ``broker``: more
        BrokerOptions."""
        keys_dir = ""
        if secure:
            from common.security import create_keys
            keys_dir = str(tmp_path / "keys")
            create_keys(keys_dir, shards=2)
        ep = Endpoints(run_id=run_id, redis_url=redis_server.url, broker_pub=f"tcp://127.0.0.1:{free_port()}",
                       broker_sub=f"tcp://127.0.0.1:{free_port()}", keys_dir=keys_dir)
        c = Cluster(endpoints=ep, run=run, task=task or tiny_task(), checkpoint_dir=str(tmp_path / "ckpt"))
        # a secure broker learns S (for the owner rule) from the run's config in Redis
        c.start_broker(**{**({"redis_url": redis_server.url, "run_id": run_id} if secure else {}), **(broker or {})})
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@dataclass
class HandDaemons:
    """A broker and one syncer started as processes, the way a user starts them by hand."""

    net: list[str]
    """The flags every command of this run needs (endpoints, run id, --insecure, JSON logs)."""
    env: dict[str, str]
    procs: list[Any]


def start_hand_daemons(tmp_path: Any, redis_url: str, run_id: str, *, broker_args: tuple[str, ...] = (),
                       syncer_env: dict[str, str] | None = None) -> HandDaemons:
    """Broker and syncer processes on the TINY_TOML task; stop them with ``stop_processes``."""
    import os
    import subprocess
    import sys
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    pub, sub = free_port(), free_port()
    net = ["--insecure", "--redis-url", redis_url, "--broker-pub", f"tcp://127.0.0.1:{pub}",
           "--broker-sub", f"tcp://127.0.0.1:{sub}", "--run-id", run_id, "--log-format", "json"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DDLOCO_INSECURE": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "broker", "--xsub", f"tcp://127.0.0.1:{pub}",
                               "--xpub", f"tcp://127.0.0.1:{sub}", *broker_args], env=env, stderr=subprocess.DEVNULL),
             subprocess.Popen([sys.executable, "-m", "syncer", "--config", str(cfg), *net,
                               "--checkpoint-dir", str(tmp_path / "ck")],
                              env={**env, **(syncer_env or {})}, stderr=subprocess.DEVNULL)]
    return HandDaemons(net, env, procs)

