"""The PNG plots of the tools: `up --report` (eval loss, merges, learner timeline), `compare`
(eval loss of each system over seeds) and `sim table --plot` (goodput vs chips).

Drawn with matplotlib's object API on the Agg canvas: no pyplot, so no global figure registry
to leak into, no GUI backend, and safe from any thread. matplotlib is imported inside the
functions (about half a second), so importing this module costs a daemon nothing. Each function
writes its PNG atomically (a temporary file, then a rename) and returns the Figure, whose axes
tests can read; nothing else holds a reference to it.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from common.files import atomic_path

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 110
"""Pixels per inch of every PNG (an 8 x 4.5 in figure is 880 x 495 px)."""

STATE_COLORS: dict[str, str] = {"boot": "tab:gray", "up": "tab:green", "blocked": "tab:orange",
                                "down": "tab:red"}
"""Bar colour of each learner state on timeline.png; any other state gets OTHER_STATE_COLOR."""
OTHER_STATE_COLOR = "tab:blue"
MARK_COLOR = "tab:purple"
"""Vertical lines of faults and temporary learners on timeline.png."""

TOKENS_LABEL = "tokens (all learners)"
SECONDS_LABEL = "time since start (s)"


def _figure(width_in: float, height_in: float) -> tuple[Figure, Axes]:
    """A figure on the Agg canvas with one grid-lined axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)
    return fig, ax


def _save(fig: Figure, path: str | os.PathLike[str]) -> Figure:
    """Tight layout, then the PNG at ``path`` (matplotlib records itself in its Software text)."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return fig


def _token_axis(ax: Axes) -> None:
    """x axis in tokens with engineering suffixes (200k, 1.6M)."""
    from matplotlib.ticker import EngFormatter

    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_xlabel(TOKENS_LABEL)


def eval_loss_plot(path: str | os.PathLike[str], curve: Sequence[Mapping[str, Any]], *,
                   task: str = "") -> Figure:
    """eval_loss.png: the global model's held-out loss at each evaluation (``curve``: dicts
    with "tokens" and "loss", as ``report["eval_curve"]``) against tokens trained."""
    fig, ax = _figure(8.0, 4.5)
    ax.plot([e["tokens"] for e in curve], [e["loss"] for e in curve], marker="o", markersize=4,
            label="global model, held-out batches")
    ax.set_title("Eval loss vs tokens" + (f" ({task} task)" if task else ""))
    _token_axis(ax)
    ax.set_ylabel("eval loss (nats)")
    if curve:
        ax.legend(loc="upper right")
    return _save(fig, path)


def merges_plot(path: str | os.PathLike[str], timeline: Sequence[tuple[float, int]]) -> Figure:
    """merges.png: one dot per merge at (seconds since start, fragment); staggered fragments
    show as evenly spaced, shifted rows of dots."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure(8.0, 4.5)
    ax.plot([t for t, _ in timeline], [p for _, p in timeline], linestyle="none", marker="o",
            markersize=3, label="merge")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"Merges over time per fragment ({len(timeline)} merges)")
    ax.set_xlabel(SECONDS_LABEL)
    ax.set_ylabel("fragment")
    return _save(fig, path)


