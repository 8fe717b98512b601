"""PNG charts without a plotting library: a small numpy rasteriser, a 5x7 bitmap font, a PNG writer.

Reports need a few plain charts (loss vs tokens, merges over time, per-learner timelines) and the
project may not depend on matplotlib. Everything here draws into an ``[H, W, 3]`` uint8 canvas:
lines are sampled densely along each segment (a vectorised DDA, 2 px wide) after Liang-Barsky
clipping to the plot area, text uses a built-in 5x7 font (rendered upper-case), and
``write_png`` emits a standard PNG (IHDR, one zlib IDAT, IEND, CRC-32 on every chunk).
"""
from __future__ import annotations

import colorsys
import math
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Color = tuple[int, int, int]

WHITE: Color = (255, 255, 255)
INK: Color = (40, 40, 40)
GRID: Color = (228, 228, 228)
PALETTE: tuple[Color, ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))
"""Series colours in order (series i gets ``series_color(i)``)."""
STATE_COLORS: dict[str, Color] = {
    "up": (44, 160, 44), "down": (214, 39, 40), "blocked": (255, 140, 0), "boot": (150, 150, 150)}
"""Timeline bar colours; any other state is drawn in OTHER_STATE_COLOR."""
OTHER_STATE_COLOR: Color = (31, 119, 180)

# 5x7 glyphs, seven rows top to bottom, '#' = ink. Lower-case letters render as upper-case.
_FONT_ROWS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#", "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.", "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####", "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####", "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.", "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#", "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#", "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.", "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#", "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.", "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.", "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.", "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..", "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    ".": "..... ..... ..... ..... ..... .##.. .##..", "-": "..... ..... ..... .###. ..... ..... .....",
    "_": "..... ..... ..... ..... ..... ..... #####", "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.", ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "/": "..... ....# ...#. ..#.. .#... #.... .....", ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...", "=": "..... ..... ##### ..... ##### ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....", " ": "..... ..... ..... ..... ..... ..... .....",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..", "[": ".###. .#... .#... .#... .#... .#... .###.",
    "]": ".###. ...#. ...#. ...#. ...#. ...#. .###.", "<": "...#. ..#.. .#... #.... .#... ..#.. ...#.",
    ">": ".#... ..#.. ...#. ....# ...#. ..#.. .#...", "'": "..#.. ..#.. .#... ..... ..... ..... .....",
    "*": "..... ..#.. #.#.# .###. #.#.# ..#.. .....", "#": ".#.#. .#.#. ##### .#.#. ##### .#.#. .#.#.",
    "|": "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..", "!": "..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#..",
}
GLYPH_W, GLYPH_H = 5, 7
_GLYPHS = {ch: np.array([[c == "#" for c in row] for row in rows.split()], dtype=bool)
           for ch, rows in _FONT_ROWS.items()}


def series_color(i: int) -> Color:
    """Distinct colour of the i-th series (palette first, then golden-ratio hues)."""
    if i < len(PALETTE):
        return PALETTE[i]
    r, g, b = colorsys.hsv_to_rgb((i * 0.618033988749895) % 1.0, 0.75, 0.85)
    return (int(r * 255), int(g * 255), int(b * 255))


# --------------------------------------------------------------------------------------------
# Canvas
# --------------------------------------------------------------------------------------------

def text_mask(text: str, scale: int = 1) -> np.ndarray:
    """Boolean bitmap of ``text`` in the 5x7 font (1 px spacing), each font pixel scale x scale."""
    glyphs = [_GLYPHS.get(ch.upper(), _GLYPHS["?"]) for ch in text]
    if not glyphs:
        return np.zeros((GLYPH_H * scale, 0), dtype=bool)
    gap = np.zeros((GLYPH_H, 1), dtype=bool)
    row = np.concatenate([part for g in glyphs for part in (g, gap)][:-1], axis=1)  # (7, 6n-1)
    return np.kron(row, np.ones((scale, scale), dtype=bool)).astype(bool)


def text_width(text: str, scale: int = 1) -> int:
    """Pixel width of ``text`` rendered by ``text_mask``."""
    return max(0, len(text) * (GLYPH_W + 1) - 1) * scale


