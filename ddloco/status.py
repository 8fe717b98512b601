"""`ddloco status`: live view of a run, read from Redis (one snapshot, ``--json``, or ``--watch``)."""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from typing import Any

import redis

from common import control
from common import entries
from common import exits
from common.config import Endpoints
from common.keys import Keys
from common.exits import USAGE as EXIT_USAGE

LAG_ROUNDS = 3
"""A fragment this many merges (and half) behind the median fragment has stopped merging."""


def lagging_fragments(versions: dict[int, int], failed: dict[int, int] | None = None, *,
                      rounds: int = LAG_ROUNDS) -> list[int]:
    """Fragments that stopped merging while the others go on: more than ``max(rounds, median / 2)``
    versions behind the median fragment (rounds visit every fragment in turn), and either never
    merged, below a quarter of the median, or with rounds that closed without a merge since its
    last one (``failed``: the shard's count). A fragment merely slower than the others (its shard
    busier, its last rounds still open at the end of a short run) is not named."""
    if not versions:
        return []
    failed = failed or {}
    median = statistics.median(versions.values())
    return sorted(p for p, v in versions.items() if v < median - max(rounds, median / 2)
                  and (v == 0 or v < median / 4 or failed.get(p, 0) > 0))


def fragment_states(r: redis.Redis, keys: Keys, n_fragments: int) -> dict[int, dict[str, Any]]:
    """Each fragment's entry in Redis: version, owning shard, open round, last contributors, and the
    problem its shard recorded when a round closed without a merge (one pipelined read)."""
    pipe = r.pipeline(transaction=False)
    for p in range(n_fragments):
        pipe.hgetall(keys.fragment(p))
    return {p: entries.parse_fragment_entry(p, h) for p, h in enumerate(pipe.execute())}


def lagging_lines(frags: dict[int, dict[str, Any]], plan: Any = None) -> dict[int, str]:
    """Fragment -> one line for a person for each lagging one: what it holds (``plan``: the run's
    fragments, when known), how far behind, and why (the shard's recorded problem)."""
    lagging = lagging_fragments({p: f["version"] for p, f in frags.items()},
                                {p: f["failed_rounds"] for p, f in frags.items()})
    if not lagging:
        return {}
    median = statistics.median(f["version"] for f in frags.values())
    out = {}
    for p in lagging:
        f = frags[p]
        why = f.get("problem") or "no round of it merged (no answers reached its shard?)"
        holds = f" (holds {plan[p].describe()})" if plan is not None else ""
        out[p] = (f"fragment {p}{holds} is at version {f['version']} while the median fragment is at "
                  f"{median:g}: {why}" + (f"; {f['failed_rounds']} rounds failed" if f.get("failed_rounds") else ""))
    return out


def describe_lagging(r: redis.Redis, keys: Keys, frags: dict[int, dict[str, Any]], n_fragments: int) -> dict[int, str]:
    """``lagging_lines`` with the run's plan rebuilt from the layout it recorded in Redis."""
    if not lagging_fragments({p: f["version"] for p, f in frags.items()},
                             {p: f["failed_rounds"] for p, f in frags.items()}):
        return {}
    layout = control.run_layout(r, keys)
    plan = None
    if layout:
        from common.fragments import plan_from_layout
        plan = plan_from_layout(layout, n_fragments)
    return lagging_lines(frags, plan)


