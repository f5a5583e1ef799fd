"""An in-process framebuffer desktop, drawn with Pillow, that really reacts to input.

The desktop is a small immutable model (:class:`DesktopState`): cursor, three
toggle buttons, a counter, a checkbox, a slider, a focused text field with a
submit history, a scrollable list, and a draggable "Notes" window. Input verbs
replace the state; nothing is drawn until a screenshot asks for pixels, so a
display costs a few hundred bytes and 1024 of them fit one process.

Pixels come from a :class:`_Scene`, shared by every display of the same
(size, seed): the static desktop (wallpaper, photo viewer, icons, panel
chrome) drawn once, and the initial frame and its encoding made once per
screenshot geometry and format. A screenshot starts from those and redoes
only the widgets whose state differs from the initial state: repaint, rescale,
re-encode the 16-row bands they touch (see :mod:`shinken_sync.daemon.imaging`).
Typing a character costs a 640x40 patch and a few bands, not a 1920x1080
resize and a full encode.

Layout: module constant :data:`WIDGETS` and ``docs/displays.md``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import random
import re
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

from PIL import Image, ImageDraw, ImageFilter, ImageFont

from shinken_sync.protocol import ERR_BAD_ARGS
from shinken_sync.verbs import DEFAULT_IMAGE_FORMAT, DEFAULT_IMAGE_QUALITY

from .. import imaging
from .base import Display, DisplayError, EncodedImage
from .keys import parse_combo

Rect = tuple[int, int, int, int]  # x, y, w, h

MIN_SIZE = (1024, 768)
MAX_SIZE = (7680, 4320)

# ---------------------------------------------------------------------------
# Layout (absolute screen pixels; identical for every screen size >= MIN_SIZE)

TOPBAR_HEIGHT = 28
TASKBAR_HEIGHT = 40
APP_WINDOW: Rect = (40, 60, 720, 680)
NOTES_SIZE = (640, 400)
NOTES_DEFAULT_POS = (800, 60)
TITLE_HEIGHT = 32
PHOTO_WINDOW: Rect = (800, 540, 560, 420)

#: Every interactive widget by name: its rectangle (x, y, w, h) on the screen.
WIDGETS: dict[str, Rect] = {
    "toggle_wifi": (64, 112, 150, 40),
    "toggle_bluetooth": (230, 112, 150, 40),
    "toggle_dark": (396, 112, 150, 40),
    "counter_minus": (64, 172, 40, 40),
    "counter_value": (112, 172, 100, 40),
    "counter_plus": (220, 172, 40, 40),
    "counter_reset": (276, 172, 96, 40),
    "checkbox": (400, 176, 200, 32),
    "slider": (64, 236, 480, 32),
    "text_field": (64, 292, 640, 40),
    "history": (64, 340, 640, 100),
    "list": (64, 456, 400, 264),
    "details": (480, 456, 256, 232),
    "status": (480, 696, 256, 24),
}
TOGGLES = ("toggle_wifi", "toggle_bluetooth", "toggle_dark")
TOGGLE_LABELS = ("Wi-Fi", "Bluetooth", "Dark mode")

LIST_ITEMS = 200
LIST_ROW_HEIGHT = 24
LIST_VISIBLE_ROWS = WIDGETS["list"][3] // LIST_ROW_HEIGHT  # 11
HISTORY_LINES = 4
NOTES_LINES = 80
NOTES_LINE_HEIGHT = 22
NOTES_VISIBLE_LINES = (NOTES_SIZE[1] - TITLE_HEIGHT - 16) // NOTES_LINE_HEIGHT  # 16
#: Wheel clicks move the list and the notes this many rows, like X toolkits.
SCROLL_ROWS_PER_CLICK = 3
SLIDER_STEP_PER_CLICK = 5
SLIDER_HANDLE = 24
#: The text field keeps at most this many characters (an HTML-style maxlength:
#: the overflow is dropped, as a real field would).
MAX_TEXT_CHARS = 512
CURSOR_SIZE = (14, 22)
#: Characters of the last event the status strip shows.
STATUS_CHARS = 34
ICON_ROWS = 3

# ---------------------------------------------------------------------------
# Model


@dataclass(frozen=True)
class DesktopState:
    """Everything that can change on the virtual desktop; hashable, and the
    display's :meth:`~VirtualDisplay.change_token`."""

    cursor: tuple[int, int]
    toggles: tuple[bool, bool, bool] = (False, False, False)
    count: int = 0
    checked: bool = False
    slider: int = 40  # 0..100
    text: str = ""
    text_selected: bool = False  # ctrl+a selected the whole field
    history: tuple[str, ...] = ()
    focus: str = "text_field"  # "text_field" | "list"
    list_top: int = 0
    list_selected: int | None = None
    notes_pos: tuple[int, int] = NOTES_DEFAULT_POS
    notes_top: int = 0
    last_event: str = "ready"


def widget_at(x: int, y: int) -> str | None:
    """The widget under screen point (x, y), if any (ignores the Notes window)."""
    for name, rect in WIDGETS.items():
        if _inside(rect, x, y):
            return name
    return None


def _inside(rect: Rect, x: int, y: int) -> bool:
    rx, ry, rw, rh = rect
    return rx <= x < rx + rw and ry <= y < ry + rh


def _intersects(a: Rect, b: Rect) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def notes_rect(state: DesktopState) -> Rect:
    return (*state.notes_pos, *NOTES_SIZE)


