"""The learner's pace and schedule, on its training thread: emulated hardware (``--slowdown``,
``--step-time-floor-ms``), the step time the shards space rounds by, the loss EMA, and the record
of the run token counts the learning-rate schedule reads (a count below the highest read is a
regression of the schedule).

Ownership: a ``StepPace`` belongs to the learner's training thread (its own state, and the
fields of the learner's ``LearnerStats`` it writes: train_s, step_ema_s, boot_phases' step
times, loss_ema, schedule_tokens, schedule_regressions).
"""
from __future__ import annotations

import random
import time
from typing import Any

import torch

from learner.inner import schedule_factor
from learner.stats import step_time_estimate

LOSS_READ_EVERY = 16
"""On an accelerator the loss EMA is brought up to date every this many steps (one host sync)."""


class StepPace:
    """The pace of one learner's inner steps; see the module docstring."""

    def __init__(self, *, stats: Any, options: Any, algo: Any, log: Any, stop: Any) -> None:
        """``stats``: the learner's counters; ``options``: its ``LearnerOptions`` (slowdown, step
        time floor); ``algo``: the run's ``AlgoConfig`` (the schedule); ``stop``: an Event whose
        ``wait`` sleeps out the emulated step time (and ends it at once on stop)."""
        self.stats = stats
        self.options = options
        self.algo = algo
        self.log = log
        self.stop = stop
        self._noise = random.Random()
        """Draws of ``step_noise`` (this process's own sequence)."""
        self._timed_steps = 0
        """Inner steps of this life seen by the step-time estimate (``step_time_estimate``)."""
        self._schedule_dip: tuple[int, float] | None = None
        """While the schedule reads a run token count below its highest: (reads so far, lowest
        ratio of the schedule's factor to the factor at the highest count)."""
        self._losses: list[torch.Tensor] = []
        self._loss_seen = 0

    def after_step(self, t_iter: float, t_step: float) -> float:
        """After a step that started at ``t_step`` (its batches' reading included), in an iteration
        that started at ``t_iter``: wait out an emulated slower chip or accelerator step time, then
        count the iteration's work and update the pace the shards space rounds by. Returns the
        iteration's seconds."""
        stats = self.stats
        compute_s = time.perf_counter() - t_step
        opts = self.options
        target_s = max(compute_s, opts.step_time_floor_ms / 1000.0) * opts.slowdown
        if opts.step_noise > 0:
            target_s *= max(0.2, 1.0 + opts.step_noise * self._noise.gauss(0.0, 1.0))
        if target_s > compute_s:
            self.stop.wait(target_s - compute_s)
        ema = stats.step_ema_s
        now = time.perf_counter()
        iter_s = now - t_iter
        # a frozen iteration is no work: at most 3 × the estimate (before there is one, 3 × the step)
        worked_s = min(iter_s, 3 * (ema if ema > 0 else now - t_step))
        stats.train_s += worked_s
        # the pace at which this learner reaches step boundaries: the step and the sync work
        # on this thread (merges applied, answers snapshotted), which the shards space rounds by
        stats.step_ema_s = step_time_estimate(ema, worked_s, self._timed_steps)
        if self._timed_steps < 2:   # the first two iterations' seconds: the first one is left out above
            stats.boot_phases[f"step{self._timed_steps + 1}_s"] = round(iter_s, 3)
        self._timed_steps += 1
        return iter_s

    def note_schedule_tokens(self, tokens: float) -> None:
        """Record the count the schedule read (``schedule_tokens``: the highest); a read below it
        is a regression of the schedule: counted, logged when it starts and when it ends."""
        s = self.stats
        if tokens >= s.schedule_tokens:
            if self._schedule_dip is not None:
                reads, low = self._schedule_dip
                self.log.info("learner.schedule_caught_up", run_tokens=int(tokens), reads_behind=reads,
                              lowest_lr_ratio=round(low, 6))
                self._schedule_dip = None
            s.schedule_tokens = tokens
            return
        s.schedule_regressions += 1
        high = schedule_factor(self.algo, s.schedule_tokens)
        ratio = schedule_factor(self.algo, tokens) / high if high > 0 else 1.0
        if self._schedule_dip is None:
            self.log.warning("learner.schedule_went_back", run_tokens=int(tokens), highest=int(s.schedule_tokens),
                             lr_ratio=round(ratio, 6))
        reads, low = self._schedule_dip or (0, 1.0)
        self._schedule_dip = (reads + 1, min(low, ratio))

    def note_loss(self, loss: torch.Tensor) -> None:
        """Loss EMA. On an accelerator the step's loss stays on the device and is read in batches
        of LOSS_READ_EVERY steps (one host sync each), so the training thread never waits for
        the device just to log; on a CPU it is read at once."""
        self._losses.append(loss)
        if loss.device.type != "cpu" and len(self._losses) < LOSS_READ_EVERY:
            return
        values = torch.stack(self._losses).tolist() if len(self._losses) > 1 else [float(self._losses[0])]
        self._losses.clear()
        for lv in values:
            self._loss_seen += 1
            self.stats.loss_ema = lv if self._loss_seen == 1 else 0.95 * self.stats.loss_ema + 0.05 * lv