class Canvas:
    """An RGB raster with clipped drawing primitives; coordinates are (x right, y down)."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        if width < 16 or height < 16:
            raise ValueError(f"canvas must be at least 16x16, got {width}x{height}")
        self.width, self.height = width, height
        self.rgb = np.empty((height, width, 3), dtype=np.uint8)
        self.rgb[:] = background

    def fill_rect(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        """Fill pixels x0 <= x < x1, y0 <= y < y1 (clipped to the canvas)."""
        xa, xb = sorted((int(round(x0)), int(round(x1))))
        ya, yb = sorted((int(round(y0)), int(round(y1))))
        xa, ya = max(xa, 0), max(ya, 0)
        xb, yb = min(xb, self.width), min(yb, self.height)
        if xa < xb and ya < yb:
            self.rgb[ya:yb, xa:xb] = color

    def outline_rect(self, x0: float, y0: float, x1: float, y1: float, color: Color) -> None:
        """One-pixel frame of the rectangle [x0, x1] x [y0, y1]."""
        self.fill_rect(x0, y0, x1 + 1, y0 + 1, color)
        self.fill_rect(x0, y1, x1 + 1, y1 + 1, color)
        self.fill_rect(x0, y0, x0 + 1, y1 + 1, color)
        self.fill_rect(x1, y0, x1 + 1, y1 + 1, color)

    def _stamp(self, xs: np.ndarray, ys: np.ndarray, offsets: np.ndarray, color: Color,
               clip: tuple[int, int, int, int] | None) -> None:
        """Paint ``offsets`` (K, 2) around every point (xs, ys), inside ``clip`` (x0, y0, x1, y1)."""
        x0, y0, x1, y1 = clip or (0, 0, self.width - 1, self.height - 1)
        px = (np.round(xs).astype(np.int64)[:, None] + offsets[None, :, 0]).ravel()  # (N*K,)
        py = (np.round(ys).astype(np.int64)[:, None] + offsets[None, :, 1]).ravel()  # (N*K,)
        keep = (px >= max(x0, 0)) & (px <= min(x1, self.width - 1))
        keep &= (py >= max(y0, 0)) & (py <= min(y1, self.height - 1))
        self.rgb[py[keep], px[keep]] = color

    def polyline(self, xs: Sequence[float], ys: Sequence[float], color: Color, *, width: int = 2,
                 clip: tuple[int, int, int, int] | None = None) -> None:
        """Join consecutive points; a non-finite coordinate breaks the line there."""
        x = np.asarray(xs, dtype=np.float64)
        y = np.asarray(ys, dtype=np.float64)
        if len(x) < 2:
            return
        ax, ay, bx, by = x[:-1], y[:-1], x[1:], y[1:]
        ok = np.isfinite(ax) & np.isfinite(ay) & np.isfinite(bx) & np.isfinite(by)
        box = clip or (0, 0, self.width - 1, self.height - 1)
        ax, ay, bx, by = clip_segments(ax[ok], ay[ok], bx[ok], by[ok], box)
        if len(ax) == 0:
            return
        dx, dy = bx - ax, by - ay
        n = np.ceil(np.maximum(np.abs(dx), np.abs(dy))).astype(np.int64) + 1  # samples/segment
        seg = np.repeat(np.arange(len(n)), n)  # (S,)
        first = np.repeat(np.cumsum(n) - n, n)  # (S,) index of each sample's segment start
        t = (np.arange(len(seg)) - first) / np.maximum(n - 1, 1)[seg]  # (S,) in [0, 1]
        offsets = np.array([(i, j) for i in range(width) for j in range(width)]) - (width - 1) // 2
        self._stamp(ax[seg] + t * dx[seg], ay[seg] + t * dy[seg], offsets, color, clip)

    def dots(self, xs: Sequence[float], ys: Sequence[float], color: Color, *, radius: int = 3,
             clip: tuple[int, int, int, int] | None = None) -> None:
        """Filled discs at the finite points."""
        x = np.asarray(xs, dtype=np.float64)
        y = np.asarray(ys, dtype=np.float64)
        ok = np.isfinite(x) & np.isfinite(y) & (np.abs(x) < 1e7) & (np.abs(y) < 1e7)
        r = np.arange(-radius, radius + 1)
        offsets = np.array([(i, j) for i in r for j in r if i * i + j * j <= radius * radius + 1])
        self._stamp(x[ok], y[ok], offsets, color, clip)

    def text(self, x: float, y: float, text: str, color: Color = INK, *, scale: int = 1,
             anchor: str = "left", vertical: bool = False) -> None:
        """Draw ``text`` with its top edge at y; anchor left/center/right on x (vertical: reads
        bottom to top, centred on (x, y) when anchor is center)."""
        mask = text_mask(text, scale)
        if vertical:
            mask = np.rot90(mask)  # (w, h): reads bottom to top
        h, w = mask.shape
        left = {"left": x, "center": x - w / 2, "right": x - w}[anchor]
        top = y - h / 2 if (vertical and anchor == "center") else y
        ys, xs = np.nonzero(mask)
        self._stamp(xs + round(left), ys + round(top), np.zeros((1, 2), dtype=np.int64), color, None)


def clip_segments(ax: np.ndarray, ay: np.ndarray, bx: np.ndarray, by: np.ndarray,
                  box: tuple[int, int, int, int]) -> tuple[np.ndarray, ...]:
    """Liang-Barsky: the parts of segments a->b inside ``box`` (x0, y0, x1, y1); others dropped."""
    x0, y0, x1, y1 = box
    dx, dy = bx - ax, by - ay
    t0, t1 = np.zeros_like(ax), np.ones_like(ax)
    keep = np.ones(ax.shape, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        for p, q in ((-dx, ax - x0), (dx, x1 - ax), (-dy, ay - y0), (dy, y1 - ay)):
            keep &= ~((p == 0) & (q < 0))
            r = q / p
            t0 = np.where(p < 0, np.maximum(t0, r), t0)
            t1 = np.where(p > 0, np.minimum(t1, r), t1)
    keep &= t0 <= t1
    t0, t1 = t0[keep], t1[keep]
    ax, ay, dx, dy = ax[keep], ay[keep], dx[keep], dy[keep]
    return ax + t0 * dx, ay + t0 * dy, ax + t1 * dx, ay + t1 * dy


# --------------------------------------------------------------------------------------------
# Axes
# --------------------------------------------------------------------------------------------

def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k steps) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(target, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * 0.999)
    first = math.ceil(lo / step - 1e-9)
    ticks = [k * step for k in range(first, first + target * 3 + 2) if k * step <= hi + step * 1e-9]
    return [0.0 if abs(t) < step * 1e-9 else t for t in ticks]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values for a log axis spanning [lo, hi] (positive): decades, plus 2x and 5x if few."""
    if not (lo > 0 and hi > lo):
        return [lo] if lo > 0 else []
    ticks = [10.0 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]
    inside = [t for t in ticks if lo * 0.999 <= t <= hi * 1.001]
    if len(inside) >= 3:
        return inside
    more = sorted(t * m for t in ticks for m in (1, 2, 5))
    inside = [t for t in more if lo * 0.999 <= t <= hi * 1.001]
    return inside if len(inside) >= 2 else [10.0 ** e for e in nice_ticks(math.log10(lo), math.log10(hi))]


