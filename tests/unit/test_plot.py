"""PNG charts: valid files (signature, CRCs, decodable IDAT) and pixels where the data is."""
from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from common.plot import (PNG_SIGNATURE, STATE_COLORS, Series, line_chart, series_color,
                         text_mask, timeline_chart, write_png)

pytestmark = pytest.mark.timeout(30)


def decode_png(path: Path) -> np.ndarray:
    """Independent decoder for the files under test: checks the signature and every CRC."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data), "trailing bytes after the last chunk"
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    w, h, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color_type, interlace) == (8, 2, 0)
    raw = zlib.decompress(b"".join(body for k, body in chunks if k == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert not rows[:, 0].any(), "expected filter type 0 on every row"
    return rows[:, 1:].reshape(h, w, 3)


def count_color(img: np.ndarray, color: tuple[int, int, int]) -> int:
    return int(np.all(img == np.array(color, dtype=np.uint8), axis=2).sum())


def test_write_png_round_trips_pixels(tmp_path: Path) -> None:
    rgb = np.random.default_rng(0).integers(0, 256, size=(7, 11, 3), dtype=np.uint8)
    write_png(tmp_path / "x.png", rgb)
    np.testing.assert_array_equal(decode_png(tmp_path / "x.png"), rgb)


def test_write_png_rejects_wrong_shape_or_dtype(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_png(tmp_path / "x.png", np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(ValueError):
        write_png(tmp_path / "x.png", np.zeros((4, 4, 3), dtype=np.float32))


def test_line_chart_has_requested_size_and_draws_series_colour(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    line_chart(path, [Series("", [0, 1, 2, 3], [0.5, 0.5, 0.5, 0.5])],
               title="loss", xlabel="tokens", ylabel="nats", size=(640, 360), ylim=(0, 1))
    img = decode_png(path)
    assert img.shape == (360, 640, 3)
    hits = np.all(img == np.array(series_color(0), dtype=np.uint8), axis=2)
    rows = np.nonzero(hits.any(axis=1))[0]
    assert hits.sum() > 500, "the series line is missing"
    assert 100 < rows.mean() < 260, f"y=0.5 should be near the middle, found rows {rows}"
    assert count_color(img, series_color(1)) == 0


def test_each_series_gets_its_own_colour_and_nan_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "many.png"
    series = [Series(f"s{i}", [0, 1, 2], [i, i + 1, math.nan], style="line+points")
              for i in range(3)]
    series.append(Series("dots", [0.5], [1.0], style="points"))
    line_chart(path, series, logx=False)
    img = decode_png(path)
    colors = {series_color(i) for i in range(12)}
    assert len(colors) == 12
    for i in range(4):
        assert count_color(img, series_color(i)) > 10, f"series {i} not drawn"


def test_empty_constant_and_log_inputs_still_write_valid_pngs(tmp_path: Path) -> None:
    line_chart(tmp_path / "empty.png", [], title="nothing yet")
    line_chart(tmp_path / "empty_series.png", [Series("none", [], [])])
    line_chart(tmp_path / "const.png", [Series("c", [1, 2, 3], [2.0, 2.0, 2.0])])
    line_chart(tmp_path / "one.png", [Series("p", [5.0], [math.nan])], logx=True)
    line_chart(tmp_path / "log.png", [Series("l", [0, 1, 10, 1000], [3, 2, 1, 0.5])], logx=True)
    for name in ("empty", "empty_series", "const", "one", "log"):
        assert decode_png(tmp_path / f"{name}.png").shape == (500, 800, 3)
    assert count_color(decode_png(tmp_path / "empty.png"), series_color(0)) == 0
    assert count_color(decode_png(tmp_path / "const.png"), series_color(0)) > 100


def test_timeline_chart_draws_bars_in_state_colours(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    rows = [("learner-0", [(0.0, 2.0, "boot"), (2.0, 30.0, "up"), (30.0, 35.0, "down")]),
            ("learner-1", [(0.0, 10.0, "up"), (10.0, 20.0, "blocked"), (20.0, 25.0, "rejoin")])]
    timeline_chart(path, rows, title="timeline")
    img = decode_png(path)
    assert img.shape == (400, 800, 3)
    for state in ("up", "down", "blocked", "boot"):
        assert count_color(img, STATE_COLORS[state]) > 50, f"no {state} bar"
    timeline_chart(tmp_path / "empty.png", [])
    assert decode_png(tmp_path / "empty.png").shape == (400, 800, 3)


def test_font_covers_digits_letters_and_punctuation() -> None:
    unknown = text_mask("?")
    for ch in "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcxyz.-_%()/:,=+":
        mask = text_mask(ch)
        assert mask.shape == (7, 5)
        assert mask.any() and not np.array_equal(mask, unknown), f"no glyph for {ch!r}"
    assert text_mask("ab", scale=2).shape == (14, 22)
