"""`ddloco up`'s experiment trackers: ``--tensorboard DIR`` and ``--wandb PROJECT`` as one object.

``Trackers`` is made in ``up``'s constructor (a wandb run that cannot start is refused there,
before anything starts), attached to the monitor once it exists (each evaluation, and for wandb
each progress line), given the report at the end, and closed with ``up``'s exit code. Threads:
the monitor's evaluation thread calls ``on_eval``; everything else runs on ``up``'s main thread
(``ddloco/wandb_log.py`` guards its run with a lock).
"""
from __future__ import annotations

from typing import Any, Callable


class Trackers:
    """The trackers a run was asked for (none, either or both)."""

    def __init__(self, *, tensorboard: str | None, wandb: str | None, wandb_name: str,
                 wandb_config: dict[str, Any]) -> None:
        self.tensorboard_dir = tensorboard
        self.scalars: Any = None   # the TensorBoardLog, opened when attached
        self.wandb: Any = None
        if wandb:
            from ddloco.wandb_log import WandbLog
            self.wandb = WandbLog(wandb, name=wandb_name, config=wandb_config)

    def attach(self, monitor: Any, say: Callable[[str], None]) -> None:
        """Every evaluation of ``monitor`` (and for wandb every progress line) goes to the trackers."""
        sinks = []
        if self.tensorboard_dir:
            from ddloco.tensorboard_log import EVAL_LOSS_TAG, TensorBoardLog
            self.scalars = TensorBoardLog(self.tensorboard_dir)
            sinks.append(self.scalars.add_eval)
            say(f"tensorboard {EVAL_LOSS_TAG} vs tokens in {self.tensorboard_dir} "
                f"(`tensorboard --logdir {self.tensorboard_dir}`)")
        if self.wandb is not None:
            sinks.append(self.wandb.add_eval)
            monitor.on_progress = self.wandb.add_progress
            say(f"wandb      eval/loss, merges, goodput, step times vs tokens: {self.wandb.where}")
        if sinks:
            def on_eval(tokens: int, loss: float) -> None:
                for sink in sinks:
                    sink(tokens, loss)
            monitor.on_eval = on_eval

    def add_report(self, report: dict[str, Any]) -> None:
        if self.wandb is not None:
            self.wandb.add_report(report)

    def close(self, rc: int) -> None:
        if self.scalars is not None:
            self.scalars.close()
        if self.wandb is not None:
            self.wandb.close(rc)
