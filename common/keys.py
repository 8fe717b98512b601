"""The Redis key schema: every key name of a run, and nothing else, lives here.

All keys of run ``R`` share the prefix ``ddl:{R}:`` (the braces make them one Redis Cluster
hash slot). Redis holds coordination state only, never the model.

| key                          | type   | content                                                  |
|------------------------------|--------|----------------------------------------------------------|
| config                       | hash   | blob (digest, RunConfig, created_at), shards, layout     |
|                              |        | (name, shape, kind of every tensor); each set once (NX)  |
| learners                     | set    | ids of learners with a heartbeat, kept by the shards     |
| learner:<id>                 | hash   | steps, tokens, step_ema_s, status, counters, timings     |
| hb:<id>                      | string | heartbeat, expires after heartbeat_ttl_s                 |
| life:<id>:<incarnation>      | hash   | the counters of one learner process (expire after 24 h): |
|                              |        | what a restart under the same id would overwrite         |
| shards                       | set    | shard indices that registered                            |
| shard:<k>                    | hash   | rpc endpoint, pid, merges, counters                      |
| shard:<k>:lease              | string | holder of shard k (one live process per shard), with TTL |
| frag:<p>                     | hash   | version, round, shard, merged_at, contributors           |
| events                       | stream | merge, drop, failure, shard events (capped); written by  |
|                              |        | shards, the broker and the operator                      |
| events:<id>                  | stream | join, leave, refuse of learner <id>, its own writes      |
|                              |        | (capped; ``control.read_events`` merges them)            |
| broker                       | hash   | the broker's counters: messages, refused by reason,      |
|                              |        | auth_failures (written every second when it has a run)   |
| epochs                       | string | counter: every shard start takes the next epoch          |
| tokens                       | string | the run's global token count: the sum of tokens:by, kept |
|                              |        | by the script that writes it (common/tokens.py)          |
| tokens:by                    | hash   | <id>:<incarnation> -> that learner process's tokens as   |
|                              |        | the shards accepted them (its own count, capped per id), |
|                              |        | only ever raised; shards checkpoint the hash and write   |
|                              |        | it back after a restart                                  |
| positions                    | hash   | <id> -> that learner id's data position (batches of its  |
|                              |        | stream trained on) as the shards last read it; only      |
|                              |        | raised; checkpointed, written back after a restart       |
|                              |        | (common/positions.py)                                    |
| eval                         | hash   | the global model's last evaluation by `ddloco up`: loss, |
|                              |        | tokens, versions_total, at (wall time), initial_loss     |
"""
from __future__ import annotations

import re

EVENTS_MAXLEN = 20_000

CONFIG_KEY_PATTERN = "ddl:{*}:config"
"""SCAN pattern of every run's config key: which runs a Redis holds (``run_id_of_config_key``)."""


def run_id_of_config_key(key: str) -> str | None:
    """The run id of a key ``CONFIG_KEY_PATTERN`` matched; None for a key that only looks like one."""
    m = re.fullmatch(r"ddl:\{([A-Za-z0-9._-]{1,64})\}:config", key)
    return m.group(1) if m else None


class Keys:
    """Key names of one run."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.prefix = f"ddl:{{{run_id}}}:"

    @property
    def config(self) -> str:
        return self.prefix + "config"

    @property
    def broker(self) -> str:
        return self.prefix + "broker"

    @property
    def learners(self) -> str:
        return self.prefix + "learners"

    def learner(self, learner_id: str) -> str:
        return f"{self.prefix}learner:{learner_id}"

    def heartbeat(self, learner_id: str) -> str:
        return f"{self.prefix}hb:{learner_id}"

    @property
    def shards(self) -> str:
        return self.prefix + "shards"

    def shard(self, shard: int) -> str:
        return f"{self.prefix}shard:{shard}"

    def shard_lease(self, shard: int) -> str:
        return f"{self.prefix}shard:{shard}:lease"

    def life(self, learner_id: str, incarnation: str) -> str:
        return f"{self.prefix}life:{learner_id}:{incarnation}"

    def fragment(self, fragment: int) -> str:
        return f"{self.prefix}frag:{fragment}"

    @property
    def events(self) -> str:
        return self.prefix + "events"

    def learner_events(self, learner_id: str) -> str:
        return f"{self.prefix}events:{learner_id}"

    @property
    def epochs(self) -> str:
        return self.prefix + "epochs"

    @property
    def tokens(self) -> str:
        return self.prefix + "tokens"

    @property
    def token_shares(self) -> str:
        return self.prefix + "tokens:by"

    @property
    def positions(self) -> str:
        return self.prefix + "positions"

    @property
    def eval(self) -> str:
        return self.prefix + "eval"


def token_share(learner_id: str, incarnation: str) -> str:
    """The field of one learner process in ``Keys.token_shares``."""
    return f"{learner_id}:{incarnation}"