def collect_status(r: redis.Redis, keys: Keys, *, redis_url: str = "") -> dict:
    """The run's state as ``status --json`` prints it; RunConfigMissing (naming the run id,
    ``redis_url`` and the runs that are there) when the run is not in this Redis."""
    cfg = control.fetch_run_config(r, keys, redis_url=redis_url)
    live = control.live_learners(r, keys)
    learners = control.all_learners(r, keys)
    now = time.time()
    members = {}
    for lid, h in sorted(learners.items()):
        last = float(h.get("last_merged_at") or 0)   # every number of ``h`` was checked by control
        members[lid] = {
            "live": lid in live, "status": h.get("status", "?") if lid in live else ("left" if h.get("status") == "left" else "gone"),
            "steps": int(float(h.get("steps", 0))), "tokens": int(float(h.get("tokens", 0))),
            "step_ema_s": float(h.get("step_ema_s", 0)), "loss_ema": float(h.get("loss_ema", 0)),
            "merged_contributions": int(h.get("merged_contributions") or 0),
            "last_contribution_age_s": round(now - last, 2) if last else None,
        }
    frags = fragment_states(r, keys, cfg.algo.fragments)
    shards = {k: {"status": h.get("status"), "merges": int(float(h.get("merges") or 0)),
                  "dropped": int(float(h.get("dropped") or 0)), "rpc": h.get("rpc")}
              for k, h in control.shard_table(r, keys).items()}
    ev = entries.parse_eval_entry(r.hgetall(keys.eval))
    evaluation = None
    if ev is not None:
        evaluation = {"loss": ev["loss"], "initial_loss": ev["initial_loss"], "tokens": int(ev["tokens"]),
                      "age_s": round(now - ev["at"], 1)}
    return {"run_id": keys.run_id, "config_digest": cfg.digest(), "live_learners": len(live), "eval": evaluation,
            "learners": members, "fragments": frags, "shards": shards,
            "lagging_fragments": describe_lagging(r, keys, frags, cfg.algo.fragments)}


def describe_eval(ev: dict[str, Any] | None) -> str:
    """The global model's last evaluation, for a person."""
    if ev is None:
        return "global model: not evaluated yet (`ddloco up` evaluates it; by hand: `ddloco export`, then your eval)"
    return (f"global model: eval loss {ev['loss']:.4f} (initial {ev['initial_loss']:.4f}) at {ev['tokens']:,} tokens, "
            f"{ev['age_s']:.0f}s ago")


STATUS_STYLE = {"training": "green", "joining": "cyan", "blocked": "yellow", "flushing": "yellow",
                "gone": "bold red", "left": "dim", "stopped": "dim"}


