"""The capture-to-bytes encode path shared by every display backend.

A screenshot is planned once (:func:`plan`: region clipping and the
``max_long_edge`` scale), then crop and downscale happen in ONE
``Image.resize(box=...)`` call straight from the full screen image (no crop
copy), then the result is encoded (:func:`encode`).

Downscaling and encoding are the expensive steps (a 1920x1080 -> 1280
bilinear resize costs ~11-17 ms here, the 1280x720 JPEG encode ~4 ms), so
backends keep the previous frame and redo only what a change can reach:
:func:`rescale_rects` recomputes the output pixels of changed screen
rectangles (what a full resize gives, up to float rounding), and :class:`BandedEncoding` re-encodes
only the 16-row bands they touch, JPEG and PNG alike (byte-identical to a full
encode). Xvfb finds its
changed rectangles with :func:`changed_rects`. Measured costs and the reasons
behind each choice: docs/displays.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import math
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from PIL import Image, ImageChops

from shinken_sync.protocol import ERR_BAD_ARGS, IMAGE_FORMATS
from shinken_sync.verbs import DEFAULT_IMAGE_FORMAT, DEFAULT_IMAGE_QUALITY

from .display.base import DisplayError, EncodedImage

#: A separable triangle filter whose support grows with the scale factor, so
#: every source pixel contributes (no aliasing on text); cheaper than bicubic
#: or Lanczos and sharp enough for UI text at 2/3 scale.
RESAMPLE = Image.Resampling.BILINEAR
#: Half-width of RESAMPLE's kernel in output pixels (Pillow's filter support).
_FILTER_SUPPORT = 1.0

MIN_QUALITY = 1
MAX_QUALITY = 100
MIN_LONG_EDGE = 8
#: zlib level 1: a 1280x720 desktop PNG is ~15% bigger than at level 6 and
#: encodes ~3x faster.
PNG_COMPRESS_LEVEL = 1

Rect = tuple[int, int, int, int]  # x, y, w, h

#: The threads screenshots are encoded on (backends without a thread of their
#: own). Nothing a client controls runs here: a call that blocks a thread (a
#: stalled file read) blocks another pool, never every screenshot.
ENCODE_POOL = concurrent.futures.ThreadPoolExecutor(
    max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="shinkend-encode"
)


@dataclass(frozen=True)
class Geometry:
    """Where an encoded image comes from on the screen, and at what scale.

    ``x0, y0, width, height`` is the source rectangle (clipped to the screen);
    ``out_width x out_height`` the image size. ``scale`` maps image to screen
    pixels: ``screen_x = x0 + image_x * scale``.
    """

    x0: int
    y0: int
    width: int
    height: int
    out_width: int
    out_height: int

    @property
    def scale(self) -> float:
        return max(self.width, self.height) / max(self.out_width, self.out_height)

    @property
    def scaled(self) -> bool:
        return (self.out_width, self.out_height) != (self.width, self.height)

    @property
    def box(self) -> tuple[int, int, int, int]:
        return (self.x0, self.y0, self.x0 + self.width, self.y0 + self.height)


@dataclass(frozen=True)
class EncodeParams:
    """A validated screenshot request; hashable, so it can key a frame cache."""

    format: str
    quality: int
    geometry: Geometry


def plan(
    screen_width: int,
    screen_height: int,
    format: str = DEFAULT_IMAGE_FORMAT,
    quality: int = DEFAULT_IMAGE_QUALITY,
    max_long_edge: int | None = None,
    region: Iterable[int] | None = None,
) -> EncodeParams:
    """Validate a screenshot request against the screen.

    ``region`` (x, y, w, h) is clipped to the screen; a region with no pixel on
    the screen is refused. ``max_long_edge`` never upscales. Raises
    :class:`DisplayError` with kind ``bad_args``.
    """
    if format not in IMAGE_FORMATS:
        raise DisplayError(f"format must be one of {sorted(IMAGE_FORMATS)}, not {format!r}", ERR_BAD_ARGS)
    if not _is_int(quality) or not MIN_QUALITY <= quality <= MAX_QUALITY:
        raise DisplayError(f"quality must be an integer in {MIN_QUALITY}..{MAX_QUALITY}", ERR_BAD_ARGS)
    if region is None:
        x0, y0, width, height = 0, 0, screen_width, screen_height
    else:
        parts = tuple(region)
        if len(parts) != 4 or not all(_is_int(v) for v in parts) or parts[2] <= 0 or parts[3] <= 0:
            raise DisplayError("region must be [x, y, w, h] with positive integer w and h", ERR_BAD_ARGS)
        rx, ry, rw, rh = parts
        x0, y0 = max(rx, 0), max(ry, 0)
        width, height = min(rx + rw, screen_width) - x0, min(ry + rh, screen_height) - y0
        if width <= 0 or height <= 0:
            raise DisplayError(f"region {list(parts)} lies outside the screen", ERR_BAD_ARGS)
    out_width, out_height = width, height
    if max_long_edge is not None:
        if not _is_int(max_long_edge) or max_long_edge < MIN_LONG_EDGE:
            raise DisplayError(f"max_long_edge must be an integer >= {MIN_LONG_EDGE}", ERR_BAD_ARGS)
        long_edge = max(width, height)
        if long_edge > max_long_edge:
            factor = long_edge / max_long_edge
            out_width = max(1, round(width / factor))
            out_height = max(1, round(height / factor))
    return EncodeParams(format, int(quality), Geometry(x0, y0, width, height, out_width, out_height))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def render(source: Image.Image, geometry: Geometry) -> Image.Image:
    """Crop and scale ``source`` (the full screen) to ``geometry`` in one pass."""
    if not geometry.scaled:
        if geometry.box == (0, 0, source.width, source.height):
            return source
        return source.crop(geometry.box)
    return source.resize((geometry.out_width, geometry.out_height), RESAMPLE, box=geometry.box)


def affected_rect(geometry: Geometry, rect: Rect) -> Rect | None:
    """The output pixels a change of screen ``rect`` can reach, or None."""
    sx = geometry.width / geometry.out_width
    sy = geometry.height / geometry.out_height
    # A kernel reaches _FILTER_SUPPORT output pixels (times the scale in source
    # pixels) either side; one more pixel covers rounding of the kernel bounds.
    x, y, w, h = rect
    ox0 = math.floor((x - geometry.x0) / sx - _FILTER_SUPPORT) - 1
    oy0 = math.floor((y - geometry.y0) / sy - _FILTER_SUPPORT) - 1
    ox1 = math.ceil((x + w - geometry.x0) / sx + _FILTER_SUPPORT) + 1
    oy1 = math.ceil((y + h - geometry.y0) / sy + _FILTER_SUPPORT) + 1
    ox0, oy0 = max(ox0, 0), max(oy0, 0)
    ox1, oy1 = min(ox1, geometry.out_width), min(oy1, geometry.out_height)
    if ox0 >= ox1 or oy0 >= oy1:
        return None
    return (ox0, oy0, ox1 - ox0, oy1 - oy0)


def source_window(geometry: Geometry, out_rect: Rect, screen_size: tuple[int, int]) -> Rect:
    """The screen pixels :func:`rescale_rects` must supply for ``out_rect``:
    the box it maps to plus the kernel's reach, clipped to the screen."""
    sx = geometry.width / geometry.out_width
    sy = geometry.height / geometry.out_height
    ox, oy, ow, oh = out_rect
    margin_x = math.ceil(_FILTER_SUPPORT * sx) + 2
    margin_y = math.ceil(_FILTER_SUPPORT * sy) + 2
    x0 = max(math.floor(geometry.x0 + ox * sx) - margin_x, 0)
    y0 = max(math.floor(geometry.y0 + oy * sy) - margin_y, 0)
    x1 = min(math.ceil(geometry.x0 + (ox + ow) * sx) + margin_x, screen_size[0])
    y1 = min(math.ceil(geometry.y0 + (oy + oh) * sy) + margin_y, screen_size[1])
    return (x0, y0, x1 - x0, y1 - y0)


