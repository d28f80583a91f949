"""Line plots written as RGB PNGs with the standard library only (no plotting dependency).

`plot_curves(path, curves)` draws axes, numbered ticks, a legend and one polyline per curve;
text uses a built-in 3x5 bitmap font (digits, upper-case letters, a few signs), so labels are
shown in capitals.
"""

import math
import struct
import zlib
from typing import NamedTuple, Optional, Sequence

Color = tuple[int, int, int]
PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
BLACK, GREY, WHITE = (0, 0, 0), (200, 200, 200), (255, 255, 255)

# Each glyph: five rows of three pixels, top row first.
FONT = {
    "0": "111 101 101 101 111", "1": "010 110 010 010 111", "2": "111 001 111 100 111",
    "3": "111 001 111 001 111", "4": "101 101 111 001 001", "5": "111 100 111 001 111",
    "6": "111 100 111 101 111", "7": "111 001 001 010 010", "8": "111 101 111 101 111",
    "9": "111 101 111 001 111", ".": "000 000 000 000 010", "-": "000 000 111 000 000",
    "+": "000 010 111 010 000", "_": "000 000 000 000 111", "/": "001 001 010 100 100",
    "(": "010 100 100 100 010", ")": "010 001 001 001 010", ",": "000 000 000 010 100",
    "A": "010 101 111 101 101", "B": "110 101 110 101 110", "C": "011 100 100 100 011",
    "D": "110 101 101 101 110", "E": "111 100 110 100 111", "F": "111 100 110 100 100",
    "G": "011 100 101 101 011", "H": "101 101 111 101 101", "I": "111 010 010 010 111",
    "J": "001 001 001 101 010", "K": "101 101 110 101 101", "L": "100 100 100 100 111",
    "M": "101 111 111 101 101", "N": "110 101 101 101 101", "O": "010 101 101 101 010",
    "P": "110 101 110 100 100", "Q": "010 101 101 110 011", "R": "110 101 110 101 101",
    "S": "011 100 010 001 110", "T": "111 010 010 010 010", "U": "101 101 101 101 111",
    "V": "101 101 101 101 010", "W": "101 101 111 111 101", "X": "101 101 010 101 101",
    "Y": "101 101 010 010 010", "Z": "111 001 010 100 111",
}
SCALE = 2  # screen pixels per font pixel
CHAR_W, CHAR_H = 4 * SCALE, 5 * SCALE  # advance (glyph + one column of space) and height


class Curve(NamedTuple):
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: Color


class Canvas:
    """An RGB raster; drawing clips silently at the edges."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, color: Color, size: int = 1) -> None:
        for py in range(y, y + size):
            for px in range(x, x + size):
                if 0 <= px < self.width and 0 <= py < self.height:
                    offset = 3 * (py * self.width + px)
                    self.pixels[offset:offset + 3] = bytes(color)

    def line(self, start: tuple[int, int], end: tuple[int, int], color: Color, size: int = 1) -> None:
        (x0, y0), (x1, y1) = start, end
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * s / steps), round(y0 + (y1 - y0) * s / steps), color, size)

    def text(self, x: int, y: int, text: str, color: Color = BLACK) -> None:
        """Top-left corner at (x, y); characters the font lacks are left blank."""
        for index, char in enumerate(text.upper()):
            rows = FONT.get(char, "").split()
            for row, bits in enumerate(rows):
                for column, bit in enumerate(bits):
                    if bit == "1":
                        self.dot(x + index * CHAR_W + column * SCALE, y + row * SCALE, color, SCALE)

    def save(self, path: str) -> None:
        write_png(path, self.width, self.height, bytes(self.pixels))


def write_png(path: str, width: int, height: int, rgb: bytes) -> None:
    """8-bit RGB, every row with filter type 0 (none)."""
    stride = 3 * width
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as handle:
        handle.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                     + chunk(b"IEND", b""))


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Multiples of 1, 2 or 5 x 10^k inside [low, high], about `count` of them."""
    span = (high - low) or abs(high) or 1.0
    magnitude = 10 ** math.floor(math.log10(span / count))
    step = next(m * magnitude for m in (1, 2, 5, 10) if span / (m * magnitude) <= count)
    return [k * step for k in range(math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9) + 1)]