def render(st: dict | None, *, error: str = "", updated_at: float | None = None) -> Any:
    """The ``--watch`` view of ``collect_status``'s dict (None: nothing read yet) as one rich
    renderable: learners, a summary of the fragments' versions, shards, and the last error."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    parts: list[Any] = []
    if st is not None:
        t = Table(title=f"run {st['run_id']} (config {st['config_digest']}): {st['live_learners']} live learner(s)",
                  title_justify="left")
        for name in ("learner", "status", "steps", "tokens", "step s", "loss", "merged", "last"):
            t.add_column(name, justify="left" if name in ("learner", "status") else "right")
        for lid, m in st["learners"].items():
            age = m["last_contribution_age_s"]
            t.add_row(lid, Text(m["status"], style=STATUS_STYLE.get(m["status"], "")), f"{m['steps']:,}",
                      f"{m['tokens']:,}", f"{m['step_ema_s']:.3f}", f"{m['loss_ema']:.3f}",
                      str(m["merged_contributions"]), "-" if age is None else f"{age:.0f}s")
        parts.append(t)
        parts.append(Text(describe_eval(st.get("eval"))))
        frags = st["fragments"]
        versions = [f["version"] for f in frags.values()]
        if versions:
            in_flight = sum(1 for f in frags.values() if f["round"] >= 0)
            parts.append(Text(f"fragments {len(versions)}: versions min {min(versions)}, median "
                              f"{statistics.median(versions):g}, max {max(versions)}, sum {sum(versions)}; "
                              f"{in_flight} round(s) open"))
            parts.append(Text(" ".join(f"{p}:{f['version']}" for p, f in frags.items()), style="dim"))
        for line in st.get("lagging_fragments", {}).values():
            parts.append(Text(f"WARNING {line}", style="bold red"))
        shards = Table(title="shards", title_justify="left")
        for name in ("shard", "status", "merges", "dropped", "rpc"):
            shards.add_column(name, justify="right" if name in ("merges", "dropped") else "left")
        for k, sh in st["shards"].items():
            shards.add_row(str(k), Text(str(sh["status"]), style="green" if sh["status"] == "running" else "yellow"),
                           str(sh["merges"]), str(sh["dropped"]), str(sh["rpc"]))
        parts.append(shards)
    if error:
        parts.append(Text(f"error: {error} (retrying)", style="bold red"))
    when = time.strftime("%H:%M:%S", time.localtime(updated_at)) if updated_at else "-"
    parts.append(Text(f"updated {when}; Ctrl-C to leave", style="dim"))
    return Group(*parts)


def watch_status(endpoints: Endpoints, *, interval_s: float = 1.0, count: int = 0, console: Any = None,
                 stop: threading.Event | None = None) -> int:
    """``--watch``: redraw the view every ``interval_s`` until Ctrl-C (exit 0), ``stop``, or
    ``count`` refreshes (exit 0 when the last one read the run, else 1). A Redis that fails or
    goes away is shown in the view and asked again at the next refresh; the last state stays."""
    from rich.console import Console
    from rich.live import Live
    r = control.connect(endpoints.redis_url)
    keys = Keys(endpoints.run_id)
    wait = stop or threading.Event()
    console = console or Console()
    st: dict | None = None
    error, n = "", 0
    def refresh() -> Any:
        nonlocal st, error, n
        try:
            st, error = collect_status(r, keys, redis_url=endpoints.redis_url), ""
        except redis.RedisError as e:
            error = f"Redis at {control.redact(endpoints.redis_url)} failed: {e}"
        except (control.RunConfigMissing, ValueError) as e:   # not started yet, or half-written
            error = str(e)
        n += 1
        return render(st, error=error, updated_at=time.time())
    try:
        if not console.is_terminal:   # a file or a pipe: every view in turn, written as it is drawn
            try:
                while True:
                    console.print(refresh())
                    console.file.flush()
                    if (count and n >= count) or wait.wait(interval_s):
                        break
            except BrokenPipeError:   # the reader left (`| head`): done
                return exits.OK
            return exits.FAILURE if error else exits.OK
        with Live(render(None, error="", updated_at=None), console=console, auto_refresh=False) as live:
            while True:
                live.update(refresh(), refresh=True)
                if (count and n >= count) or wait.wait(interval_s):
                    break
    except KeyboardInterrupt:
        return exits.OK
    return exits.FAILURE if error else exits.OK


def run_status(endpoints: Endpoints, *, as_json: bool, watch_s: float | None = None, count: int = 0) -> int:
    if watch_s is not None:
        return watch_status(endpoints, interval_s=watch_s, count=count)
    r = control.connect(endpoints.redis_url)
    keys = Keys(endpoints.run_id)
    try:
        st = collect_status(r, keys, redis_url=endpoints.redis_url)
    except redis.RedisError as e:
        print(f"ddloco status: Redis at {control.redact(endpoints.redis_url)} failed: {e}", file=sys.stderr)
        return exits.FAILURE
    except control.RunConfigMissing as e:   # a run id that is not in this Redis: the user's input
        print(f"ddloco status: {e}", file=sys.stderr)
        return EXIT_USAGE
    if as_json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return exits.OK
    print(f"run {st['run_id']} (config {st['config_digest']}): {st['live_learners']} live learner(s)")
    print(describe_eval(st["eval"]))
    print(f"{'learner':<20} {'status':<9} {'steps':>7} {'tokens':>10} {'step_s':>7} {'loss':>6} {'merged':>7} {'last':>7}")
    for lid, m in st["learners"].items():
        last = "-" if m["last_contribution_age_s"] is None else f"{m['last_contribution_age_s']:.0f}s"
        print(f"{lid:<20} {m['status']:<9} {m['steps']:>7} {m['tokens']:>10} {m['step_ema_s']:>7.3f} "
              f"{m['loss_ema']:>6.3f} {m['merged_contributions']:>7} {last:>7}")
    print("fragments (p:version): " + " ".join(f"{p}:{f['version']}" for p, f in st["fragments"].items()))
    for line in st["lagging_fragments"].values():
        print(f"WARNING {line}")
    for k, s in st["shards"].items():
        print(f"shard {k}: {s['status']} merges={s['merges']} dropped={s['dropped']} rpc={s['rpc']}")
    return exits.OK
