"""The paper's Table 1 (goodput vs chips and learners) reproduced with ``ddloco.sim.cluster``."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ddloco.sim.cluster import DEFAULT_FAILURES, FailureModel, Scenario, Summary, simulate_seeds

CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
"""Table 1's columns."""

ROWS: tuple[str, ...] = ("DP", "elastic DP", "M=2", "M=4", "M=8", "M=16")
"""Table 1's rows: non-elastic and elastic data-parallel, then Decoupled DiLoCo (K = 1)."""

PAPER_GOODPUT_PCT: dict[str, tuple[float, ...]] = {
    "DP": (72, 57, 38, 27, 18),
    "elastic DP": (88, 80, 69, 58, 40),
    "M=2": (94, 88, 80, 70, 54),
    "M=4": (96, 93, 89, 82, 73),
    "M=8": (98, 96, 94, 88, 80),
    "M=16": (99, 98, 96, 93, 86),
}
"""Goodput (%) in the paper's Table 1 (ALGORITHM.md §9), per row, in column order."""

TOLERANCE_POINTS = 3.0
"""A cell reproduces the paper when |ours − paper| <= this many goodput points."""


def scenario_for(row: str, chips: int) -> Scenario:
    """The scenario of one Table 1 cell (Decoupled DiLoCo rows use the paper's K = 1)."""
    if row == "DP":
        return Scenario(chips=chips, mode="dp")
    if row == "elastic DP":
        return Scenario(chips=chips, mode="elastic")
    if row.startswith("M="):
        return Scenario(chips=chips, mode="diloco", learners=int(row[2:]), quorum=1)
    raise ValueError(f"unknown Table 1 row {row!r}")


@dataclass(frozen=True)
class Cell:
    """One cell: our estimate beside the paper's figure."""

    row: str
    chips: int
    ours: Summary
    paper_pct: float

    @property
    def ours_pct(self) -> float:
        return 100.0 * self.ours.goodput.mean

    @property
    def diff_points(self) -> float:
        return self.ours_pct - self.paper_pct

    @property
    def within_tolerance(self) -> bool:
        return abs(self.diff_points) <= TOLERANCE_POINTS

    def as_dict(self) -> dict[str, object]:
        return {
            "row": self.row, "chips": self.chips,
            "goodput": self.ours.goodput.mean, "goodput_ci95": self.ours.goodput.ci95,
            "uptime": self.ours.uptime.mean, "uptime_ci95": self.ours.uptime.ci95,
            "paper_goodput": self.paper_pct / 100.0, "diff_points": self.diff_points,
            "within_3_points": self.within_tolerance,
            "failures_min_per_seed": self.ours.failures_min,
            "failures_total": self.ours.failures_total,
        }


def build_table(model: FailureModel = FailureModel(), *, seeds: int = 5,
                failures: int = DEFAULT_FAILURES) -> list[Cell]:
    """Every cell of Table 1, row-major, with the same parameter set."""
    return [Cell(row, chips, simulate_seeds(scenario_for(row, chips), model, seeds=seeds,
                                            failures=failures), PAPER_GOODPUT_PCT[row][j])
            for row in ROWS for j, chips in enumerate(CHIPS)]


def _chips_label(chips: int) -> str:
    return f"{chips / 1e6:g}M" if chips >= 1_000_000 else f"{chips // 1000}k"


def _ci(ci95: float) -> str:
    return f" ±{100 * ci95:.1f}" if math.isfinite(ci95) else ""


def format_table(cells: list[Cell]) -> str:
    """Markdown tables: goodput as "ours ±CI (paper, diff)" per cell ("!" marks a cell off by
    more than the tolerance), then uptime."""
    header = "| goodput % ours ±95% CI (paper, diff) | " + " | ".join(
        _chips_label(c) for c in CHIPS) + " |"
    lines = [header, "|---" * (len(CHIPS) + 1) + "|"]
    for row in ROWS:
        row_cells = [c for c in cells if c.row == row]
        parts = [f"{c.ours_pct:.1f}{_ci(c.ours.goodput.ci95)} "
                 f"({c.paper_pct:.0f}, {c.diff_points:+.1f}){'' if c.within_tolerance else ' !'}"
                 for c in row_cells]
        lines.append(f"| {row} | " + " | ".join(parts) + " |")
    lines += ["", "| uptime % | " + " | ".join(_chips_label(c) for c in CHIPS) + " |",
              "|---" * (len(CHIPS) + 1) + "|"]
    for row in ROWS:
        row_cells = [c for c in cells if c.row == row]
        lines.append(f"| {row} | " + " | ".join(f"{100 * c.ours.uptime.mean:.1f}"
                                                 for c in row_cells) + " |")
    return "\n".join(lines)


def plot_table(cells: list[Cell], path: str | os.PathLike[str]) -> None:
    """Goodput vs chips, one line per row (ours) and the paper's points."""
    from ddloco.plots import goodput_plot

    ours = {row: [c.ours_pct for c in cells if c.row == row] for row in ROWS}
    goodput_plot(path, CHIPS, ours, PAPER_GOODPUT_PCT,
                 title="Goodput vs chips: ours (lines) and the paper (dots)")