def format_ticks(ticks: Sequence[float]) -> list[str]:
    """Short labels sharing one unit suffix (K, M, G) and as many decimals as the step needs."""
    if not ticks:
        return []
    big = max(abs(t) for t in ticks)
    step = min((abs(b - a) for a, b in zip(ticks, ticks[1:]) if b != a), default=big or 1.0)
    if 0 < big < 1e-3:
        return [f"{t:.2g}" if t else "0" for t in ticks]
    unit, suffix = next(((u, s) for u, s in ((1e9, "G"), (1e6, "M"), (1e3, "K")) if big >= 10 * u),
                        (1.0, ""))
    decimals = min(max(0, -math.floor(math.log10(step / unit) + 1e-9)), 6)
    return [f"{t / unit:.{decimals}f}{suffix}" if t else "0" for t in ticks]


def _span(values: np.ndarray, *, pad: float) -> tuple[float, float]:
    """[min, max] of finite values, padded by a fraction; widened when degenerate or empty."""
    finite = values[np.isfinite(values)]
    if len(finite) == 0:
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    if hi - lo <= 1e-12 * max(abs(lo), abs(hi), 1.0):
        half = abs(lo) * 0.1 if lo != 0 else 1.0
        return lo - half, hi + half
    extra = (hi - lo) * pad
    return lo - extra, hi + extra


