"""Report, compare and sim plots: PNG files written by matplotlib, with the run's data drawn."""
from __future__ import annotations

import ast
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddloco import plots
from ddloco.report import write_report

pytestmark = pytest.mark.timeout(30)


def png_text(path: Path) -> dict[str, str]:
    """The tEXt entries of a PNG, after checking its signature, every chunk's CRC and the
    IHDR/IDAT/IEND layout (so a truncated or hand-made file fails here)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name}: not a PNG"
    pos, kinds, text = 8, [], {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path.name}: bad CRC in {kind!r}"
        kinds.append(kind)
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            text[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    return text


def assert_matplotlib_png(path: Path) -> None:
    software = png_text(path).get("Software", "")
    assert software.startswith("Matplotlib version"), f"{path.name}: Software is {software!r}"


def png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_plots_module_imports_matplotlib_only_inside_its_functions() -> None:
    tree = ast.parse(Path(plots.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("matplotlib", "pylab")], names
    everywhere = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    everywhere += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert not [m for m in everywhere if "pyplot" in m], "use the Figure API, not pyplot's global state"


def test_eval_loss_plot_draws_every_evaluation_against_tokens(tmp_path: Path) -> None:
    curve = [{"tokens": 0, "loss": 5.5}, {"tokens": 40_960, "loss": 3.1}, {"tokens": 81_920, "loss": 2.4}]
    fig = plots.eval_loss_plot(tmp_path / "eval_loss.png", curve, task="gpt")
    assert_matplotlib_png(tmp_path / "eval_loss.png")
    assert png_size(tmp_path / "eval_loss.png") == (8 * plots.DPI, round(4.5 * plots.DPI))
    (ax,) = fig.axes
    (line,) = ax.lines
    assert list(line.get_xdata()) == [0, 40_960, 81_920] and list(line.get_ydata()) == [5.5, 3.1, 2.4]
    assert line.get_marker() == "o"
    assert ax.get_title() == "Eval loss vs tokens (gpt task)"
    assert "tokens" in ax.get_xlabel() and "nats" in ax.get_ylabel()


def test_merges_plot_has_one_dot_per_merge(tmp_path: Path) -> None:
    timeline = [(1.0, 0), (1.5, 1), (2.0, 2), (2.5, 3), (3.0, 0)]
    fig = plots.merges_plot(tmp_path / "merges.png", timeline)
    assert_matplotlib_png(tmp_path / "merges.png")
    (line,) = fig.axes[0].lines
    assert line.get_linestyle() == "None" and len(line.get_xdata()) == 5
    assert list(line.get_ydata()) == [0, 1, 2, 3, 0]
    assert fig.axes[0].get_title() == "Merges over time per fragment (5 merges)"


def test_timeline_plot_draws_a_lane_per_learner_and_a_labelled_line_per_mark(tmp_path: Path) -> None:
    rows = [("learner-0", [(0.0, 2.0, "boot"), (2.0, 30.0, "up"), (30.0, 35.0, "down")]),
            ("learner-1", [(0.0, 10.0, "up"), (10.0, 20.0, "blocked"), (20.0, 25.0, "rejoin")])]
    marks = [(12.0, "K"), (18.5, "SK"), (22.0, "K")]
    fig = plots.timeline_plot(tmp_path / "timeline.png", rows, marks=marks,
                              mark_key={"K": "learner killed", "SK": "shard killed"})
    assert_matplotlib_png(tmp_path / "timeline.png")
    ax = fig.axes[0]
    assert len(ax.collections) == 2, "one broken_barh per learner"
    from matplotlib.colors import to_rgba
    first = [tuple(c) for c in ax.collections[0].get_facecolors()]
    assert first == [to_rgba(plots.STATE_COLORS[s]) for s in ("boot", "up", "down")]
    assert to_rgba(plots.OTHER_STATE_COLOR) in [tuple(c) for c in ax.collections[1].get_facecolors()]
    mark_lines = [ln for ln in ax.lines if ln.get_color() == plots.MARK_COLOR]
    assert sorted(ln.get_xdata()[0] for ln in mark_lines) == [12.0, 18.5, 22.0]
    assert [t.get_text() for t in ax.texts] == ["K", "SK", "K"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["learner-0", "learner-1"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:4] == ["boot", "up", "blocked", "down"] and "rejoin" in legend
    assert legend[-1] == "events:\nK  learner killed\nSK  shard killed", legend


def test_write_report_writes_report_json_and_three_matplotlib_pngs(tmp_path: Path) -> None:
    report = {"eval_curve": [{"tokens": 0, "loss": 4.0}, {"tokens": 100, "loss": 3.0}],
              "merge_timeline": [(0.5, 0), (0.9, 1)], "config": {"task": {"name": "digits"}}}
    monitor = SimpleNamespace(learner_ids=["learner-0"], samples={"learner-0": [(0.0, "boot"), (1.0, "up")]},
                              marks=[(0.7, "learner_kill", "learner-0"), (0.8, "made_up", "x")])
    write_report(tmp_path / "r", report, monitor)
    assert (tmp_path / "r" / "report.json").exists()
    for name in ("eval_loss.png", "merges.png", "timeline.png"):
        assert_matplotlib_png(tmp_path / "r" / name)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "eval_loss.png", "merges.png", "report.json", "timeline.png"], "temporary files left behind"


def test_compare_plot_draws_a_mean_line_per_system_and_a_band_where_seeds_differ(tmp_path: Path) -> None:
    def system(mean: list[float], spread: float, seeds: int) -> dict:
        return {"curve": {"tokens": [0, 100, 200, 300, 400], "mean": mean,
                          "min": [m - spread for m in mean], "max": [m + spread for m in mean]},
                "runs": [{}] * seeds}
    summary = {"dp": system([5.6, 3.0, 2.6, 2.4, 2.3], 0.05, 3),
               "decoupled": system([5.6, 3.1, 2.7, 2.5, 2.35], 0.08, 3),
               "single": system([5.6, 3.5, 3.2, 3.0, 2.9], 0.0, 1)}
    fig = plots.compare_plot(tmp_path / "compare.png", summary, "Eval loss vs tokens, M=4, 3 seed(s)")
    assert_matplotlib_png(tmp_path / "compare.png")
    ax = fig.axes[0]
    assert [ln.get_label() for ln in ax.lines] == ["dp", "decoupled", "single"]
    assert len(ax.collections) == 2, "a band for each system with more than one seed"
    lo, hi = ax.get_ylim()
    assert lo < 2.25 and 3.2 < hi < 5.0, f"the y range should skip the first evaluation's cliff: {lo, hi}"
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "min–max over seeds"


def test_goodput_plot_draws_ours_as_lines_and_the_paper_as_dots(tmp_path: Path) -> None:
    from ddloco.sim.table import CHIPS, PAPER_GOODPUT_PCT
    ours = {"DP": [70.0, 55.0, 40.0, 25.0, 20.0], "M=2": [93.0, 89.0, 81.0, 69.0, 55.0]}
    fig = plots.goodput_plot(tmp_path / "goodput.png", CHIPS, ours, PAPER_GOODPUT_PCT, title="goodput")
    assert_matplotlib_png(tmp_path / "goodput.png")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_ylim() == (0.0, 100.0)
    dots = [ln for ln in ax.lines if ln.get_linestyle() == "None"]
    assert [list(ln.get_ydata()) for ln in dots] == [list(PAPER_GOODPUT_PCT["DP"]), list(PAPER_GOODPUT_PCT["M=2"])]
    assert len(ax.lines) - len(dots) == 2
