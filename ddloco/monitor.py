"""The `up` monitor: progress lines, evaluation of the global model, the run's figures.

The global model is the union of the shards' current fragments, fetched over the request path
(``common.rpc``) and evaluated on the task's fixed held-out batches. The run's figures are
computed by ``ddloco.run_figures``.

Threads: `up`'s main thread (its control loop) owns the monitor. A periodic evaluation runs on
the ``monitor-eval`` thread (``evaluate_in_background``): while it runs, that thread owns the
model and what an evaluation writes (``model``, ``params``, ``versions``, ``evals``, ``last_eval``);
the main thread reads them only after ``wait_evaluation`` (``evaluate`` and ``adopt_final`` wait
first), and at most one evaluation runs at a time; it only reads the learners' counters
(``learners``, ``lives``: the token count). Everything else is the main thread's.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import redis

from common import control
from common import entries
from common.config import ConfigFile
from common.fragments import model_plan, scatter, state_tensors
from common.keys import Keys
from common.rpc import fetch_fragments
from common.security import Security
from common.task import Task, TaskError, build_model, evaluate
from common.running_stats import recalibrate
from ddloco.run_figures import as_float as _f
from ddloco.run_figures import (global_downtime, learner_processes, learner_time, life_spans, merged_steps, problems,
                                summary_line)


class Monitor:
    def __init__(self, cfg: ConfigFile, r: redis.Redis, keys: Keys, task: Task, *, learner_ids: list[str],
                 say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.r = r
        self.keys = keys
        self.security = Security(cfg.endpoints.keys_dir, "monitor") if cfg.endpoints.keys_dir else None
        self.learner_ids = learner_ids
        self.say = say
        self.task = task
        self.model = build_model(task, cfg.run.task.seed)
        self.plan = model_plan(self.model, task.embedding_names, cfg.run.algo.fragments)
        self.params = state_tensors(self.model)
        self.t0 = time.time()
        self.evals: list[dict[str, float]] = []
        self.samples: dict[str, list[tuple[float, str]]] = {lid: [] for lid in learner_ids}
        self.learners: dict[str, dict[str, str]] = {}
        self.last_print = 0.0
        self.last_eval = time.time()
        self.final_versions: dict[int, int] | None = None
        """Fragment versions the model holds after a successful final evaluation (None: none)."""
        self.versions: dict[int, int] = {}
        """Fragment versions ``self.model`` holds now ({}: the initial model of a new run); written
        with the model by the evaluating thread, read by the control loop after ``wait_evaluation``."""
        self.events: list[dict[str, Any]] = []
        """Every event of the run, read as it happens (a Redis restart or the capped stream
        would lose them otherwise)."""
        self._last_event_id = "-"
        self._last_learner_event_ids: dict[str, str] = {}
        """Per learner's own event stream (``control.add_learner_event``): the last id read."""
        self.marks: list[tuple[float, str, str]] = []
        """(seconds, kind, target) of injected faults and temporary learners, for timeline.png."""
        self.token_samples: list[tuple[float, int]] = []
        self.lives: dict[tuple[str, str], dict[str, str]] = {}
        """The last counters seen of each learner process (id, incarnation): a restarted learner
        overwrites its hash in Redis, its earlier lives stay here."""
        self.lagging: dict[int, str] = {}
        """Fragments that stopped merging while the others go on (ddloco.status.lagging_fragments),
        with the line that names them; a fragment leaves it when it catches up."""
        self._eval_thread: threading.Thread | None = None
        """The periodic evaluation runs here, off ``up``'s control loop: progress lines, restarts
        and the time cap never wait for it (one evaluation took ~90 s under a 32-learner load)."""

    token_offset: int = 0
    """Tokens of the earlier parts of a resumed run (``up --resume``)."""
    resumed: bool = False
    """The shards start from checkpoints: the initial evaluation fetches their fragments."""
    on_eval: Callable[[int, float], None] | None = None
    """Called with (tokens, loss) after each evaluation of the global model (``up --tensorboard``)."""
    on_progress: Callable[[dict[str, float]], None] | None = None
    """Called on the control loop with ``live_figures()`` at each progress line (``up --wandb``)."""
    bn_recalibrated_batches: int = 0
    """Batches the final model's normalization statistics were re-estimated on (0: not re-estimated)."""
    eval_loss_bn_recalibrated: float | None = None
    """The final model's eval loss after that (the eval curve keeps the shards' model, merged statistics)."""

    def tokens_total(self) -> int:
        """Tokens trained by every learner process of the run (restarted ones included)."""
        return self.token_offset + int(sum(_f(h, "tokens") for h in self.learner_lives()))

    def evaluate(self, *, initial: bool = False, final: bool = False,
                 state: tuple[Any, dict[int, int]] | None = None) -> float | None:
        """Evaluate the global model: ``state`` (a model and its fragments' versions, e.g. read
        from checkpoints), else the shards' current fragments (the initial model of a new run).
        Called from the control loop it first waits for a periodic evaluation still running."""
        if threading.current_thread() is not self._eval_thread:
            self.wait_evaluation()
        versions: dict[int, int] = {}
        if state is not None:
            self.model.load_state_dict(state[0].state_dict(), strict=True)
            versions = dict(state[1])
        elif not initial or self.resumed:
            try:
                # a periodic evaluation skips rather than stall the monitor (a shard may be recovering)
                frags = fetch_fragments(self.r, self.keys, len(self.plan), security=self.security,
                                        numels=[f.numel for f in self.plan],
                                        timeout_s=60.0 if initial or final else 5.0)
            except (TimeoutError, redis.RedisError) as e:
                self.say(f"eval       skipped: {e}")
                return None
            for p, (v, values) in frags.items():
                scatter(self.params, self.plan[p], values)
                versions[p] = v
            if final:
                self.final_versions = versions
        self.versions = versions
        if self.task.eval_batches is None:
            return None  # a task without held-out batches: no evaluation, the model is still exported
        loss = evaluate(self.task, self.model)
        self.evals.append({"t": time.time() - self.t0, "tokens": self.tokens_total(), "loss": loss,
                           "versions_total": sum(versions.values()), **({"final": True} if final else {}),
                           **self._model_samples()})
        self.last_eval = time.time()
        if self.on_eval is not None:
            self.on_eval(self.evals[-1]["tokens"], loss)
        self._publish_eval(self.evals[-1])
        tag = "initial" if initial else "final" if final else "eval"
        self.say(f"{tag:<10} global model eval loss {loss:.4f} at {self.tokens_total():,} tokens")
        self._say_model_samples(self.evals[-1])
        return loss

    def _model_samples(self) -> dict[str, list[str]]:
        """``{"samples": [...]}``: the global model's greedy samples (``Task.samples``), for an eval
        entry; {} for a task without them or when they fail (an evaluation never fails for them)."""
        if self.task.samples is None:
            return {}
        try:
            return {"samples": [str(x) for x in self.task.samples(self.model)]}
        except Exception as e:   # the task's own code: reported, never fatal
            self.say(f"samples    failed: {type(e).__name__}: {e}")
            return {}

    def _say_model_samples(self, entry: dict[str, Any]) -> None:
        for text in entry.get("samples", []):
            self.say(f"{'sample':<10} {text!r}")

    def _publish_eval(self, entry: dict[str, Any]) -> None:
        """The last evaluation where ``ddloco status`` reads it (Redis ``eval``); best effort."""
        first = self.evals[0]["loss"] if self.evals else entry["loss"]
        try:
            self.r.hset(self.keys.eval, mapping={"loss": entry["loss"], "tokens": entry["tokens"],
                                                 "versions_total": entry["versions_total"], "at": time.time(),
                                                 "initial_loss": first})
        except redis.RedisError:
            pass

    def evaluate_in_background(self) -> None:
        """Start a periodic evaluation on its own thread unless one is running (then skip)."""
        if self._eval_thread is not None and self._eval_thread.is_alive():
            return
        self.last_eval = time.time()
        self._eval_thread = threading.Thread(target=self._background_evaluation, name="monitor-eval", daemon=True)
        self._eval_thread.start()

    def _background_evaluation(self) -> None:
        try:
            self.evaluate()
        except Exception as e:   # an evaluation must never take the run down
            self.say(f"eval       failed: {e!r}")

    def wait_evaluation(self, timeout_s: float | None = None) -> None:
        t = self._eval_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def adopt_final(self, model: Any, versions: dict[int, int]) -> None:
        """The shards' final model (from their checkpoints): it replaces the final evaluation when
        merges landed after it (the report and model.safetensors then describe the same model)."""
        self.wait_evaluation()
        if self.final_versions is not None and versions == self.final_versions:
            return
        self.model.load_state_dict(model.state_dict(), strict=True)
        self.final_versions = versions
        self.versions = versions
        if self.task.eval_batches is None:
            return
        loss = evaluate(self.task, self.model)
        entry = {"t": time.time() - self.t0, "tokens": self.tokens_total(), "loss": loss,
                 "versions_total": sum(versions.values()), **self._model_samples()}
        if self.evals and self.evals[-1].get("final"):
            self.evals[-1] = {**entry, "final": True}
        else:
            self.evals.append({**entry, "final": True})
        if self.on_eval is not None:
            self.on_eval(entry["tokens"], loss)
        self._publish_eval(entry)
        self.say(f"{'final':<10} global model eval loss {loss:.4f} at {self.tokens_total():,} tokens "
                 f"(the shards' checkpoints: {entry['versions_total']} merges)")
        self._say_model_samples(entry)

    def recalibrate_final(self) -> None:
        """With ``Task.recalibrate_bn_batches`` > 0: re-estimate the final model's normalization
        statistics (common/running_stats.py), so that the report's ``eval_loss_final`` and
        model.safetensors are of that model; the eval curve stays the shards' model."""
        n = self.task.recalibrate_bn_batches
        if n <= 0 or self.final_versions is None:
            return
        self.wait_evaluation()
        try:
            done = recalibrate(self.task, self.model, seed=self.cfg.run.task.seed, batches=n)
        except TaskError as e:
            self.say(f"{'final':<10} {e}; the merged statistics are kept")
            return
        if done.layers == 0:
            self.say(f"{'final':<10} note: {done.describe()} (Task.recalibrate_bn_batches = {n} has no effect)")
            return
        self.bn_recalibrated_batches = done.batches
        if self.task.eval_batches is None:
            self.say(f"{'final':<10} {done.describe()}")
            return
        self.eval_loss_bn_recalibrated = evaluate(self.task, self.model)
        before = self.evals[-1]["loss"] if self.evals and self.evals[-1].get("final") else None
        self.say(f"{'final':<10} global model eval loss {self.eval_loss_bn_recalibrated:.4f} with normalization "
                 f"statistics re-estimated on {done.batches} training batches"
                 + (f" (merged statistics: {before:.4f})" if before is not None else ""))

    def add_learner(self, lid: str) -> None:
        """A learner started during the run (a temporary one, ``--extra-learners``)."""
        if lid not in self.learner_ids:
            self.learner_ids.append(lid)
            self.samples[lid] = []

    def mark(self, kind: str, target: str) -> None:
        self.marks.append((round(time.time() - self.t0, 3), kind, target))

    def _rate(self, a: float, b: float) -> float | None:
        """Tokens per second between seconds a and b of the run (from the 1 Hz samples)."""
        pts = [(t, n) for t, n in self.token_samples if a <= t <= b]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return round((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), 1)

    def _loss_near(self, t: float) -> float | None:
        if not self.evals:
            return None
        return min(self.evals, key=lambda e: abs(e["t"] - t))["loss"]

    def extra_effect(self, extra: tuple[int, float, float]) -> dict[str, Any]:
        """What ``--extra-learners N --extra-at T --extra-for D`` did: tokens/s before, during
        and after the window, eval loss at its ends, the temporary learners' merged answers."""
        n, at, dur = extra
        extra_ids = [f"extra-{j}" for j in range(n)]
        return {"learners": n, "at_s": at, "for_s": dur,
                "tokens_per_s_before": self._rate(max(0.0, at - dur), at),
                "tokens_per_s_during": self._rate(at, at + dur),
                "tokens_per_s_after": self._rate(at + dur, at + 2 * dur),
                "eval_loss_at_start": self._loss_near(at), "eval_loss_at_end": self._loss_near(at + dur),
                "merged_contributions": {lid: int(_f(self.learners.get(lid, {}), "merged_contributions"))
                                         for lid in extra_ids}}

    def poll_events(self) -> None:
        """Append the events written since the last call (ids are time-ordered, also across a
        Redis restart)."""
        try:
            start = "-" if self._last_event_id == "-" else f"({self._last_event_id}"
            for eid, e in self.r.xrange(self.keys.events, min=start, count=10_000):
                self.events.append(e)
                self._last_event_id = eid
        except redis.RedisError:
            pass
        self.poll_learner_events()

    def poll_learner_events(self) -> None:
        """Append what each learner wrote in its own stream since the last call (join, leave,
        refuse), each entry naming the learner whose stream it is."""
        try:
            for lid, key in control.learner_event_streams(self.r, self.keys).items():
                last = self._last_learner_event_ids.get(lid, "-")
                for eid, e in self.r.xrange(key, min="-" if last == "-" else f"({last}", count=10_000):
                    self.events.append({**e, "learner": lid})
                    self._last_learner_event_ids[lid] = eid
        except redis.RedisError:
            pass

    def tick(self) -> None:
        now = time.time()
        self.poll_events()
        try:
            self.learners = {lid: h for lid, h in control.all_learners(self.r, self.keys).items()}
        except redis.RedisError:
            return
        for lid, h in self.learners.items():
            if h.get("incarnation"):
                self.lives[(lid, h["incarnation"])] = h
        self.token_samples.append((now - self.t0, self.tokens_total()))
        live = set()
        try:
            live = set(control.live_learners(self.r, self.keys))
        except redis.RedisError:
            pass
        for lid in self.learner_ids:
            h = self.learners.get(lid)
            status = "boot" if h is None else h.get("status", "boot")
            if status in ("training",) and lid not in live:
                status = "down"
            if status == "joining":
                status = "boot"
            if status == "training":
                status = "up"
            if status == "flushing":  # past its last step, answering once more: not training
                status = "blocked"
            self.samples[lid].append((now - self.t0, status))
        if now - self.last_eval >= self.cfg.up.eval_every_s:
            self.evaluate_in_background()
        if now - self.last_print >= 5.0:
            self.last_print = now
            self.check_fragments()
            self.say(self.progress_line())
            if self.on_progress is not None:
                self.on_progress(self.live_figures())

    def check_fragments(self) -> None:
        """A loud line when a fragment stops merging while the others go on (what it holds and
        why), and one when it catches up again."""
        from ddloco.status import fragment_states, lagging_lines
        try:
            frags = fragment_states(self.r, self.keys, len(self.plan))
        except redis.RedisError:
            return
        lines = lagging_lines(frags, self.plan)
        for p in sorted(set(lines) - set(self.lagging)):
            self.say(f"WARNING    {lines[p]}")
        for p in sorted(set(self.lagging) - set(lines)):
            self.say(f"fragment   {p} merges again (version {frags[p]['version']})")
        self.lagging = lines

    def merges(self) -> int:
        try:
            return sum(v or 0 for v in control.fragment_versions(self.r, self.keys, range(len(self.plan))).values())
        except redis.RedisError:
            return -1

    def progress_line(self) -> str:
        steps = [int(_f(self.learners.get(lid, {}), "steps")) for lid in self.learner_ids]
        losses = [_f(h, "loss_ema") for h in self.learners.values() if _f(h, "loss_ema") > 0]
        target = self.cfg.up.steps or 0
        ev = self.evals[-1] if self.evals else None
        return (f"[{time.time() - self.t0:6.1f}s] steps {'/'.join(map(str, steps))}"
                + (f" of {target}" if target else "")
                + f" | merges {self.merges()} | tokens {self.tokens_total():,}"
                + (f" | train loss {sum(losses) / len(losses):.3f}" if losses else "")
                + (f" | eval {ev['loss']:.3f}" if ev else ""))

    def live_figures(self) -> dict[str, float]:
        """The run so far: tokens, merges, goodput, the learners' mean train loss and each one's
        step time estimate (seconds), keyed as ``up --wandb`` logs them."""
        provisioned, useful, _ = learner_time([self._lives_of(lid) for lid in self.learner_ids], self.t0)
        losses = [_f(h, "loss_ema") for h in self.learners.values() if _f(h, "loss_ema") > 0]
        figures = {"tokens": self.tokens_total(), "run/merges": self.merges(),
                   "run/goodput": round(useful / provisioned, 4) if provisioned else 0.0,
                   **({"train/loss": sum(losses) / len(losses)} if losses else {})}
        for lid in self.learner_ids:
            if _f(self.learners.get(lid, {}), "step_ema_s") > 0:
                figures[f"learner/{lid}/step_s"] = _f(self.learners[lid], "step_ema_s")
        return figures

    # ------------------------------------------------------------------ figures
    def merge_events(self) -> list[dict[str, Any]]:
        self.poll_events()
        merges = (entries.parse_merge_event(e) for e in self.events if e.get("kind") == "merge")
        return [e for e in merges if e is not None]

    def replaced_incarnations(self) -> int:
        """Learner processes that ended without leaving and were replaced under the same id."""
        self.poll_events()
        return sum(1 for e in self.events if e.get("kind") == "leave"
                   and str(e.get("reason", "")).startswith("replaced"))

    def collect_lives(self) -> None:
        """Every process's own last counters from Redis (newer than what the 1 Hz poll saw)."""
        try:
            stored = control.learner_lives(self.r, self.keys)
        except redis.RedisError:
            return
        for key, h in stored.items():
            seen = self.lives.get(key)
            if seen is None or _f(h, "updated_at") >= _f(seen, "updated_at"):
                self.lives[key] = h

    def _all_lives(self) -> dict[tuple[str, str], dict[str, str]]:
        lives = dict(self.lives)
        for lid, h in self.learners.items():
            key = (lid, h.get("incarnation", ""))
            if key not in lives or _f(h, "updated_at") >= _f(lives[key], "updated_at"):
                lives[key] = h
        return lives

    def learner_lives(self) -> list[dict[str, str]]:
        """The last counters of every learner process of the run (all incarnations)."""
        return list(self._all_lives().values())

    def _lives_of(self, lid: str) -> list[dict[str, str]]:
        return [h for (l, _), h in list(self._all_lives().items()) if l == lid]

    def shard_table(self) -> dict[int, dict[str, str]]:
        try:
            return control.shard_table(self.r, self.keys)
        except redis.RedisError:
            return {}

    def report(self, *, wall_s: float, interrupted: bool, timed_out: bool, failure: str,
               learner_exit_codes: dict[str, int | None]) -> dict[str, Any]:
        self.collect_lives()
        merges = self.merge_events()
        shards = self.shard_table()
        contributors: set[str] = set()
        merge_times: list[float] = []
        fragments_merged: set[int] = set()
        for e in merges:
            contributors.update(e["contributors"])
            merge_times.append(float(e["t"]))
            fragments_merged.add(int(e["fragment"]))
        provisioned, useful, flushing = learner_time([self._lives_of(lid) for lid in self.learner_ids], self.t0)
        downtime, span = global_downtime(merge_times, list(self.learners.values()), self.t0,
                                         gap_s=self.cfg.syncer.downtime_gap_s)
        lives = self.learner_lives()
        ev0 = next((e for e in self.evals if e["tokens"] == 0), self.evals[0] if self.evals else None)
        evf = self.evals[-1] if len(self.evals) > 1 else None
        return {
            "run_id": self.keys.run_id,
            "learners": len(self.learner_ids),
            "syncers": self.cfg.up.syncers,
            "wall_s": round(wall_s, 2),
            "tokens_total": self.tokens_total(),
            "steps_total": int(sum(_f(h, "steps") for h in lives)),
            "eval_loss_initial": ev0["loss"] if ev0 else None,
            "eval_loss_final": (self.eval_loss_bn_recalibrated if self.eval_loss_bn_recalibrated is not None
                                else evf["loss"] if evf else None),
            "eval_loss_final_before_bn_recalibration": (evf["loss"] if evf and self.eval_loss_bn_recalibrated
                                                        is not None else None),
            "bn_recalibrated_batches": self.bn_recalibrated_batches,
            "eval_curve": self.evals,
            "merges": max(len(merges), int(sum(_f(h, "merges") for h in shards.values()))),
            "goodput": round(useful / provisioned, 4) if provisioned else 0.0,
            "flush_share": round(flushing / provisioned, 4) if provisioned else 0.0,
            "uptime": round(1.0 - downtime / span, 4),
            "global_downtime_s": round(downtime, 3),
            "bytes_up": int(sum(_f(h, "bytes_up") for h in lives)),
            "bytes_down": int(sum(_f(h, "bytes_out") for h in shards.values())),
            "dropped_messages": int(sum(_f(h, "dropped") for h in shards.values())
                                    + sum(_f(h, "malformed") for h in lives)),
            "rejections": {k.removeprefix("rejected_"): int(sum(_f(h, k) for h in shards.values()))
                           for k in sorted({k for h in shards.values() for k in h if k.startswith("rejected_")})},
            "claims_clamped": int(sum(_f(h, "claims_clamped") for h in shards.values())),
            "weights_capped": int(sum(_f(h, "weights_capped") for h in shards.values())),
            "failures_injected": {},
            "versions_regressed": int(sum(_f(h, "versions_regressed") for h in lives)),
            "learner_processes": learner_processes(self.lives, self.events, self.learners),
            "learner_restarts": self.replaced_incarnations(),
            "contributors": sorted(contributors),
            "every_learner_contributed": set(self.learner_ids) <= contributors,
            "fragments_merged": len(fragments_merged),
            "every_fragment_merged": len(fragments_merged) == len(self.plan),
            # no merge event in this part and, where the final versions are known, still at version 0
            # (a resumed part, or events a Redis restart lost, must not read as never merged)
            "fragments_never_merged": sorted(p for p in set(range(len(self.plan))) - fragments_merged
                                             if self.final_versions is None or not self.final_versions.get(p, 0)),
            "fragments_lagging": {str(p): line for p, line in self.lagging.items()},
            "learner_stats": self.learners,
            "learner_exit_codes": learner_exit_codes,
            "shard_stats": {str(k): v for k, v in shards.items()},
            "interrupted": interrupted,
            "timed_out": timed_out,
            "failure": failure,
            "config": self.cfg.run.to_dict(),
            "merge_timeline": [(round(float(e["t"]) - self.t0, 3), int(e["fragment"])) for e in merges],
            "merged_steps": merged_steps(merges, len(self.plan)),
            "lives": life_spans(self._all_lives().items(), self.t0),
        }

    problems = staticmethod(problems)
    summary_line = staticmethod(summary_line)