@dataclass(frozen=True)
class _Axes:
    """Maps data coordinates to pixels inside the plot rectangle [left, right] x [top, bottom]."""

    left: int
    top: int
    right: int
    bottom: int
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float
    logx: bool = False

    def px(self, xs: np.ndarray) -> np.ndarray:
        x = np.log10(np.where(xs > 0, xs, np.nan)) if self.logx else xs
        return self.left + (x - self.x_lo) / (self.x_hi - self.x_lo) * (self.right - self.left)

    def py(self, ys: np.ndarray) -> np.ndarray:
        return self.bottom - (ys - self.y_lo) / (self.y_hi - self.y_lo) * (self.bottom - self.top)

    @property
    def clip(self) -> tuple[int, int, int, int]:
        return (self.left, self.top, self.right, self.bottom)


def _draw_frame(c: Canvas, ax: _Axes, xticks: list[float], xlabels: list[str],
                yticks: list[float], ylabels: list[str]) -> None:
    """Grid, frame, tick marks and tick labels."""
    for t, label in zip(xticks, xlabels):
        x = float(ax.px(np.array([t]))[0])
        c.fill_rect(x, ax.top, x + 1, ax.bottom, GRID)
        c.fill_rect(x, ax.bottom, x + 1, ax.bottom + 5, INK)
        c.text(x, ax.bottom + 8, label, anchor="center")
    for t, label in zip(yticks, ylabels):
        y = float(ax.py(np.array([t]))[0])
        c.fill_rect(ax.left, y, ax.right, y + 1, GRID)
        c.fill_rect(ax.left - 5, y, ax.left, y + 1, INK)
        c.text(ax.left - 8, y - GLYPH_H // 2, label, anchor="right")
    c.outline_rect(ax.left, ax.top, ax.right, ax.bottom, INK)


def _draw_labels(c: Canvas, ax: _Axes, title: str, xlabel: str, ylabel: str) -> None:
    if title:
        c.text(c.width / 2, 10, title, scale=2, anchor="center")
    if xlabel:
        c.text((ax.left + ax.right) / 2, c.height - 8 - 2 * GLYPH_H, xlabel, scale=2,
               anchor="center")
    if ylabel:
        c.text(10, (ax.top + ax.bottom) / 2, ylabel, scale=2, anchor="center", vertical=True)


def _draw_legend(c: Canvas, ax: _Axes, entries: list[tuple[str, Color, str]]) -> None:
    """Legend box in the plot's top-right corner: (label, colour, style) per entry."""
    entries = [e for e in entries if e[0]]
    if not entries:
        return
    row_h = GLYPH_H + 7
    w = 34 + max(text_width(label) for label, _, _ in entries)
    h = row_h * len(entries) + 6
    corners = [(ax.right - w - 8, ax.top + 8), (ax.right - w - 8, ax.bottom - h - 8),
               (ax.left + 8, ax.top + 8), (ax.left + 8, ax.bottom - h - 8)]

    def covered(corner: tuple[int, int]) -> int:  # data pixels the box would hide
        x, y = max(corner[0], 0), max(corner[1], 0)
        patch = c.rgb[y:y + h + 1, x:x + w + 1].astype(np.int32)
        return int(np.sum(np.any(patch != WHITE, axis=2) & np.any(patch != GRID, axis=2)))

    x0, y0 = min(corners, key=covered)  # first corner wins ties: top-right by default
    c.fill_rect(x0, y0, x0 + w, y0 + h, WHITE)
    c.outline_rect(x0, y0, x0 + w, y0 + h, (170, 170, 170))
    for i, (label, color, style) in enumerate(entries):
        yc = y0 + 4 + i * row_h + row_h // 2
        if "line" in style:
            c.polyline([x0 + 6, x0 + 24], [yc, yc], color)
        if "points" in style or style == "bar":
            c.dots([x0 + 15], [yc], color, radius=3 if style != "bar" else 4)
        c.text(x0 + 30, yc - GLYPH_H // 2, label)


# --------------------------------------------------------------------------------------------
# Charts
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Series:
    """One line of a chart; ``style`` is "line", "points" or "line+points"."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    style: str = "line"
    color: int | None = None
    """Palette index (default: the series' position), so a band can share its line's colour."""
    in_legend: bool = True


def line_chart(path: str | os.PathLike[str], series: Sequence[Series], *, title: str = "",
               xlabel: str = "", ylabel: str = "", logx: bool = False,
               size: tuple[int, int] = (800, 500),
               ylim: tuple[float, float] | None = None) -> None:
    """Write a line/scatter chart of ``series`` to ``path`` (PNG). NaNs break lines and are
    skipped; with ``logx`` non-positive x values are skipped."""
    for s in series:
        if s.style not in ("line", "points", "line+points"):
            raise ValueError(f"series {s.label!r}: unknown style {s.style!r}")
        if len(s.xs) != len(s.ys):
            raise ValueError(f"series {s.label!r}: {len(s.xs)} xs but {len(s.ys)} ys")
    xs = [np.asarray(s.xs, dtype=np.float64).reshape(-1) for s in series]
    ys = [np.asarray(s.ys, dtype=np.float64).reshape(-1) for s in series]
    all_x = np.concatenate(xs) if xs else np.zeros(0)
    all_y = np.concatenate([y[np.isfinite(x)] for x, y in zip(xs, ys)]) if ys else np.zeros(0)
    if logx:
        positive = all_x[np.isfinite(all_x) & (all_x > 0)]
        x_lo, x_hi = (float(positive.min()), float(positive.max())) if len(positive) else (1.0, 10.0)
        if x_hi <= x_lo:
            x_lo, x_hi = x_lo / 10, x_hi * 10
        xticks = log_ticks(x_lo, x_hi)
        xlabels = [f"{t:g}" if t < 1e5 else format_ticks([t])[0] for t in xticks]
        x_lo, x_hi = math.log10(x_lo), math.log10(x_hi)
    else:
        x_lo, x_hi = _span(all_x, pad=0.0)
        xticks = nice_ticks(x_lo, x_hi)
        xlabels = format_ticks(xticks)
    y_lo, y_hi = ylim if ylim is not None else _span(all_y, pad=0.05)
    if not (math.isfinite(y_lo) and math.isfinite(y_hi) and y_hi > y_lo):
        raise ValueError(f"ylim must be finite with low < high, got {ylim}")
    yticks = nice_ticks(y_lo, y_hi)
    ylabels = format_ticks(yticks)

    w, h = size
    c = Canvas(w, h)
    left = 14 + (2 * GLYPH_H + 8 if ylabel else 0) + max([text_width(s) for s in ylabels] + [0])
    top = 2 * GLYPH_H + 22 if title else 16
    bottom = h - (GLYPH_H + 16) - (2 * GLYPH_H + 12 if xlabel else 0)
    right = w - 8 - text_width(xlabels[-1]) // 2 if xlabels else w - 16
    if right - left < 20 or bottom - top < 20:
        raise ValueError(f"size {size} is too small for this chart")
    ax = _Axes(left, top, right, bottom, x_lo, x_hi, y_lo, y_hi, logx)
    _draw_frame(c, ax, xticks, xlabels, yticks, ylabels)
    legend = []
    for i, (s, x, y) in enumerate(zip(series, xs, ys)):
        color = series_color(i if s.color is None else s.color)
        px, py = ax.px(x), ax.py(y)
        if "line" in s.style:
            c.polyline(px, py, color, clip=ax.clip)
        if "points" in s.style or len(x) == 1:
            c.dots(px, py, color, clip=ax.clip)
        if s.in_legend:
            legend.append((s.label, color, s.style if len(x) != 1 else "points"))
    c.outline_rect(ax.left, ax.top, ax.right, ax.bottom, INK)
    _draw_legend(c, ax, legend)
    _draw_labels(c, ax, title, xlabel, ylabel)
    write_png(path, c.rgb)


MARK_COLOR: Color = (200, 0, 0)


def state_color(state: str) -> Color:
    """Colour of a timeline state."""
    return STATE_COLORS.get(state, OTHER_STATE_COLOR)


def timeline_chart(path: str | os.PathLike[str],
                   rows: Sequence[tuple[str, Sequence[tuple[float, float, str]]]], *,
                   title: str = "", xlabel: str = "seconds",
                   size: tuple[int, int] = (800, 400),
                   marks: Sequence[tuple[float, str]] = ()) -> None:
    """Write a Gantt-style chart: one lane per row, a bar per (start, end, state) interval;
    ``marks`` (seconds, short label) are drawn as vertical lines with their label."""
    spans = [(a, b) for _, ivs in rows for a, b, _ in ivs if math.isfinite(a) and math.isfinite(b)]
    x_lo = min([min(a, b) for a, b in spans] + [0.0])
    x_hi = max([max(a, b) for a, b in spans] + [x_lo])
    if x_hi <= x_lo:
        x_hi = x_lo + 1.0
    xticks = nice_ticks(x_lo, x_hi)
    xlabels = format_ticks(xticks)
    states = sorted({s for _, ivs in rows for _, _, s in ivs},
                    key=lambda s: (list(STATE_COLORS).index(s) if s in STATE_COLORS else 99, s))

    w, h = size
    c = Canvas(w, h)
    left = 16 + max([text_width(label) for label, _ in rows] + [0])
    top = (2 * GLYPH_H + 22 if title else 10) + (GLYPH_H + 14 if states else 0)
    bottom = h - (GLYPH_H + 16) - (2 * GLYPH_H + 12 if xlabel else 0)
    right = w - 8 - text_width(xlabels[-1]) // 2 if xlabels else w - 16
    if right - left < 20 or bottom - top < 10:
        raise ValueError(f"size {size} is too small for this chart")
    ax = _Axes(left, top, right, bottom, x_lo, x_hi, 0.0, 1.0)
    _draw_frame(c, ax, xticks, xlabels, [], [])
    lane = (bottom - top) / max(len(rows), 1)
    for i, (label, intervals) in enumerate(rows):
        y0 = top + i * lane
        c.text(left - 8, y0 + lane / 2 - GLYPH_H // 2, label, anchor="right")
        for a, b, state in intervals:
            if not (math.isfinite(a) and math.isfinite(b)):
                continue
            xa, xb = sorted(float(v) for v in ax.px(np.array([a, b])))
            c.fill_rect(xa, y0 + lane * 0.15, max(xb, xa + 1), y0 + lane * 0.85, state_color(state))
    for i, (t, label) in enumerate(marks):
        if not math.isfinite(t) or not x_lo <= t <= x_hi:
            continue
        xm = float(ax.px(np.array([t]))[0])
        c.fill_rect(xm, top, xm + 1, bottom, MARK_COLOR)
        c.text(xm + 2, top + 2 + (i % 4) * (GLYPH_H + 2), label, MARK_COLOR)
    c.outline_rect(ax.left, ax.top, ax.right, ax.bottom, INK)
    x = right
    for state in reversed(states):  # horizontal legend above the plot, right-aligned
        x -= text_width(state) + 6
        c.text(x, top - GLYPH_H - 8, state)
        c.fill_rect(x - 16, top - GLYPH_H - 8, x - 4, top - 8, state_color(state))
        x -= 30
    _draw_labels(c, ax, title, xlabel, "")
    write_png(path, c.rgb)


# --------------------------------------------------------------------------------------------
# PNG
# --------------------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    """length, type, data, CRC-32 of type+data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an 8-bit RGB image [H, W, 3] (filter type 0 on every scanline)."""
    if not isinstance(rgb, np.ndarray) or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an [H, W, 3] array, got {getattr(rgb, 'shape', type(rgb))}")
    if rgb.dtype != np.uint8:
        raise ValueError(f"expected dtype uint8, got {rgb.dtype}")
    h, w, _ = rgb.shape
    if h == 0 or w == 0:
        raise ValueError("image must be at least 1x1")
    raw = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # (H, 1 + 3W): filter byte + RGB row
    raw[:, 1:] = rgb.reshape(h, 3 * w)
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit truecolour, no interlace
    return (PNG_SIGNATURE + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw.tobytes(), 6)) + _chunk(b"IEND", b""))


def write_png(path: str | os.PathLike[str], rgb: np.ndarray) -> None:
    """Write ``rgb`` (uint8 [H, W, 3]) as a PNG file, atomically (temp file, then rename)."""
    data = encode_png(rgb)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