def log_ticks(low: float, high: float) -> list[float]:
    """1, 2 and 5 x 10^k inside [low, high]; linear ticks when fewer than three fit."""
    ticks = [m * 10.0 ** k for k in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5) if low <= m * 10.0 ** k <= high]
    return ticks if len(ticks) >= 3 else nice_ticks(low, high)


def tick_label(value: float) -> str:
    return str(round(value)) if abs(value - round(value)) < 1e-9 else f"{value:.4g}"


class Axes:
    """Maps data to pixels inside the margins; the y axis is logarithmic when `log_y`."""

    LEFT, RIGHT, TOP, BOTTOM = 64, 16, 24, 44
    INSET = 6  # pixels between the data's extremes and the frame, so curves never hide the axes

    def __init__(self, canvas: Canvas, curves: Sequence[Curve], log_y: bool) -> None:
        self.canvas, self.log_y = canvas, log_y
        points = [(x, y) for curve in curves for x, y in zip(curve.xs, curve.ys) if self._usable(y)]
        xs, ys = [x for x, _ in points] or [0.0, 1.0], [y for _, y in points] or [1.0, 2.0]
        self.x_range, self.y_range = (min(xs), max(xs)), (min(ys), max(ys))
        self.left, self.right = self.LEFT, canvas.width - self.RIGHT
        self.top, self.bottom = self.TOP, canvas.height - self.BOTTOM

    def _usable(self, y: float) -> bool:
        return math.isfinite(y) and (y > 0 or not self.log_y)

    def _fraction(self, value: float, low: float, high: float, log: bool) -> float:
        if log:
            value, low, high = math.log(value), math.log(low), math.log(high)
        return (value - low) / ((high - low) or 1.0)

    def pixel(self, x: float, y: float) -> tuple[int, int]:
        fx = self._fraction(x, *self.x_range, log=False)
        fy = self._fraction(y, *self.y_range, log=self.log_y)
        inset = self.INSET
        return (round(self.left + inset + fx * (self.right - self.left - 2 * inset)),
                round(self.bottom - inset - fy * (self.bottom - self.top - 2 * inset)))

    def draw_frame(self, x_label: str, y_label: str) -> None:
        canvas = self.canvas
        for x in nice_ticks(*self.x_range):
            px, _ = self.pixel(x, self.y_range[0])
            canvas.line((px, self.top), (px, self.bottom), GREY)
            label = tick_label(x)
            canvas.text(px - len(label) * CHAR_W // 2, self.bottom + 6, label)
        for y in (log_ticks if self.log_y else nice_ticks)(*self.y_range):
            _, py = self.pixel(self.x_range[0], y)
            canvas.line((self.left, py), (self.right, py), GREY)
            label = tick_label(y)
            canvas.text(self.left - 6 - len(label) * CHAR_W, py - CHAR_H // 2, label)
        canvas.line((self.left, self.top), (self.left, self.bottom), BLACK)
        canvas.line((self.left, self.bottom), (self.right, self.bottom), BLACK)
        canvas.text((self.left + self.right - len(x_label) * CHAR_W) // 2, canvas.height - CHAR_H - 4, x_label)
        canvas.text(4, 6, y_label + (", log scale" if self.log_y else ""))

    def draw_curve(self, curve: Curve) -> None:
        previous: Optional[tuple[int, int]] = None
        for x, y in zip(curve.xs, curve.ys):
            point = self.pixel(x, y) if self._usable(y) else None
            if point and previous:
                self.canvas.line(previous, point, curve.color, size=2)
            previous = point

    def draw_legend(self, curves: Sequence[Curve]) -> None:
        width = max(len(curve.label) for curve in curves) * CHAR_W + 36
        x = self.right - width - 8
        for row, curve in enumerate(curves):
            y = self.top + 8 + row * (CHAR_H + 6)
            self.canvas.line((x, y + CHAR_H // 2), (x + 20, y + CHAR_H // 2), curve.color, size=3)
            self.canvas.text(x + 28, y, curve.label)


def plot_curves(path: str, curves: Sequence[Curve], x_label: str = "iteration", y_label: str = "loss",
                log_y: bool = True, size: tuple[int, int] = (640, 400)) -> None:
    """Write `curves` (at least one) as a PNG at `path`."""
    canvas = Canvas(*size)
    axes = Axes(canvas, curves, log_y)
    axes.draw_frame(x_label, y_label)
    for curve in curves:
        axes.draw_curve(curve)
    axes.draw_legend(curves)
    canvas.save(path)