def timeline_plot(path: str | os.PathLike[str],
                  rows: Sequence[tuple[str, Sequence[tuple[float, float, str]]]], *,
                  marks: Sequence[tuple[float, str]] = (),
                  mark_key: Mapping[str, str] | None = None) -> Figure:
    """timeline.png: a lane per learner (first on top), a bar per (start, end, state) interval,
    and each mark (seconds, short label) as a labelled vertical line; ``mark_key`` explains the
    short labels in the legend (label -> meaning; those of ``marks`` are listed)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, ax = _figure(11.0 if marks else 9.0, max(3.0, 1.4 + 0.4 * len(rows)))
    ax.grid(False, axis="y")
    for lane, (_, intervals) in enumerate(rows):
        bars = [(a, b) for a, b, _ in intervals if math.isfinite(a) and math.isfinite(b)]
        colors = [STATE_COLORS.get(s, OTHER_STATE_COLOR) for a, b, s in intervals
                  if math.isfinite(a) and math.isfinite(b)]
        ax.broken_barh([(a, max(b - a, 0.0)) for a, b in bars], (lane - 0.35, 0.7), facecolors=colors)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first learner on top
    for i, (t, label) in enumerate(marks):  # labels above the plot, on two staggered rows
        ax.axvline(t, color=MARK_COLOR, linestyle="--", linewidth=0.9)
        ax.annotate(label, (t, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2 + 10 * (i % 2)),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8, color=MARK_COLOR,
                    annotation_clip=False)
    states = sorted({s for _, ivs in rows for _, _, s in ivs},
                    key=lambda s: (list(STATE_COLORS).index(s) if s in STATE_COLORS else len(STATE_COLORS), s))
    handles: list[Any] = [Patch(color=STATE_COLORS.get(s, OTHER_STATE_COLOR), label=s) for s in states]
    if marks:
        present = dict.fromkeys(label for _, label in marks)
        key = "\n".join(f"{label}  {(mark_key or {}).get(label, '')}".rstrip() for label in present)
        handles.append(Line2D([], [], color=MARK_COLOR, linestyle="--", label="events:\n" + key))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title("Learners: boot / up / blocked / down", pad=26 if marks else 6)
    ax.set_xlabel(SECONDS_LABEL)
    starts = [a for _, ivs in rows for a, _, _ in ivs if math.isfinite(a)]
    if starts:
        ax.set_xlim(left=min(starts + [0.0]))
    return _save(fig, path)


def compare_plot(path: str | os.PathLike[str], summary: Mapping[str, Mapping[str, Any]],
                 title: str) -> Figure:
    """compare.png: mean eval loss vs tokens of each system (a line), and where it ran more
    than one seed the band from the lowest to the highest seed (same colour). ``summary`` is
    ``compare.runner.summarise``'s: per system a "curve" with "tokens", "mean", "min", "max"
    and its "runs". The y range skips the first evaluations' cliff: from the lowest seed to
    the highest mean a quarter into the budget (or the highest final seed, if above)."""
    from matplotlib.patches import Patch

    fig, ax = _figure(9.0, 5.0)
    banded = False
    for i, (system, s) in enumerate(summary.items()):
        c = s["curve"]
        ax.plot(c["tokens"], c["mean"], color=f"C{i}", linewidth=1.8, label=system)
        if len(s["runs"]) > 1:
            ax.fill_between(c["tokens"][1:], c["min"][1:], c["max"][1:], color=f"C{i}", alpha=0.12,
                            linewidth=0)
            banded = True
    if summary:
        lo = min(v for s in summary.values() for v in s["curve"]["min"][1:] or s["curve"]["min"])
        quarter = [s["curve"]["mean"][min(len(s["curve"]["mean"]) - 1, max(1, len(s["curve"]["mean"]) // 4))]
                   for s in summary.values()]
        hi = max(quarter + [s["curve"]["max"][-1] for s in summary.values()])
        pad = 0.05 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, hi + pad)
        handles, _ = ax.get_legend_handles_labels()
        if banded:
            handles.append(Patch(color="0.6", alpha=0.4, label="min–max over seeds"))
        ax.legend(handles=handles, loc="upper right")
    ax.set_title(title)
    _token_axis(ax)
    ax.set_ylabel("eval loss (nats/byte)")
    return _save(fig, path)


def goodput_plot(path: str | os.PathLike[str], chips: Sequence[int], ours: Mapping[str, Sequence[float]],
                 paper: Mapping[str, Sequence[float]], *, title: str) -> Figure:
    """Goodput (%) vs chips on a log axis: a line per row for ours, dots of the same colour for
    the paper's figures."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator

    fig, ax = _figure(9.0, 6.0)
    for i, (row, ys) in enumerate(ours.items()):
        ax.plot(chips, ys, color=f"C{i}", linewidth=1.8, label=row)
        if row in paper:
            ax.plot(chips, paper[row], color=f"C{i}", linestyle="none", marker="o", markersize=6)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(list(chips)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{c / 1e6:g}M" if c >= 1_000_000 else f"{c / 1e3:g}k" for c in chips])
    if chips:
        ax.set_xlim(min(chips) / 1.25, max(chips) * 1.25)
    ax.set_ylim(0.0, 100.0)
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="0.3", label="ours"),
                Line2D([], [], color="0.3", linestyle="none", marker="o", label="paper")]
    ax.legend(handles=handles, loc="lower left", ncol=2)
    ax.set_title(title)
    ax.set_xlabel("chips (log scale)")
    ax.set_ylabel("goodput (%)")
    return _save(fig, path)