def rescale_rects(
    target: Image.Image,
    geometry: Geometry,
    dirty: Iterable[Rect],
    paint: Callable[[Rect], Image.Image],
    screen_size: tuple[int, int],
) -> list[Rect]:
    """Recompute, in place, the pixels of the scaled ``target`` that the screen
    rectangles ``dirty`` can reach; returns the output rectangles it rewrote.

    ``paint(rect)`` returns the current screen pixels of ``rect`` (a crop of a
    capture, or a freshly drawn patch). Each patch carries the filter's full
    reach around its box and is resized with a fractional ``box``, so Pillow
    computes the same kernels as for the whole frame: the pixels equal a full
    resize exactly at scales like 1.5, 2 or 3, and within 1/255 on a few pixels
    at others (the kernel centres are then computed along another float path).
    Each patch is recomputed from the source, so nothing accumulates.
    """
    sx = geometry.width / geometry.out_width
    sy = geometry.height / geometry.out_height
    rewritten = []
    for rect in dirty:
        out = affected_rect(geometry, rect)
        if out is None:
            continue
        rewritten.append(out)
        window = source_window(geometry, out, screen_size)
        patch = paint(window)
        ox, oy, ow, oh = out
        box = (
            geometry.x0 + ox * sx - window[0],
            geometry.y0 + oy * sy - window[1],
            geometry.x0 + (ox + ow) * sx - window[0],
            geometry.y0 + (oy + oh) * sy - window[1],
        )
        target.paste(patch.resize((ow, oh), RESAMPLE, box=box), (ox, oy))
    return rewritten


