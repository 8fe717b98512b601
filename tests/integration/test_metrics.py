"""Every daemon's Prometheus endpoint, scraped over HTTP from a training cluster (real Redis,
real ZeroMQ sockets, the broker, a shard and a learner in threads of this process)."""
from __future__ import annotations

import math
import urllib.error
import urllib.request

import pytest

from common import control
from common.config import AlgoConfig, RunConfig
from common.keys import Keys
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)

RUN = RunConfig(algo=AlgoConfig(fragments=4, sync_every_steps=4, quorum=1, inner_warmup_steps=1))


def scrape(url: str) -> list:
    """The samples at ``url`` (parsed by prometheus_client: the format is valid)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(samples: list, name: str, **labels: str) -> float | None:
    """Sum of the samples named ``name`` whose labels include ``labels`` (None: no such sample)."""
    hits = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(hits) if hits else None


def scrape_until(url: str, name: str, above: float, what: str) -> list:
    """The samples at ``url`` once ``name`` is above ``above`` (scraped again until then)."""
    def ready() -> list | None:
        samples = scrape(url)
        return samples if (value(samples, name) or 0) > above else None
    return wait_until(ready, 30, interval_s=0.1, what=what)


def test_broker_shard_and_learner_serve_their_counters_at_metrics(make_cluster):
    cluster = make_cluster(RUN, run_id="met", broker={"metrics_port": 0, "run_id": "met"})
    shard = cluster.start_shard(0, 1, metrics_port=0)
    learner = cluster.learner("l1", 0, step_time_floor_ms=5, metrics_port=0)
    cluster.start_learner(learner)
    broker_url, shard_url = cluster.broker.metrics.url, shard.metrics.url
    learner_url = wait_until(lambda: learner.metrics and learner.metrics.url, 20, what="the learner's endpoint")

    shard_m = scrape_until(shard_url, "ddloco_shard_merges_total", 1, "2 merges on the shard's /metrics")
    ident = {"run_id": "met", "role": "shard", "member": "shard0"}
    assert value(shard_m, "ddloco_up", **ident) == 1, shard_m
    assert value(shard_m, "ddloco_info", **ident) == 1
    assert value(shard_m, "ddloco_shard_answers_total", outcome="accepted") >= 2
    assert value(shard_m, "ddloco_shard_answers_total", outcome="late") is not None
    assert value(shard_m, "ddloco_shard_bytes_total", direction="in") > 0
    assert value(shard_m, "ddloco_shard_bytes_total", direction="out") > 0
    assert value(shard_m, "ddloco_shard_round_seconds_count") >= 2
    assert value(shard_m, "ddloco_shard_round_seconds_sum") > 0
    assert value(shard_m, "ddloco_shard_round_seconds_bucket", le="+Inf") == value(
        shard_m, "ddloco_shard_round_seconds_count")
    assert value(shard_m, "ddloco_shard_grace_window_seconds") >= 0
    assert {s.labels["fragment"] for s in shard_m if s.name == "ddloco_shard_fragment_version"} == {"0", "1", "2", "3"}
    assert value(shard_m, "process_resident_memory_bytes") > 0
    assert math.isnan(value(shard_m, "ddloco_run_global_eval_loss"))        # nothing evaluated the run yet
    control.connect(cluster.endpoints.redis_url).hset(Keys("met").eval, mapping={"loss": 1.25})   # as `up` writes it
    wait_until(lambda: value(scrape(shard_url), "ddloco_run_global_eval_loss") == 1.25, 20,
               what="the global eval loss on the shard's /metrics")

    learner_m = scrape_until(learner_url, "ddloco_learner_steps_total", 0, "learner steps on its /metrics")
    assert value(learner_m, "ddloco_up", run_id="met", role="learner", member="l1") == 1
    assert value(learner_m, "ddloco_learner_tokens_total") > 0
    assert value(learner_m, "ddloco_learner_status", status="training") == 1
    assert value(learner_m, "ddloco_learner_status", status="joining") == 0
    assert value(learner_m, "ddloco_learner_queue_depth", queue="inbox") is not None
    assert value(learner_m, "ddloco_learner_queue_depth", queue="outbox") is not None
    assert value(learner_m, "ddloco_learner_step_seconds") > 0

    broker_m = scrape(broker_url)
    assert value(broker_m, "ddloco_up", run_id="met", role="broker", member="broker") == 1
    assert value(broker_m, "ddloco_broker_messages_total", kind="upd") > 0     # the learner's answers
    assert value(broker_m, "ddloco_broker_messages_total", kind="frag") > 0    # the shard's merges
    assert value(broker_m, "ddloco_broker_bytes_total", kind="upd") > 0
    assert value(broker_m, "ddloco_broker_subscriptions_total") > 0
    _grafana_queries_exist([broker_url, shard_url, learner_url])

    cluster.close()   # each daemon's stop shuts its endpoint down and frees the port
    assert not cluster.errors, cluster.errors
    for url in (broker_url, shard_url, learner_url):
        with pytest.raises(urllib.error.URLError):
            scrape(url)


def _grafana_queries_exist(urls: list[str]) -> None:
    """Every metric the Grafana dashboard (docker/grafana/ddloco.json) queries is one a live daemon
    declares at its /metrics (a sample, or a labelled counter's family with no sample yet)."""
    import json
    import re
    from pathlib import Path
    from prometheus_client.parser import text_string_to_metric_families
    served: set[str] = set()
    for url in urls:
        for fam in text_string_to_metric_families(urllib.request.urlopen(url, timeout=5).read().decode()):
            served |= {fam.name, f"{fam.name}_total" if fam.type == "counter" else fam.name}
            served |= {x.name for x in fam.samples}
    dash = json.loads((Path(__file__).resolve().parents[2] / "docker/grafana/ddloco.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    queried = {m for e in exprs for m in re.findall(r"\b(ddloco_[a-z_]+)\b", e)}
    missing = sorted(m for m in queried if m not in served)
    assert not missing, f"the Grafana dashboard queries metrics no daemon serves: {missing}"
