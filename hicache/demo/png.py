"""A tiny RGB canvas that draws lines, boxes and 3x5 pixel text, and writes itself as a PNG (zlib only).

Enough for the demo's two-panel chart without pulling in a plotting library.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Canvas", "Series", "line_chart"]

Color = tuple[int, int, int]

# 3x5 glyphs, one string of 15 bits per character, row by row.
_FONT: dict[str, str] = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    " ": "000000000000000", ".": "000000000000010", "-": "000000111000000", "%": "101001010100101",
    "/": "001001010100100", "(": "010100100100010", ")": "010001001001010", ":": "000010000010000",
}  # fmt: skip


class Canvas:
    """An RGB image in memory.

    Args:
        width: pixels across.
        height: pixels down.
        background: the fill colour.
    """

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"width/height: expected >= 1, got {width}x{height}")
        self.width = width
        self.height = height
        self._rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def __repr__(self) -> str:
        return f"Canvas({self.width}x{self.height})"

    def pixel(self, x: int, y: int, color: Color) -> None:
        """Set one pixel; pixels outside the canvas are ignored."""
        if 0 <= x < self.width and 0 <= y < self.height:
            self._rows[y][3 * x : 3 * x + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        """The colour of one pixel."""
        r, g, b = self._rows[y][3 * x : 3 * x + 3]
        return (r, g, b)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Draw a straight line (Bresenham), `width` pixels thick."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = width // 2
        while True:
            for ox in range(-half, width - half):
                for oy in range(-half, width - half):
                    self.pixel(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color, *, fill: bool = False) -> None:
        """Draw a rectangle outline, or a filled one."""
        if fill:
            for y in range(min(y0, y1), max(y0, y1) + 1):
                for x in range(min(x0, x1), max(x0, x1) + 1):
                    self.pixel(x, y, color)
            return
        self.line(x0, y0, x1, y0, color)
        self.line(x1, y0, x1, y1, color)
        self.line(x1, y1, x0, y1, color)
        self.line(x0, y1, x0, y0, color)

    def text(self, x: int, y: int, text: str, color: Color, scale: int = 2) -> None:
        """Draw `text` (upper-cased; unknown characters become blanks), top-left corner at `(x, y)`."""
        for i, ch in enumerate(text.upper()):
            glyph = _FONT.get(ch, _FONT[" "])
            for bit, on in enumerate(glyph):
                if on == "1":
                    gx, gy = bit % 3, bit // 3
                    for sx in range(scale):
                        for sy in range(scale):
                            self.pixel(x + i * 4 * scale + gx * scale + sx, y + gy * scale + sy, color)

    def to_png(self) -> bytes:
        """The image as PNG bytes (8-bit RGB, no interlace)."""
        raw = b"".join(b"\x00" + bytes(row) for row in self._rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b"")
        )

    def save(self, path: str | Path) -> None:
        """Write the image as a PNG file."""
        Path(path).write_bytes(self.to_png())


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a chart: points `(x, y)` in data units, a colour and a legend label."""

    label: str
    points: Sequence[tuple[float, float]]
    color: Color


def _ticks(hi: float) -> float:
    """A round tick step that gives about four ticks up to `hi`."""
    if hi <= 0:
        return 1.0
    step = hi / 4
    magnitude = 10 ** len(str(int(step))) / 10 if step >= 1 else 0.1
    for mult in (1, 2, 2.5, 5, 10):
        if step <= mult * magnitude:
            return mult * magnitude
    return 10 * magnitude


def line_chart(
    canvas: Canvas,
    box: tuple[int, int, int, int],
    series: Sequence[Series],
    *,
    title: str,
    x_max: float | None = None,
    y_max: float | None = None,
) -> None:
    """Draw a line chart into `box = (left, top, right, bottom)` of `canvas`, with axes, ticks and a legend.

    Args:
        canvas: where to draw.
        box: the plot area in pixels, axes included.
        series: the lines.
        title: drawn above the plot area.
        x_max: the right end of the x axis (default: the largest x).
        y_max: the top of the y axis (default: the largest y, rounded up to a tick).
    """
    left, top, right, bottom = box
    axis: Color = (60, 60, 60)
    grid: Color = (225, 225, 225)
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    xm = x_max if x_max is not None else (max(xs) if xs else 1.0)
    ym = y_max if y_max is not None else (max(ys) if ys else 1.0)
    xm = xm if xm > 0 else 1.0
    y_step = _ticks(ym)
    ym = max(y_step, y_step * -(-ym // y_step)) if y_max is None else (ym if ym > 0 else 1.0)
    canvas.text(left, top - 18, title, axis)
    tick = y_step if y_max is None else ym / 4
    value = 0.0
    while value <= ym + 1e-9:
        y = bottom - round((value / ym) * (bottom - top))
        canvas.line(left, y, right, y, grid)
        label = f"{value:g}"
        canvas.text(left - 6 - 8 * len(label), y - 5, label, axis)
        value += tick
    x_step = _ticks(xm)
    value = 0.0
    while value <= xm + 1e-9:
        x = left + round((value / xm) * (right - left))
        canvas.line(x, bottom, x, bottom + 4, axis)
        label = f"{value:g}"
        canvas.text(x - 4 * len(label), bottom + 8, label, axis)
        value += x_step
    canvas.line(left, bottom, right, bottom, axis)
    canvas.line(left, top, left, bottom, axis)
    for s in series:
        pts = [
            (left + round((x / xm) * (right - left)), bottom - round((min(y, ym) / ym) * (bottom - top)))
            for x, y in s.points
        ]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            canvas.line(x0, y0, x1, y1, s.color, width=2)
        if len(pts) == 1:
            canvas.rect(pts[0][0] - 1, pts[0][1] - 1, pts[0][0] + 1, pts[0][1] + 1, s.color, fill=True)
    lx = right - 10 - max((len(s.label) for s in series), default=0) * 8 - 20
    for i, s in enumerate(series):
        ly = top + 8 + i * 16
        canvas.rect(lx, ly, lx + 12, ly + 8, s.color, fill=True)
        canvas.text(lx + 18, ly - 1, s.label, axis)
