"""The plots of `ddloco compare --chaos/--hetero` (matplotlib, written next to compare.json):

- ``loss_vs_wall.png``: every system's global eval loss vs wall time (first seed), its hits marked;
- ``goodput.png``: goodput per system, mean and 95 % CI over seeds, the simulator's prediction;
- ``timeline.png``: per system (first seed), who was training when, each fault marked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(report: Path, results: dict[str, list[dict[str, Any]]], systems: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [s for s in systems if results.get(s)]
    colours = {s: plt.get_cmap("tab10")(i) for i, s in enumerate(names)}

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in names:
        r = results[s][0]
        xs, ys = zip(*r["wall_curve"])
        ax.plot(xs, ys, label=s, color=colours[s])
        for f in r["faults"]:
            if f["hit"] and f["kind"] == "learner_kill":
                ax.axvline(f["t"], color=colours[s], alpha=0.12, lw=0.8)
    if names and results[names[0]][0].get("target_loss") is not None:
        ax.axhline(results[names[0]][0]["target_loss"], color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("wall time since the first step (s)")
    ax.set_ylabel("global model eval loss")
    ax.set_title(f"Eval loss vs wall time, seed {results[names[0]][0]['seed']} (faint lines: kills)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report / "loss_vs_wall.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, s in enumerate(names):
        e = systems[s]["goodput"]
        lo, hi = e["ci95"]
        ax.bar(i, e["mean"], color=colours[s], yerr=[[e["mean"] - lo], [hi - e["mean"]]], capsize=4)
        p = systems[s]["goodput_predicted"]["mean"]
        if p is not None:
            ax.plot([i - 0.35, i + 0.35], [p, p], color="black", lw=1.5, label="simulator" if i == 0 else None)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.05)
    ax.set_title("Goodput, mean and 95 % CI over seeds (line: simulator)")
    if names:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report / "goodput.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.0 + 1.1 * len(names)), sharex=True, squeeze=False)
    for ax, s in zip(axes[:, 0], names):
        r = results[s][0]
        lanes = sorted(r["timeline"])
        for row, lid in enumerate(lanes):
            ax.broken_barh([(a, max(0.05, b - a)) for a, b in r["timeline"][lid]], (row - 0.35, 0.7),
                           color=colours[s])
        for f in r["faults"]:
            if f["target"] in lanes:
                ax.plot(f["t"], lanes.index(f["target"]), "x" if f["hit"] else ".", color="red" if f["hit"] else "grey",
                        ms=5)
        ax.set_yticks(range(len(lanes)), [x.replace("learner-", "r") for x in lanes], fontsize=7)
        ax.set_ylabel(s, rotation=0, ha="right", fontsize=8)
    axes[-1, 0].set_xlabel("wall time since the first step (s): bars = training, x = a kill that hit")
    fig.tight_layout()
    fig.savefig(report / "timeline.png", dpi=110)
    plt.close(fig)