#: Captured frames are compared in bands of this many rows: small enough that a
#: typed character dirties ~16 rows, big enough that a 1080p compare is ~70
#: in-place memcmp calls (~0.8 ms here).
DIFF_BAND_ROWS = 16


def bgrx_image(raw: bytes | bytearray, size: tuple[int, int], rect: Rect | None = None) -> Image.Image:
    """An RGB image of a BGRX capture (mss's layout), or of its ``rect``; one
    converting pass, no intermediate copy."""
    if rect is None:
        return Image.frombuffer("RGB", size, raw, "raw", "BGRX", 0, 1)
    x, y, w, h = rect
    stride = size[0] * 4
    start = y * stride + x * 4
    rows = memoryview(raw)[start : start + (h - 1) * stride + w * 4]
    # The ignores below: Pillow annotates frombuffer's data as bytes/bytearray, but it takes any
    # buffer; a memoryview slice here spares a copy.
    return Image.frombuffer("RGB", (w, h), rows, "raw", "BGRX", stride, 1)  # type: ignore[arg-type]


def changed_rects(before: bytes | bytearray, after: bytes | bytearray, size: tuple[int, int]) -> list[Rect]:
    """Rectangles covering every pixel that differs between two same-sized
    4-byte-per-pixel captures: runs of changed row bands, each narrowed to the
    columns that changed."""
    width, height = size
    if len(before) != len(after) or len(after) != width * height * 4:
        return [(0, 0, width, height)]
    stride = width * 4
    view = memoryview(before)
    runs: list[list[int]] = []
    for y0 in range(0, height, DIFF_BAND_ROWS):
        y1 = min(y0 + DIFF_BAND_ROWS, height)
        # startswith(view, offset) is a memcmp in place: no slice copies.
        if not after.startswith(view[y0 * stride : y1 * stride], y0 * stride):
            if runs and runs[-1][1] == y0:
                runs[-1][1] = y1
            else:
                runs.append([y0, y1])
    rects = []
    for y0, y1 in runs:
        band = (width, y1 - y0)
        # Views of the captures, as in bgrx_image (Pillow's annotation omits memoryview).
        a = Image.frombuffer("RGBX", band, view[y0 * stride : y1 * stride], "raw", "RGBX", 0, 1)  # type: ignore[arg-type]
        b = Image.frombuffer("RGBX", band, memoryview(after)[y0 * stride : y1 * stride], "raw", "RGBX", 0, 1)  # type: ignore[arg-type]
        bbox = ImageChops.difference(a, b).getbbox(alpha_only=False)
        assert bbox is not None  # the band's bytes differ (every byte counts, X too), so some pixel does
        x0, by0, x1, by1 = bbox
        rects.append((x0, y0 + by0, x1 - x0, by1 - by0))
    return rects


