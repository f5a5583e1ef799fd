"""The shared encode path: request planning, crop/scale, incremental rescaling, capture diffs."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import zlib

import pytest
from PIL import Image, ImageChops, ImageDraw

from shinken_sync.daemon import imaging
from shinken_sync.daemon.display.base import DisplayError
from shinken_sync.protocol import ERR_BAD_ARGS


def _noise_image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    rnd = random.Random(seed)
    image = Image.effect_noise(size, 50).convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(40):
        x, y = rnd.randrange(size[0]), rnd.randrange(size[1])
        draw.rectangle((x, y, x + rnd.randrange(5, 80), y + rnd.randrange(5, 40)), fill=(rnd.randrange(256),) * 3)
    return image


def _max_diff(a: Image.Image, b: Image.Image) -> int:
    assert a.size == b.size
    return max(high for _, high in ImageChops.difference(a.convert("RGB"), b.convert("RGB")).getextrema())


# -- plan: scale and region math ---------------------------------------------


def test_plan_downscales_long_edge_and_reports_scale():
    geo = imaging.plan(1920, 1080, max_long_edge=1280).geometry
    assert (geo.out_width, geo.out_height) == (1280, 720)
    assert geo.scale == 1.5 and geo.scaled
    assert geo.box == (0, 0, 1920, 1080)


def test_plan_portrait_scales_by_height():
    geo = imaging.plan(1080, 1920, max_long_edge=960).geometry
    assert (geo.out_width, geo.out_height) == (540, 960)
    assert geo.scale == 2.0


def test_plan_never_upscales():
    geo = imaging.plan(1024, 768, max_long_edge=4000).geometry
    assert (geo.out_width, geo.out_height) == (1024, 768)
    assert geo.scale == 1.0 and not geo.scaled


def test_plan_region_scales_by_its_own_long_edge():
    params = imaging.plan(1920, 1080, "png", 80, max_long_edge=500, region=(100, 200, 1000, 400))
    geo = params.geometry
    assert (geo.x0, geo.y0, geo.width, geo.height) == (100, 200, 1000, 400)
    assert (geo.out_width, geo.out_height) == (500, 200)
    # screen = x0 + image * scale maps the image's far corner to the region's.
    assert geo.x0 + geo.out_width * geo.scale == 1100
    assert geo.y0 + geo.out_height * geo.scale == 600


def test_plan_clips_region_to_screen():
    geo = imaging.plan(800, 600, region=(-50, 500, 200, 300)).geometry
    assert (geo.x0, geo.y0, geo.width, geo.height) == (0, 500, 150, 100)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"format": "gif"},
        {"quality": 0},
        {"quality": 101},
        {"quality": True},
        {"max_long_edge": 4},
        {"max_long_edge": 100.5},
        {"region": (900, 0, 10, 10)},  # entirely off an 800-wide screen
        {"region": (0, 0, 0, 10)},
        {"region": (0, 0, 10)},
    ],
)
def test_plan_rejects_bad_requests_with_bad_args(kwargs):
    with pytest.raises(DisplayError) as info:
        imaging.plan(800, 600, **kwargs)
    assert info.value.kind == ERR_BAD_ARGS


def test_params_are_hashable_cache_keys():
    a = imaging.plan(800, 600, "jpeg", 80, 400)
    b = imaging.plan(800, 600, "jpeg", 80, 400)
    assert a == b and hash(a) == hash(b)
    assert a != imaging.plan(800, 600, "jpeg", 81, 400)


# -- render and incremental rescaling ------------------------------------------


def test_render_crops_and_scales_in_one_pass():
    source = _noise_image((400, 300))
    geo = imaging.plan(400, 300, max_long_edge=100, region=(40, 60, 200, 100)).geometry
    out = imaging.render(source, geo)
    assert out.size == (100, 50)
    expected = source.crop(geo.box).resize((100, 50), imaging.RESAMPLE)
    # Equal inside; at the region's edges the one-pass resize also reads the
    # pixels just outside the region, where a crop would clip the kernel.
    inner = (2, 2, 98, 48)
    assert _max_diff(out.crop(inner), expected.crop(inner)) <= 1


def test_render_unscaled_region_is_a_crop():
    source = _noise_image((400, 300))
    geo = imaging.plan(400, 300, region=(10, 20, 30, 40)).geometry
    assert imaging.render(source, geo).tobytes() == source.crop((10, 20, 40, 60)).tobytes()


@pytest.mark.parametrize(
    ("max_long_edge", "region"),
    [(1280, None), (640, None), (700, (130, 70, 1500, 900))],
)
def test_rescale_rects_equals_a_full_resize(max_long_edge, region):
    size = (1920, 1080)
    before = _noise_image(size, seed=1)
    after = before.copy()
    draw = ImageDraw.Draw(after)
    # Changes in the middle, on the screen's edges and corners, and one sliver.
    changed = [(300, 200, 64, 40), (0, 0, 31, 17), (1900, 1000, 20, 80), (777, 0, 1, 1080), (1000, 500, 3, 2)]
    for x, y, w, h in changed:
        draw.rectangle((x, y, x + w - 1, y + h - 1), fill=(255, 40, 0))
    geo = imaging.plan(*size, max_long_edge=max_long_edge, region=region).geometry
    patched = imaging.render(before, geo).copy()
    imaging.rescale_rects(patched, geo, changed, lambda r: after.crop((r[0], r[1], r[0] + r[2], r[1] + r[3])), size)
    assert _max_diff(patched, imaging.render(after, geo)) <= 1
    # ...and the patching did something: the frame is not the old one any more.
    assert _max_diff(patched, imaging.render(before, geo)) > 50


def test_affected_rect_outside_region_is_none():
    geo = imaging.plan(1000, 1000, max_long_edge=500, region=(0, 0, 500, 500)).geometry
    assert imaging.affected_rect(geo, (800, 800, 10, 10)) is None
    x, y, w, h = imaging.affected_rect(geo, (100, 100, 10, 10))
    # Scale 1: the output rect covers the change plus the kernel's reach.
    assert x <= 100 and y <= 100 and x + w >= 110 and y + h >= 110


# -- capture helpers -------------------------------------------------------------


def _bgrx(image: Image.Image) -> bytearray:
    r, g, b = image.split()
    return bytearray(Image.merge("RGBA", (b, g, r, Image.new("L", image.size, 0))).tobytes())


def test_bgrx_image_swaps_channels_and_cuts_rects():
    source = _noise_image((64, 48))
    raw = _bgrx(source)
    assert imaging.bgrx_image(raw, source.size).tobytes() == source.tobytes()
    cut = imaging.bgrx_image(raw, source.size, (5, 7, 20, 30))
    assert cut.tobytes() == source.crop((5, 7, 25, 37)).tobytes()


def test_changed_rects_finds_every_change():
    size = (300, 200)
    before = _bgrx(_noise_image(size))
    assert imaging.changed_rects(before, bytearray(before), size) == []
    after = bytearray(before)
    for x, y in ((10, 5), (250, 150), (251, 152)):
        offset = (y * size[0] + x) * 4
        after[offset] ^= 0xFF
    rects = imaging.changed_rects(before, after, size)
    assert rects == [(10, 5, 1, 1), (250, 150, 2, 3)]


def test_changed_rects_merges_adjacent_bands():
    size = (100, 100)
    before = _bgrx(Image.new("RGB", size))
    after = _bgrx(Image.new("RGB", size))
    for y in range(10, 40):  # spans bands 0-16, 16-32, 32-48
        after[(y * 100 + 20) * 4 + 1] = 9
    assert imaging.changed_rects(before, after, size) == [(20, 10, 1, 30)]


def test_changed_rects_of_different_sizes_is_the_whole_screen():
    assert imaging.changed_rects(bytearray(16), bytearray(32), (2, 2)) == [(0, 0, 2, 2)]


# -- encode --------------------------------------------------------------------------


def test_encoded_png_is_lossless_and_jpeg_decodes_at_size():
    image = _noise_image((320, 200))
    png = imaging.encoded(image, imaging.plan(320, 200, "png"))
    assert png.format == "png" and (png.width, png.height, png.scale) == (320, 200, 1.0)
    assert Image.open(io.BytesIO(png.data)).convert("RGB").tobytes() == image.tobytes()
    params = imaging.plan(320, 200, "jpeg", 60, max_long_edge=160)
    jpeg = imaging.encoded(imaging.render(image, params.geometry), params)
    decoded = Image.open(io.BytesIO(jpeg.data))
    assert decoded.format == "JPEG" and decoded.size == (160, 100) == (jpeg.width, jpeg.height)
    assert jpeg.scale == 2.0


@pytest.mark.parametrize("format", ["jpeg", "png"])
@pytest.mark.parametrize("size", [(320, 240), (333, 250)])  # the second ends in partial bands
def test_banded_splice_is_byte_identical_to_a_full_encode(format, size):
    before = _noise_image(size, seed=3)
    base = imaging.BANDED[format].encode(before, 75)
    assert base.tobytes() == imaging.encode(before, format, 75)
    after = before.copy()
    draw = ImageDraw.Draw(after)
    changed = [(10, 20, 50, 5), (0, 40, 8, 30), (200, size[1] - 3, 40, 3)]  # incl. the last band
    for x, y, w, h in changed:
        draw.rectangle((x, y, x + w - 1, y + h - 1), fill=(0, 200, 90))
    spliced = base.patched(after, 75, changed).tobytes()
    assert spliced == imaging.encode(after, format, 75)
    decoded = Image.open(io.BytesIO(spliced))
    assert decoded.size == size
    if format == "png":
        assert decoded.convert("RGB").tobytes() == after.tobytes()


def test_splicing_needs_a_restart_marker_between_every_two_rows():
    """A JPEG without restart markers cannot be spliced by rows: recognised as such."""
    image = _noise_image((64, 5 * imaging.BAND_ROWS))
    plain = io.BytesIO()
    image.save(plain, "JPEG", quality=75)
    assert not imaging._restarts_every_row(plain.getvalue(), 5)
    assert imaging._restarts_every_row(imaging.encode(image, "jpeg", 75), 5)
    assert not imaging._restarts_every_row(imaging.encode(image, "jpeg", 75), 6)


def test_a_pillow_that_ignores_restart_markers_is_refused_at_import(tmp_path):
    """Pillow before 10.2 accepts ``restart_marker_rows`` and ignores it: spliced frames would
    decode as garbage, so importing the daemon's imaging fails, naming the version it needs."""
    script = (
        "from PIL import Image\n"
        "save = Image.Image.save\n"
        "def old_save(self, fp, format=None, **params):\n"
        "    params.pop('restart_marker_rows', None)\n"
        "    return save(self, fp, format, **params)\n"
        "Image.Image.save = old_save\n"
        "import shinken_sync.daemon.imaging\n"
    )
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=60)
    assert done.returncode != 0
    assert "ImportError: shinkend's JPEG splicing needs Pillow >= 10.2" in done.stderr


def test_png_is_standard_enough_for_pillow_to_verify():
    data = imaging.encode(_noise_image((50, 40)), "png", 0)
    Image.open(io.BytesIO(data)).verify()  # checks every chunk CRC
    idat_len = int.from_bytes(data[33:37], "big")
    zlib.decompress(data[41 : 41 + idat_len])  # the zlib stream, adler32 included


def test_jpeg_quality_changes_size():
    image = _noise_image((320, 200))
    low = imaging.encode(image, "jpeg", 20)
    high = imaging.encode(image, "jpeg", 95)
    assert len(low) < len(high)
