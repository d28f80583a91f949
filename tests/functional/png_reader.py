"""A minimal PNG decoder for the tests, written apart from scripts/plot_png.py so that a bug in
the writer cannot hide itself: 8-bit RGB, no interlacing, filter type 0 (what the writer emits)."""

import pathlib
import struct
import zlib
from collections import Counter
from typing import NamedTuple

SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Image(NamedTuple):
    width: int
    height: int
    colors: Counter  # (r, g, b) -> number of pixels


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, position = [], len(SIGNATURE)
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length:position + 12 + length])
        assert crc == zlib.crc32(kind + body), f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        position += 12 + length
    return chunks


def read_png(path: pathlib.Path) -> Image:
    data = path.read_bytes()
    assert data[:8] == SIGNATURE, data[:8]
    chunks = _chunks(data)
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b""), [kind for kind, _ in chunks]
    width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color_type, interlace) == (8, 2, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 1 + 3 * width
    assert len(raw) == height * stride
    rows = [raw[y * stride:(y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows), "only filter type 0 is expected"
    pixels = b"".join(row[1:] for row in rows)
    return Image(width, height, Counter(zip(pixels[0::3], pixels[1::3], pixels[2::3])))