def encode(image: Image.Image, format: str, quality: int) -> bytes:
    """Encode an RGB image (``quality`` is ignored for PNG); see :class:`JpegRows`
    and :class:`PngBands` for the formats' settings."""
    if format == "jpeg":
        return _jpeg(image, quality)
    return PngBands.encode(image, quality).tobytes()


#: Encodings are cut into bands of this many pixel rows: a JPEG MCU row at 4:2:0.
BAND_ROWS = 16


#: One band of a BandedEncoding, as the subclass stores it.
_Band = TypeVar("_Band")


@dataclass(frozen=True)
class BandedEncoding(Generic[_Band]):
    """An encoded image cut into independent 16-row bands.

    A frame that differs from an encoded one in a few bands is encoded by
    re-encoding those bands as one strip and splicing them in; the result is
    byte-identical to encoding the whole frame (tested). Subclasses say how a
    strip becomes bands and how bands become a file.
    """

    size: tuple[int, int]
    bands: tuple[_Band, ...]
    header: bytes = b""

    @classmethod
    def encode(cls, image: Image.Image, quality: int) -> BandedEncoding[_Band]:
        raise NotImplementedError

    @classmethod
    def _strip_bands(cls, strip: Image.Image, quality: int) -> list[_Band]:
        raise NotImplementedError

    def tobytes(self) -> bytes:
        raise NotImplementedError

    def patched(self, image: Image.Image, quality: int, changed: Iterable[Rect]) -> BandedEncoding[_Band]:
        """This encoding after ``image`` (same size) changed within ``changed``."""
        bands = list(self.bands)
        for first, last in _band_runs(changed):
            strip = image.crop((0, first * BAND_ROWS, image.width, min(image.height, (last + 1) * BAND_ROWS)))
            bands[first : last + 1] = self._strip_bands(strip, quality)
        return dataclasses.replace(self, bands=tuple(bands))