def slider_value_at(x: int) -> int:
    sx, _, sw, _ = WIDGETS["slider"]
    travel = sw - SLIDER_HANDLE
    return max(0, min(100, round((x - sx - SLIDER_HANDLE / 2) * 100 / travel)))


def list_row_at(state: DesktopState, y: int) -> int:
    return min(state.list_top + (y - WIDGETS["list"][1]) // LIST_ROW_HEIGHT, LIST_ITEMS - 1)


# ---------------------------------------------------------------------------
# Fonts and seeded content


@functools.cache
def _font(size: int, style: str = "") -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    # DejaVu covers Latin, Greek, Cyrillic, arrows and many symbols; CJK falls
    # back to boxes. Pillow's bundled font keeps the desktop working without it.
    name = {"": "DejaVuSans", "bold": "DejaVuSans-Bold", "mono": "DejaVuSansMono"}[style]
    try:
        return ImageFont.truetype(f"/usr/share/fonts/truetype/dejavu/{name}.ttf", size)
    except OSError:
        return ImageFont.load_default(size)


@functools.lru_cache(maxsize=4096)
def _glyph_mask(text: str, size: int, style: str) -> tuple[Image.Image, tuple[int, int]]:
    """The anti-aliased coverage of ``text`` and its offset from the text origin.

    Rasterising is most of a widget's cost (~0.3-0.7 ms a line here) and most
    lines repeat from frame to frame ("Counter: 0"), so masks are cached
    process-wide; drawing one is a blend through the mask, as draw.text does.
    """
    font = _font(size, style)
    # Pillow annotates a FreeType bbox as floats (a fractional stroke width makes them so);
    # with no stroke it is whole pixels, and int() keeps the values.
    x0, y0, x1, y1 = (int(v) for v in font.getbbox(text))
    mask = Image.new("L", (max(1, x1 - x0), max(1, y1 - y0)), 0)
    ImageDraw.Draw(mask).text((-x0, -y0), text, fill=255, font=font)
    return mask, (x0, y0)


_WORDS = (
    "agent", "sandbox", "rollout", "screen", "token", "policy", "reward", "episode", "latency",
    "frame", "cursor", "window", "display", "buffer", "encode", "stream", "replay", "batch",
    "worker", "shard", "session", "trace", "metric", "budget", "deadline", "retry", "backoff",
    "queue", "socket", "handshake", "protocol", "verb", "widget", "render", "pixel",
)
_FILES = ("report", "invoice", "notes", "budget", "draft", "photo", "backup", "config", "trace", "slides")
_EXTS = ("pdf", "txt", "png", "csv", "json", "docx", "tar.gz", "md")


@functools.lru_cache(maxsize=8)
def list_items(seed: int) -> tuple[str, ...]:
    rnd = random.Random(seed * 7919 + 1)
    return tuple(
        f"{rnd.choice(_FILES)}_{i + 1:03d}.{rnd.choice(_EXTS)}"
        for i in range(LIST_ITEMS)
    )


def _sentence(rnd: random.Random, words: int) -> str:
    text = " ".join(rnd.choice(_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


# ---------------------------------------------------------------------------
# Drawing


#: An RGB colour (its components, as Pillow takes them).
Color = tuple[int, ...]


class _Canvas:
    """ImageDraw on a patch whose top-left is screen point (ox, oy), so widget
    painters use screen coordinates whatever patch they draw into."""

    def __init__(self, image: Image.Image, ox: int, oy: int):
        self.image = image
        self.draw = ImageDraw.Draw(image)
        self.ox, self.oy = ox, oy

    def rect(self, rect: Rect, fill: Color | None = None, outline: Color | None = None, width: int = 1,
             radius: int = 0) -> None:
        x, y, w, h = rect
        box = (x - self.ox, y - self.oy, x - self.ox + w - 1, y - self.oy + h - 1)
        if radius:
            self.draw.rounded_rectangle(box, radius, fill=fill, outline=outline, width=width)
        else:
            self.draw.rectangle(box, fill=fill, outline=outline, width=width)

    def text(self, x: int, y: int, text: str, fill: Color, size: int = 15, style: str = "") -> None:
        mask, (dx, dy) = _glyph_mask(text, size, style)
        self.draw.bitmap((x - self.ox + dx, y - self.oy + dy), mask, fill=fill)

    def polygon(self, points: list[tuple[int, int]], fill: Color, outline: Color | None = None) -> None:
        self.draw.polygon([(x - self.ox, y - self.oy) for x, y in points], fill=fill, outline=outline)

    def paste(self, image: Image.Image, x: int, y: int) -> None:
        self.image.paste(image, (x - self.ox, y - self.oy))


_INK = (32, 36, 44)
_MUTED = (110, 116, 128)
_ACCENT = (46, 110, 220)
_PANEL = (246, 247, 250)
_FIELD = (255, 255, 255)
_BORDER = (196, 200, 210)


def _paint_toggle(c: _Canvas, state: DesktopState, index: int) -> None:
    rect = WIDGETS[TOGGLES[index]]
    on = state.toggles[index]
    c.rect(rect, fill=_ACCENT if on else (226, 229, 236), outline=_BORDER, radius=8)
    x, y, _, _ = rect
    c.text(x + 14, y + 10, f"{TOGGLE_LABELS[index]}: {'ON' if on else 'OFF'}", (255, 255, 255) if on else _INK)


def _paint_button(c: _Canvas, name: str, label: str) -> None:
    rect = WIDGETS[name]
    c.rect(rect, fill=(232, 235, 241), outline=_BORDER, radius=6)
    c.text(rect[0] + (rect[2] - 9 * len(label)) // 2, rect[1] + 10, label, _INK, 16, "bold")


def _paint_counter(c: _Canvas, state: DesktopState) -> None:
    rect = WIDGETS["counter_value"]
    c.rect(rect, fill=_FIELD, outline=_BORDER)
    c.text(rect[0] + 12, rect[1] + 9, f"{state.count:d}", _INK, 18, "bold")


def _paint_checkbox(c: _Canvas, state: DesktopState) -> None:
    x, y, _, _ = WIDGETS["checkbox"]
    c.rect((x + 4, y + 4, 24, 24), fill=_ACCENT if state.checked else _FIELD, outline=_MUTED, width=2, radius=4)
    if state.checked:
        c.polygon([(x + 9, y + 16), (x + 14, y + 22), (x + 24, y + 9), (x + 22, y + 7), (x + 14, y + 18),
                   (x + 11, y + 14)], fill=(255, 255, 255))
    c.text(x + 38, y + 7, "Enable sync", _INK)


def _paint_slider(c: _Canvas, state: DesktopState) -> None:
    x, y, w, h = WIDGETS["slider"]
    c.rect((x, y + h // 2 - 3, w, 6), fill=(210, 214, 222), radius=3)
    hx = x + round(state.slider * (w - SLIDER_HANDLE) / 100)
    c.rect((x, y + h // 2 - 3, hx - x + SLIDER_HANDLE // 2, 6), fill=_ACCENT, radius=3)
    c.rect((hx, y + 4, SLIDER_HANDLE, SLIDER_HANDLE), fill=(255, 255, 255), outline=_ACCENT, width=2, radius=12)


def _paint_text_field(c: _Canvas, state: DesktopState) -> None:
    rect = WIDGETS["text_field"]
    focused = state.focus == "text_field"
    c.rect(rect, fill=_FIELD, outline=_ACCENT if focused else _BORDER, width=2 if focused else 1, radius=4)
    x, y, w, _ = rect
    font = _font(16)
    if not state.text:
        c.text(x + 12, y + 10, "Type a message and press Enter", (160, 164, 172), 16)
        shown, advance = "", 0.0
    else:
        # Show the tail that fits, as a single-line field scrolled to its caret.
        shown = state.text
        while font.getlength(shown) > w - 28 and len(shown) > 1:
            shown = shown[max(1, len(shown) // 8):]
        advance = font.getlength(shown)
        if state.text_selected:
            c.rect((x + 11, y + 8, int(advance) + 2, 24), fill=(180, 208, 250))
        c.text(x + 12, y + 10, shown, _INK, 16)
    if focused:
        c.rect((x + 13 + int(advance), y + 8, 2, 24), fill=_INK)


def _paint_history(c: _Canvas, state: DesktopState) -> None:
    x, y, _, _ = WIDGETS["history"]
    if not state.history:
        c.text(x + 4, y + 4, "No messages sent yet.", _MUTED, 14)
    for i, line in enumerate(state.history):
        c.text(x + 4, y + 4 + 24 * i, f"\u203a {line}", _INK, 14)


def _paint_list(c: _Canvas, state: DesktopState, items: tuple[str, ...]) -> None:
    rect = WIDGETS["list"]
    x, y, w, h = rect
    c.rect(rect, fill=_FIELD, outline=_ACCENT if state.focus == "list" else _BORDER)
    for row in range(LIST_VISIBLE_ROWS):
        index = state.list_top + row
        if index >= LIST_ITEMS:
            break
        ry = y + row * LIST_ROW_HEIGHT
        if index == state.list_selected:
            c.rect((x + 1, ry, w - 10, LIST_ROW_HEIGHT), fill=_ACCENT)
            ink = (255, 255, 255)
        else:
            ink = _INK
        c.text(x + 8, ry + 4, items[index], ink, 13)
    # Scrollbar thumb.
    span = LIST_ITEMS - LIST_VISIBLE_ROWS
    thumb = max(24, h * LIST_VISIBLE_ROWS // LIST_ITEMS)
    ty = y + (h - thumb) * state.list_top // span
    c.rect((x + w - 8, ty, 6, thumb), fill=(170, 176, 188), radius=3)


def _paint_details(c: _Canvas, state: DesktopState, items: tuple[str, ...]) -> None:
    rect = WIDGETS["details"]
    c.rect(rect, fill=(250, 250, 252), outline=_BORDER)
    x, y, _, _ = rect
    selected = "none" if state.list_selected is None else items[state.list_selected]
    lines = [
        ("Details", "bold"),
        (f"Selected: {selected}", ""),
        (f"Counter: {state.count}", ""),
        (f"Slider: {state.slider}%", ""),
        (f"Sync: {'on' if state.checked else 'off'}", ""),
        (f"Focus: {state.focus.replace('_', ' ')}", ""),
    ]
    for i, (line, style) in enumerate(lines):
        c.text(x + 12, y + 10 + 26 * i, line, _INK, 14, style)


def _paint_status(c: _Canvas, state: DesktopState) -> None:
    # Its own strip (not a details line), so the feedback every action gives
    # dirties two JPEG MCU rows, not the whole panel.
    rect = WIDGETS["status"]
    c.rect(rect, fill=(236, 239, 245), outline=_BORDER)
    c.text(rect[0] + 8, rect[1] + 5, state.last_event[:STATUS_CHARS], _MUTED, 12, "mono")


def _paint_notes(c: _Canvas, state: DesktopState, scene: _Scene) -> None:
    nx, ny = state.notes_pos
    c.paste(scene.notes_chrome, nx, ny)
    top = state.notes_top * NOTES_LINE_HEIGHT
    view = scene.notes_content.crop((0, top, scene.notes_content.width, top + NOTES_VISIBLE_LINES * NOTES_LINE_HEIGHT))
    c.paste(view, nx + 12, ny + TITLE_HEIGHT + 8)


def _paint_cursor(c: _Canvas, state: DesktopState) -> None:
    x, y = state.cursor
    arrow = [(0, 0), (0, 17), (4, 13), (7, 20), (10, 19), (7, 12), (12, 12)]
    c.polygon([(x + dx, y + dy) for dx, dy in arrow], fill=(0, 0, 0), outline=(255, 255, 255))


class _Item(NamedTuple):
    """One entry of the display list: what a screen rectangle shows, keyed by
    the state it depends on; equal keys mean equal pixels."""

    name: str
    rect: Rect
    key: Hashable
    paint: Callable[[_Canvas], None]


def _display_list(state: DesktopState, scene: _Scene) -> list[_Item]:
    """The dynamic content of the screen, bottom to top, over the static base."""
    s, items = state, scene.items
    widget_items = [
        *(
            _Item(TOGGLES[i], WIDGETS[TOGGLES[i]], s.toggles[i], functools.partial(_paint_toggle, state=s, index=i))
            for i in range(3)
        ),
        _Item("counter_value", WIDGETS["counter_value"], s.count, functools.partial(_paint_counter, state=s)),
        _Item("checkbox", WIDGETS["checkbox"], s.checked, functools.partial(_paint_checkbox, state=s)),
        _Item("slider", WIDGETS["slider"], s.slider, functools.partial(_paint_slider, state=s)),
        _Item(
            "text_field",
            WIDGETS["text_field"],
            (s.text, s.text_selected, s.focus == "text_field"),
            functools.partial(_paint_text_field, state=s),
        ),
        _Item("history", WIDGETS["history"], s.history, functools.partial(_paint_history, state=s)),
        _Item(
            "list",
            WIDGETS["list"],
            (s.list_top, s.list_selected, s.focus == "list"),
            functools.partial(_paint_list, state=s, items=items),
        ),
        _Item(
            "details",
            WIDGETS["details"],
            (s.list_selected, s.count, s.slider, s.checked, s.focus),
            functools.partial(_paint_details, state=s, items=items),
        ),
        _Item("status", WIDGETS["status"], s.last_event[:STATUS_CHARS], functools.partial(_paint_status, state=s)),
    ]
    return [
        *widget_items,
        _Item("notes", notes_rect(s), s.notes_top, functools.partial(_paint_notes, state=s, scene=scene)),
        _Item("cursor", (*s.cursor, *CURSOR_SIZE), None, functools.partial(_paint_cursor, state=s)),
    ]


def _dirty_rects(before: list[_Item], after: list[_Item]) -> list[Rect]:
    """Screen rectangles whose pixels may differ between two display lists."""
    rects = []
    for old, new in zip(before, after):
        if (old.rect, old.key) != (new.rect, new.key):
            rects.append(new.rect)
            if old.rect != new.rect:
                rects.append(old.rect)
    return rects


# ---------------------------------------------------------------------------
# The shared scene: static pixels per (size, seed)


class _Scene:
    """Pixels shared by every display of one (width, height, seed)."""

    def __init__(self, width: int, height: int, seed: int):
        self.key = ("virtual", width, height, seed)
        self.size = (width, height)
        self.items = list_items(seed)
        self.base = _draw_base(width, height, seed)
        self.notes_chrome, self.notes_content = _draw_notes(seed)
        self.initial = DesktopState(cursor=(width // 2, height // 2))
        self.initial_list = _display_list(self.initial, self)
        self._derived: collections.OrderedDict[Hashable, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def paint(self, state: DesktopState, rect: Rect, display_list: list[_Item] | None = None) -> Image.Image:
        """The screen pixels of ``rect`` in ``state``: a base crop with every
        display-list item that reaches into it drawn on top."""
        x, y, w, h = rect
        patch = self.base.crop((x, y, x + w, y + h))
        canvas = _Canvas(patch, x, y)
        for item in display_list if display_list is not None else _display_list(state, self):
            if _intersects(item.rect, rect):
                item.paint(canvas)
        return patch

    def _cached(self, key: Hashable, build: Callable[[], object]) -> object:
        with self._lock:
            value = self._derived.get(key)
            if value is not None:
                self._derived.move_to_end(key)
                return value
        value = build()  # outside the lock; two threads may both build, both correct
        with self._lock:
            self._derived[key] = value
            while len(self._derived) > _DERIVED_PER_SCENE:
                self._derived.popitem(last=False)
        return value

    def initial_frame(self, geometry: imaging.Geometry) -> Image.Image:
        """The initial state's frame at ``geometry`` (whole screen), shared and read-only."""

        def build() -> Image.Image:
            full = self.paint(self.initial, (0, 0, *self.size), self.initial_list)
            return imaging.render(full, geometry)

        return self._cached(("frame", geometry), build)  # type: ignore[return-value]

    def initial_encoding(self, params: imaging.EncodeParams) -> imaging.BandedEncoding[Any]:
        """The initial frame encoded as ``params`` ask, in bands, shared."""
        return self._cached(  # type: ignore[return-value]
            ("encoding", params),
            lambda: imaging.BANDED[params.format].encode(self.initial_frame(params.geometry), params.quality),
        )

    def frame(self, state: DesktopState, geometry: imaging.Geometry) -> tuple[Image.Image, list[Rect] | None]:
        """The frame of ``state`` at ``geometry``, and the image rectangles where
        it may differ from the initial frame (None for a region: not tracked)."""
        display_list = _display_list(state, self)
        if geometry.box != (0, 0, *self.size):
            return self.paint(state, (geometry.x0, geometry.y0, geometry.width, geometry.height), display_list), None
        frame = self.initial_frame(geometry).copy()
        dirty = [r for r in map(self._on_screen, _dirty_rects(self.initial_list, display_list)) if r]
        if geometry.scaled:
            changed = imaging.rescale_rects(
                frame, geometry, dirty, lambda rect: self.paint(state, rect, display_list), self.size
            )
        else:
            changed = dirty
            for rect in dirty:
                frame.paste(self.paint(state, rect, display_list), rect[:2])
        return frame, changed

    def _on_screen(self, rect: Rect) -> Rect | None:
        x, y, w, h = rect
        x0, y0 = max(x, 0), max(y, 0)
        x1, y1 = min(x + w, self.size[0]), min(y + h, self.size[1])
        return (x0, y0, x1 - x0, y1 - y0) if x0 < x1 and y0 < y1 else None


#: Initial frames (one per screenshot geometry) and their encodings (per
#: geometry, format and quality) kept per scene.
_DERIVED_PER_SCENE = 12
#: Scenes kept alive; each holds ~12 MB at 1920x1080.
_MAX_SCENES = 4
_scenes: collections.OrderedDict[tuple[int, int, int], _Scene] = collections.OrderedDict()
_scenes_lock = threading.Lock()


def _scene(width: int, height: int, seed: int) -> _Scene:
    key = (width, height, seed)
    with _scenes_lock:
        scene = _scenes.get(key)
        if scene is None:
            scene = _scenes[key] = _Scene(width, height, seed)
        _scenes.move_to_end(key)
        while len(_scenes) > _MAX_SCENES:
            _scenes.popitem(last=False)
        return scene


def _gradient(size: tuple[int, int], top: tuple[int, int, int], bottom: tuple[int, int, int]) -> Image.Image:
    ramp = Image.linear_gradient("L").resize(size)
    return Image.merge(
        "RGB", [ramp.point(lambda v, a=a, b=b: a + (b - a) * v // 255) for a, b in zip(top, bottom)]
    )


def _draw_base(width: int, height: int, seed: int) -> Image.Image:
    rnd = random.Random(seed)
    hue = rnd.randrange(3)
    top, bottom = [((28, 52, 96), (86, 38, 92)), ((20, 70, 80), (30, 40, 70)), ((70, 40, 60), (20, 50, 90))][hue]
    image = _gradient((width, height), top, bottom)
    # Soft light blobs: drawn small and blurred, then scaled up (cheap bokeh).
    blobs = Image.new("RGB", (width // 8, height // 8), (0, 0, 0))
    bd = ImageDraw.Draw(blobs)
    for _ in range(14):
        cx, cy, r = rnd.randrange(width // 8), rnd.randrange(height // 8), rnd.randrange(6, 30)
        bd.ellipse((cx - r, cy - r, cx + r, cy + r), fill=tuple(rnd.randrange(30, 90) for _ in range(3)))
    blobs = blobs.filter(ImageFilter.GaussianBlur(6)).resize((width, height), Image.Resampling.BILINEAR)
    image = Image.blend(blobs, image, 0.8)
    c = _Canvas(image, 0, 0)

    # Top bar and taskbar.
    c.rect((0, 0, width, TOPBAR_HEIGHT), fill=(22, 24, 30))
    for i, label in enumerate(("Activities", "Files", "Edit", "View", "Help")):
        c.text(14 + 96 * i, 5, label, (220, 222, 228), 14, "bold" if i == 0 else "")
    c.text(width // 2 - 60, 5, "Tue 14 Mar  09:41", (220, 222, 228), 14)
    c.text(width - 80, 5, "\u26a1 87%", (200, 204, 212), 13)
    c.rect((0, height - TASKBAR_HEIGHT, width, TASKBAR_HEIGHT), fill=(30, 32, 40))
    for i, label in enumerate(("Terminal", "Browser", "Mail", "Editor", "Photos", "Settings")):
        c.rect((12 + 130 * i, height - 34, 120, 28), fill=(52, 56, 68), radius=6)
        c.text(28 + 130 * i, height - 29, label, (225, 228, 235), 14)

    _draw_icons(c, width, height, rnd)
    _draw_photo(image, rnd)
    _draw_app_chrome(c)
    return image


def _draw_window_frame(c: _Canvas, rect: Rect, title: str) -> None:
    x, y, w, h = rect
    c.rect((x + 4, y + 6, w, h), fill=(12, 14, 20), radius=10)  # shadow
    c.rect(rect, fill=_PANEL, outline=(120, 124, 134), radius=8)
    c.rect((x, y, w, TITLE_HEIGHT), fill=(58, 62, 74), radius=8)
    c.rect((x, y + TITLE_HEIGHT - 8, w, 8), fill=(58, 62, 74))
    c.text(x + 14, y + 7, title, (240, 242, 246), 15, "bold")
    for i, color in enumerate(((236, 95, 85), (245, 190, 70), (96, 200, 90))):
        c.rect((x + w - 78 + 22 * i, y + 9, 14, 14), fill=color, radius=7)


def _draw_app_chrome(c: _Canvas) -> None:
    _draw_window_frame(c, APP_WINDOW, "Control Panel \u2014 shinken virtual desktop")
    for name, label in (("counter_minus", "\u2212"), ("counter_plus", "+"), ("counter_reset", "Reset")):
        _paint_button(c, name, label)
    x, y, _, _ = WIDGETS["slider"]
    c.text(x + 492, y + 7, "Volume", _MUTED, 14)
    c.text(64, 438, "Files", _MUTED, 13, "bold")


def _draw_icons(c: _Canvas, width: int, height: int, rnd: random.Random) -> None:
    cols, cell = 3, 120
    x0 = width - cols * cell - 20
    if x0 < NOTES_DEFAULT_POS[0] + NOTES_SIZE[0]:
        return  # no room beside the windows on small screens
    names = ("Documents", "Downloads", "Music", "Pictures", "Videos", "Projects", "Trash", "Notes.txt",
             "budget.xlsx", "backup.tar", "README.md", "Scripts", "Archive", "Inbox", "Drafts", "Shared",
             "photo_01.jpg", "photo_02.jpg", "run.sh", "todo.md", "data.csv", "logs", "Games", "Office")
    rows = (height - TOPBAR_HEIGHT - TASKBAR_HEIGHT - 40) // cell
    for i in range(min(ICON_ROWS, rows) * cols):
        x, y = x0 + (i % cols) * cell + 23, TOPBAR_HEIGHT + 32 + (i // cols) * cell
        color = tuple(rnd.randrange(60, 230) for _ in range(3))
        label = names[i]
        c.rect((x, y, 64, 64), fill=color, radius=14)
        c.text(x + 21, y + 16, label[0].upper(), (255, 255, 255), 26, "bold")
        c.text(x + 32 - 4 * len(label), y + 70, label, (245, 246, 250), 13)


def _draw_photo(image: Image.Image, rnd: random.Random) -> None:
    """A photo viewer with a procedural landscape: gradients, shapes and grain,
    so the frame carries photo-like (high-entropy) content."""
    c = _Canvas(image, 0, 0)
    _draw_window_frame(c, PHOTO_WINDOW, "Photos \u2014 lake.jpg")
    x, y, w, h = PHOTO_WINDOW
    pw, ph = w - 16, h - TITLE_HEIGHT - 16
    photo = _gradient((pw, ph), (90, 150, 220), (250, 200, 150))
    pd = ImageDraw.Draw(photo)
    pd.ellipse((pw * 0.65, ph * 0.12, pw * 0.65 + 60, ph * 0.12 + 60), fill=(255, 236, 180))
    for layer in range(3):
        base = ph * (0.45 + 0.12 * layer)
        points = [(0, ph)] + [(px, base - rnd.randrange(20, 110 - 25 * layer)) for px in range(0, pw + 40, 40)]
        shade = 60 + 40 * layer
        pd.polygon(points + [(pw, ph)], fill=(shade // 2, shade, shade // 2 + 30))
    water = _gradient((pw, ph // 4), (60, 110, 160), (20, 50, 90))
    photo.paste(water, (0, ph - ph // 4))
    grain = Image.effect_noise((pw, ph), 28).convert("RGB")
    photo = Image.blend(photo, grain, 0.08).filter(ImageFilter.SMOOTH)
    image.paste(photo, (x + 8, y + TITLE_HEIGHT + 8))


def _draw_notes(seed: int) -> tuple[Image.Image, Image.Image]:
    """The Notes window's chrome (without content) and its full scrollable content."""
    w, h = NOTES_SIZE
    chrome = Image.new("RGB", (w, h), _PANEL)
    _draw_window_frame(_Canvas(chrome, 0, 0), (0, 0, w, h), "Notes \u2014 rollout-plan.md")
    content = Image.new("RGB", (w - 24, NOTES_LINES * NOTES_LINE_HEIGHT), _FIELD)
    chrome.paste(_FIELD, (12, TITLE_HEIGHT + 8, w - 12, h - 8))
    c = _Canvas(content, 0, 0)
    rnd = random.Random(seed * 31 + 7)
    for i in range(NOTES_LINES):
        y = i * NOTES_LINE_HEIGHT + 2
        if i % 16 == 0:
            c.text(4, y, f"## {i // 16 + 1}. {_sentence(rnd, 3)[:-1]}", _ACCENT, 15, "bold")
        elif i % 16 in (1, 4, 6, 8, 11, 12, 13, 15):
            continue  # paragraph breaks
        elif i % 16 in (9, 10, 11):
            c.text(20, y, f"sb.{rnd.choice(_WORDS)}(x={rnd.randint(0, 1919)}, y={rnd.randint(0, 1079)})  "
                          f"# {rnd.choice(_WORDS)}", (120, 60, 140), 13, "mono")
        else:
            c.text(4, y, _sentence(rnd, rnd.randint(3, 9)), _INK, 14)
    return chrome, content


# ---------------------------------------------------------------------------
# Shared frame cache


class SharedFrameCache:
    """Encoded frames shared by every display of a process, LRU by bytes.

    Keyed by (scene, state, encode params): displays in the same visual state
    share one encode, and concurrent requests for one key wait for a single
    encode ("unchanged frames encoded once"). Thread-safe; encodes run on
    ``imaging.ENCODE_POOL``.
    """

    def __init__(self, max_bytes: int = 64 * 2**20):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._frames: collections.OrderedDict[Hashable, EncodedImage] = collections.OrderedDict()
        self._pending: dict[Hashable, concurrent.futures.Future[EncodedImage]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._frames)

    async def get_or_encode(self, key: Hashable, encode: Callable[[], EncodedImage]) -> EncodedImage:
        """The cached frame for ``key``, or ``encode()`` run once in a thread.

        The encode's own thread publishes the result, so a waiter cancelled
        mid-encode never cancels the frame for the others waiting on it.
        """
        with self._lock:
            frame = self._frames.get(key)
            if frame is not None:
                self._frames.move_to_end(key)
                self.hits += 1
                return frame
            future = self._pending.get(key)
            owner = future is None
            if owner:
                future = self._pending[key] = concurrent.futures.Future()
                self.misses += 1
            else:
                self.hits += 1
        assert future is not None  # pending already, or made above
        if owner:
            asyncio.get_running_loop().run_in_executor(imaging.ENCODE_POOL, self._produce, key, encode, future)
        return await asyncio.wrap_future(future)

    def _produce(self, key: Hashable, encode: Callable[[], EncodedImage],
                 future: concurrent.futures.Future[EncodedImage]) -> None:
        try:
            frame = encode()
        except Exception as exc:  # noqa: BLE001 - handed to every waiter, who re-raises it
            with self._lock:
                del self._pending[key]
            future.set_exception(exc)
            return
        with self._lock:
            del self._pending[key]
            size = len(frame.data)
            if size <= self.max_bytes:
                self._frames[key] = frame
                self.bytes += size
                while self.bytes > self.max_bytes:
                    _, old = self._frames.popitem(last=False)
                    self.bytes -= len(old.data)
        future.set_result(frame)


#: A lone display caches its last few frames: repeated screenshots of an
#: unchanged screen cost a dictionary lookup.
DEFAULT_PRIVATE_CACHE_BYTES = 4 * 2**20


# ---------------------------------------------------------------------------
# The display


class VirtualDisplay(Display):
    """An in-process desktop; see the module docstring and docs/displays.md."""

    kind = "virtual"

    def __init__(self, width: int, height: int, *, seed: int = 0, shared_cache: SharedFrameCache | None = None):
        if not (MIN_SIZE[0] <= width <= MAX_SIZE[0] and MIN_SIZE[1] <= height <= MAX_SIZE[1]):
            raise ValueError(
                f"virtual display size {width}x{height} outside {MIN_SIZE[0]}x{MIN_SIZE[1]}.."
                f"{MAX_SIZE[0]}x{MAX_SIZE[1]}"
            )
        self.width, self.height, self.seed = width, height, seed
        self._cache = shared_cache if shared_cache is not None else SharedFrameCache(DEFAULT_PRIVATE_CACHE_BYTES)
        self._state = DesktopState(cursor=(width // 2, height // 2))

    @staticmethod
    def widgets() -> dict[str, Rect]:
        """Every widget's rectangle (x, y, w, h), by name (a copy of :data:`WIDGETS`)."""
        return dict(WIDGETS)

    @property
    def state(self) -> DesktopState:
        return self._state

    async def start(self) -> None:
        # Building the scene (~0.2 s at 1080p) once, off the loop.
        await asyncio.get_running_loop().run_in_executor(imaging.ENCODE_POOL, _scene, self.width, self.height, self.seed)

    async def close(self) -> None:
        return None

    # -- pixels ------------------------------------------------------------

    async def screenshot(
        self,
        format: str = DEFAULT_IMAGE_FORMAT,
        quality: int = DEFAULT_IMAGE_QUALITY,
        max_long_edge: int | None = None,
        region: tuple[int, int, int, int] | None = None,
    ) -> EncodedImage:
        params = imaging.plan(self.width, self.height, format, quality, max_long_edge, region)
        state = self._state
        key = (self.width, self.height, self.seed, state, params)
        return await self._cache.get_or_encode(key, functools.partial(self._encode, state, params))

    def _encode(self, state: DesktopState, params: imaging.EncodeParams) -> EncodedImage:
        scene = _scene(self.width, self.height, self.seed)
        image, changed = scene.frame(state, params.geometry)
        if changed is None:
            return imaging.encoded(image, params, pointer=True)
        encoding = scene.initial_encoding(params).patched(image, params.quality, changed)
        return imaging.described(encoding.tobytes(), params, pointer=True)

    async def change_token(self) -> Hashable:
        return self._state

    async def cursor(self) -> tuple[int, int]:
        return self._state.cursor

    # -- input -------------------------------------------------------------

    def _update(self, **changes: Any) -> None:
        self._state = dataclasses.replace(self._state, **changes)

    async def move(self, x: int, y: int) -> None:
        self._update(cursor=self._clamp(x, y))

    async def click(self, x: int, y: int, button: str = "left", count: int = 1) -> None:
        self._check_button(button)
        x, y = self._clamp(x, y)
        self._update(cursor=(x, y))
        for _ in range(count):
            if button == "left":
                self._left_press_release(x, y, x, y)
        what = {1: "click", 2: "double-click"}.get(count, f"{count}x click")
        self._update(last_event=f"{what} {button} {x},{y}")

    async def drag(self, x0: int, y0: int, x1: int, y1: int, button: str = "left") -> None:
        self._check_button(button)
        (x0, y0), (x1, y1) = self._clamp(x0, y0), self._clamp(x1, y1)
        if button == "left":
            self._left_press_release(x0, y0, x1, y1)
        self._update(cursor=(x1, y1), last_event=f"drag {x0},{y0}>{x1},{y1}")

    async def scroll(self, dx: int, dy: int, x: int | None = None, y: int | None = None) -> None:
        if x is not None and y is not None:
            self._update(cursor=self._clamp(x, y))
        px, py = self._state.cursor
        s = self._state
        if _inside(notes_rect(s), px, py):
            top = max(0, min(NOTES_LINES - NOTES_VISIBLE_LINES, s.notes_top + dy * SCROLL_ROWS_PER_CLICK))
            self._update(notes_top=top)
        elif _inside(WIDGETS["list"], px, py):
            self._update(list_top=_clamp_list_top(s.list_top + dy * SCROLL_ROWS_PER_CLICK))
        elif _inside(WIDGETS["slider"], px, py):
            step = (dx - dy) * SLIDER_STEP_PER_CLICK  # wheel up or right raises the value
            self._update(slider=max(0, min(100, s.slider + step)))
        self._update(last_event=f"scroll {dx},{dy} at {px},{py}")

    async def type_text(self, text: str) -> None:
        # Runs of printable characters are inserted at once: a 64 Ki-character
        # text costs one state update, not 65536, on the event loop.
        for run, control in _TYPED.findall(text):
            self._insert("".join(c for c in run if c.isprintable()))
            if control:
                self._press_key("Tab" if control == "\t" else "Return", frozenset())
        self._update(last_event=f"type {len(text)} chars")

    async def key(self, combo: str) -> None:
        parsed = parse_combo(combo)
        char = parsed.char
        if char is not None:
            self._insert(char)
        else:
            self._press_key(parsed.key, parsed.modifiers)
        self._update(last_event=f"key {parsed}")

    # -- behaviour ---------------------------------------------------------

    def _clamp(self, x: int, y: int) -> tuple[int, int]:
        return max(0, min(self.width - 1, x)), max(0, min(self.height - 1, y))

    @staticmethod
    def _check_button(button: str) -> None:
        if button not in ("left", "middle", "right"):
            raise DisplayError(f"button must be left, middle or right, not {button!r}", ERR_BAD_ARGS)

    def _left_press_release(self, x0: int, y0: int, x1: int, y1: int) -> None:
        """A left press at (x0, y0) and release at (x1, y1), like a toolkit sees it:
        title bars drag, sliders follow, buttons fire when released over themselves."""
        s = self._state
        nx, ny, nw, _ = notes_rect(s)
        if _inside(notes_rect(s), x0, y0):
            if y0 < ny + TITLE_HEIGHT:
                new_x = max(64 - nw, min(self.width - 64, nx + x1 - x0))
                new_y = max(TOPBAR_HEIGHT, min(self.height - TASKBAR_HEIGHT - TITLE_HEIGHT, ny + y1 - y0))
                self._update(notes_pos=(new_x, new_y))
            return  # the Notes window covers what lies below it
        pressed = widget_at(x0, y0)
        if pressed == "slider":
            self._update(slider=slider_value_at(x1))
            return
        if pressed is None or widget_at(x1, y1) != pressed:
            return
        if pressed in TOGGLES:
            i = TOGGLES.index(pressed)
            self._update(toggles=s.toggles[:i] + (not s.toggles[i],) + s.toggles[i + 1:])
        elif pressed == "counter_minus":
            self._update(count=s.count - 1)
        elif pressed == "counter_plus":
            self._update(count=s.count + 1)
        elif pressed == "counter_reset":
            self._update(count=0)
        elif pressed == "checkbox":
            self._update(checked=not s.checked)
        elif pressed == "text_field":
            self._update(focus="text_field")
        elif pressed == "list":
            self._update(focus="list", list_selected=list_row_at(s, y1))

    def _insert(self, chars: str) -> None:
        s = self._state
        if s.focus != "text_field" or not chars:
            return
        text = chars if s.text_selected else s.text + chars
        self._update(text=text[:MAX_TEXT_CHARS], text_selected=False)

    def _press_key(self, key: str, modifiers: frozenset[str]) -> None:
        s = self._state
        if modifiers == {"ctrl"} and key.lower() == "a" and s.focus == "text_field":
            self._update(text_selected=bool(s.text))
        elif key == "Tab":
            self._update(focus="list" if s.focus == "text_field" else "text_field", text_selected=False)
        elif modifiers:
            return
        elif s.focus == "text_field":
            if key in ("BackSpace", "Delete"):
                self._update(text="" if s.text_selected else s.text[:-1], text_selected=False)
            elif key == "Return" and s.text:
                self._update(history=(s.history + (s.text,))[-HISTORY_LINES:], text="", text_selected=False)
            elif key == "Escape":
                self._update(text_selected=False)
        else:
            self._list_key(key)

    def _list_key(self, key: str) -> None:
        s = self._state
        current = s.list_selected if s.list_selected is not None else s.list_top - 1
        moves = {"Up": -1, "Down": 1, "Prior": -LIST_VISIBLE_ROWS, "Next": LIST_VISIBLE_ROWS,
                 "Home": -LIST_ITEMS, "End": LIST_ITEMS}
        if key not in moves:
            return
        selected = max(0, min(LIST_ITEMS - 1, current + moves[key]))
        top = s.list_top
        if selected < top:
            top = selected
        elif selected >= top + LIST_VISIBLE_ROWS:
            top = selected - LIST_VISIBLE_ROWS + 1
        self._update(list_selected=selected, list_top=_clamp_list_top(top))


#: A run of non-control characters, then the control character ending it, if any.
_TYPED = re.compile(r"([^\r\n\t]*)([\r\n\t]?)")


def _clamp_list_top(top: int) -> int:
    return max(0, min(LIST_ITEMS - LIST_VISIBLE_ROWS, top))
