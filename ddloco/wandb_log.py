"""`ddloco up --wandb PROJECT`: the run's figures in Weights & Biases, as the run goes.

Points, each with ``tokens`` (the tokens trained by all learners) as its x axis:
- ``eval/loss``: every evaluation of the global model (the initial, periodic and final ones);
- every progress line (5 s): ``run/merges``, ``run/goodput`` (useful / provisioned learner
  time so far), ``train/loss`` (the learners' mean loss EMA) and ``learner/<id>/step_s``
  (each learner's step time estimate, seconds);
- at the end the run summary gains the report's headline figures (``eval_loss_final``, ...).

wandb reads its own environment: ``WANDB_ENTITY``, ``WANDB_NAME`` (default: the run id),
``WANDB_RUN_GROUP``, ``WANDB_TAGS``, ``WANDB_DIR``, ``WANDB_MODE=offline`` (no network: sync later
with ``wandb sync``). The optional ``wandb`` package is imported only when the flag is given.

Threads: the eval point comes from the monitor's evaluation thread, the progress points and the
summary from `up`'s main thread; ``_run_lock`` guards the wandb run they both log to.
"""
from __future__ import annotations

import threading
from typing import Any

from common.config import ConfigError

MISSING = "ddloco up --wandb needs the wandb package: pip install 'decoupled-diloco[wandb]'"
"""The one line `ddloco up` prints (exit 2) when the package is not installed."""

EVAL_LOSS_KEY = "eval/loss"
TOKENS_KEY = "tokens"
SUMMARY_KEYS = ("tokens_total", "steps_total", "eval_loss_initial", "eval_loss_final", "merges", "goodput",
                "uptime", "wall_s", "learner_restarts")
"""The report's figures copied into the wandb run's summary when the run ends."""


def wandb_missing() -> str | None:
    """Why ``--wandb`` cannot work here (``MISSING``), or None when it can."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return MISSING
    return None


class WandbStartError(ConfigError):
    """wandb.init failed (no API key, no network in online mode, a bad project name): one line,
    exit 2, before the run starts."""


class WandbLog:
    """One wandb run for one `up` run (its config is the run's config)."""

    def __init__(self, project: str, *, name: str | None, config: dict[str, Any]) -> None:
        import wandb

        self._run_lock = threading.Lock()
        try:
            self._run = wandb.init(project=project, name=name, config=config,
                                   settings=wandb.Settings(console="off"))  # up's own output stays as it is
        except Exception as e:   # wandb raises its own error types (UsageError, CommError, ...)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise WandbStartError(f"--wandb {project}: wandb could not start a run: {first} "
                                  f"(`wandb login`, or WANDB_MODE=offline to log without network)") from None
        self._run.define_metric(TOKENS_KEY)
        for prefix in ("eval", "run", "train", "learner"):
            self._run.define_metric(f"{prefix}/*", step_metric=TOKENS_KEY)
        self.where = self._run.dir if self._run.offline else (self._run.url or project)
        """For people: the run's page, or its local directory in offline mode."""

    def add_eval(self, tokens: int, loss: float) -> None:
        """One evaluation of the global model: ``eval/loss`` at ``tokens``."""
        self._log({TOKENS_KEY: int(tokens), EVAL_LOSS_KEY: float(loss)})

    def add_progress(self, figures: dict[str, float]) -> None:
        """The live figures of a progress line (``Monitor.live_figures``), ``tokens`` among them."""
        self._log(dict(figures))

    def add_report(self, report: dict[str, Any]) -> None:
        """The report's headline figures, as the wandb run's summary."""
        with self._run_lock:
            self._run.summary.update({k: report[k] for k in SUMMARY_KEYS if report.get(k) is not None})

    def close(self, exit_code: int = 0) -> None:
        with self._run_lock:
            self._run.finish(exit_code=exit_code)

    def _log(self, row: dict[str, Any]) -> None:
        with self._run_lock:
            self._run.log(row)