def _band_runs(rects: Iterable[Rect]) -> list[tuple[int, int]]:
    """The bands ``rects`` touch, as merged (first, last) runs."""
    spans = sorted((y // BAND_ROWS, (y + h - 1) // BAND_ROWS) for _, y, _, h in rects if h > 0)
    runs: list[list[int]] = []
    for first, last in spans:
        if runs and first <= runs[-1][1] + 1:
            runs[-1][1] = max(runs[-1][1], last)
        else:
            runs.append([first, last])
    return [(first, last) for first, last in runs]


_RST = re.compile(rb"\xff[\xd0-\xd7]")
_SOS = b"\xff\xda"
_EOI = b"\xff\xd9"


def _jpeg(image: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality, subsampling="4:2:0", optimize=False, restart_marker_rows=1)
    return buf.getvalue()


def _restarts_every_row(data: bytes, rows: int) -> bool:
    """Whether a JPEG of ``rows`` MCU rows has a restart marker between every two rows: the
    property splicing needs. Pillow before 10.2 accepts ``restart_marker_rows`` and ignores it."""
    sos = data.find(_SOS)
    return sos >= 0 and len(_RST.findall(data, sos)) == rows - 1


# Checked at import: without restart markers a spliced frame would decode as garbage below its
# first re-encoded band, so the daemon refuses to start instead (tox env oldest runs the floor).
if not _restarts_every_row(_jpeg(Image.new("RGB", (16, 2 * BAND_ROWS)), 75), 2):
    import PIL

    raise ImportError(f"shinkend's JPEG splicing needs Pillow >= 10.2 (JPEG restart markers); "
                      f"this is Pillow {PIL.__version__}")


def _split_jpeg(data: bytes) -> tuple[bytes, tuple[bytes, ...]]:
    sos = data.index(_SOS)
    start = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    return data[:start], tuple(_RST.split(data[start : data.rindex(_EOI)]))


class JpegRows(BandedEncoding[bytes]):
    """Baseline JPEG, 4:2:0, the standard Huffman tables, a restart marker after
    every MCU row (+0.25% bytes). Each row's entropy-coded segment restarts DC
    prediction and is byte-aligned, so it depends only on the row's pixels.
    The optimize pass (per-image Huffman tables) would make frames ~11% smaller
    but takes 2x the time and rules out splicing."""

    @classmethod
    def encode(cls, image: Image.Image, quality: int) -> JpegRows:
        header, rows = _split_jpeg(_jpeg(image, quality))
        return cls(image.size, rows, header)

    @classmethod
    def _strip_bands(cls, strip: Image.Image, quality: int) -> list[bytes]:
        return list(_split_jpeg(_jpeg(strip, quality))[1])

    def tobytes(self) -> bytes:
        parts = [self.header]
        for index, row in enumerate(self.bands[:-1]):
            parts += (row, bytes((0xFF, 0xD0 + index % 8)))
        parts += (self.bands[-1], _EOI)
        return b"".join(parts)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: zlib header for deflate with a 32 KiB window, "fastest" level flag.
_ZLIB_HEADER = b"\x78\x01"
#: A final, empty, fixed-Huffman deflate block: ends the stream after the bands.
_DEFLATE_END = b"\x03\x00"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _adler32_combine(adler1: int, adler2: int, len2: int) -> int:
    """zlib's adler32_combine: the checksum of A+B from those of A and B."""
    base = 65521
    rem = len2 % base
    sum1 = adler1 & 0xFFFF
    sum2 = (rem * sum1) % base
    sum1 = (sum1 + (adler2 & 0xFFFF) + base - 1) % base
    sum2 = (sum2 + (adler1 >> 16) + (adler2 >> 16) + base - rem) % base
    return sum1 | (sum2 << 16)


class PngBands(BandedEncoding[tuple[bytes, int, int]]):
    """8-bit RGB PNG whose zlib stream is one independently deflated segment per
    band (zlib level 1, filter None, a sync flush ending each), the way pigz
    parallelises gzip. Here it is 2.5% bigger than Pillow's level-1 PNG and
    ~2x faster to encode whole (Pillow tries every row filter), and a changed
    band costs ~1 ms. ``bands`` holds (segment, adler32 of its raw rows, raw length)."""

    @classmethod
    def encode(cls, image: Image.Image, quality: int = 0) -> PngBands:
        return cls(image.size, tuple(cls._strip_bands(image, quality)))

    @classmethod
    def _strip_bands(cls, strip: Image.Image, quality: int) -> list[tuple[bytes, int, int]]:
        data = strip.convert("RGB").tobytes() if strip.mode != "RGB" else strip.tobytes()
        stride = strip.width * 3
        bands = []
        for top in range(0, strip.height, BAND_ROWS):
            raw = b"".join(
                b"\x00" + data[row : row + stride]
                for row in range(top * stride, min(strip.height, top + BAND_ROWS) * stride, stride)
            )
            deflate = zlib.compressobj(PNG_COMPRESS_LEVEL, zlib.DEFLATED, -15)
            bands.append((deflate.compress(raw) + deflate.flush(zlib.Z_SYNC_FLUSH), zlib.adler32(raw), len(raw)))
        return bands

    def tobytes(self) -> bytes:
        adler = 1
        for _, band_adler, length in self.bands:
            adler = _adler32_combine(adler, band_adler, length)
        idat = b"".join([_ZLIB_HEADER, *(segment for segment, _, _ in self.bands), _DEFLATE_END,
                         struct.pack(">I", adler)])  # fmt: skip
        width, height = self.size
        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit truecolour
        return b"".join(
            [_PNG_SIGNATURE, _png_chunk(b"IHDR", ihdr), _png_chunk(b"IDAT", idat), _png_chunk(b"IEND", b"")]
        )


#: The banded encoding of each image format.
BANDED: dict[str, type[BandedEncoding[Any]]] = {"jpeg": JpegRows, "png": PngBands}


def encoded(image: Image.Image, params: EncodeParams, *, pointer: bool = False) -> EncodedImage:
    """Encode an image already rendered to ``params.geometry``."""
    return described(encode(image, params.format, params.quality), params, pointer=pointer)


def described(data: bytes, params: EncodeParams, *, pointer: bool = False) -> EncodedImage:
    """Encoded bytes of ``params.geometry`` with the metadata that maps them to the screen;
    ``pointer``: the pixels show the mouse pointer (where it lies inside them)."""
    geo = params.geometry
    return EncodedImage(
        data=data,
        format=params.format,
        width=geo.out_width,
        height=geo.out_height,
        scale=geo.scale,
        x0=geo.x0,
        y0=geo.y0,
        pointer=pointer,
    )
