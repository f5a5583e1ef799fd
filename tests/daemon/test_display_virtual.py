"""The virtual desktop: input really changes pixels, the change token tracks them, frames are shared."""

from __future__ import annotations

import asyncio
import io
import itertools

import pytest
from PIL import Image, ImageChops

from shinken_sync.daemon import imaging
from shinken_sync.daemon.display import DisplayError, make_display
from shinken_sync.daemon.display.keys import parse_combo
from shinken_sync.daemon.display.virtual import (
    LIST_VISIBLE_ROWS,
    MAX_TEXT_CHARS,
    MIN_SIZE,
    NOTES_DEFAULT_POS,
    SCROLL_ROWS_PER_CLICK,
    WIDGETS,
    SharedFrameCache,
    VirtualDisplay,
)
from shinken_sync.protocol import ERR_BAD_ARGS

W, H = 1280, 800


def run(coro):
    return asyncio.run(coro)


def center(name: str) -> tuple[int, int]:
    x, y, w, h = WIDGETS[name]
    return x + w // 2, y + h // 2


async def frame(display: VirtualDisplay) -> Image.Image:
    shot = await display.screenshot("png")
    return Image.open(io.BytesIO(shot.data)).convert("RGB")


def region(image: Image.Image, rect: tuple[int, int, int, int]) -> bytes:
    x, y, w, h = rect
    return image.crop((x, y, x + w, y + h)).tobytes()


def changed_box(a: Image.Image, b: Image.Image):
    return ImageChops.difference(a, b).getbbox()


def inside(box, rect) -> bool:
    x, y, w, h = rect
    return x <= box[0] and y <= box[1] and box[2] <= x + w and box[3] <= y + h


@pytest.fixture
def display() -> VirtualDisplay:
    d = make_display("virtual", W, H)
    assert isinstance(d, VirtualDisplay)
    return d


# -- construction and layout ---------------------------------------------------------


def test_make_display_refuses_unknown_kind_and_tiny_screens():
    with pytest.raises(ValueError, match="unknown display kind"):
        make_display("vnc", 800, 600)
    with pytest.raises(ValueError, match="outside"):
        make_display("virtual", 640, 480)


def test_every_widget_fits_the_smallest_screen_and_none_overlap():
    rects = VirtualDisplay.widgets()
    assert rects == WIDGETS and rects is not WIDGETS
    for name, (x, y, w, h) in rects.items():
        assert 0 <= x and x + w <= MIN_SIZE[0] and 0 <= y and y + h <= MIN_SIZE[1], name
    names = list(rects)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ax, ay, aw, ah = rects[a]
            bx, by, bw, bh = rects[b]
            assert not (ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah), (a, b)


def test_full_hd_jpeg_frame_is_in_the_50_to_150_kib_class():
    async def main():
        d = VirtualDisplay(1920, 1080)
        shot = await d.screenshot("jpeg", 80)
        assert (shot.width, shot.height) == (1920, 1080)
        return len(shot.data)

    assert 50 * 1024 <= run(main()) <= 150 * 1024


# -- input changes pixels ----------------------------------------------------------------


def test_toggle_click_changes_the_button_pixels(display):
    async def main():
        before = await frame(display)
        await display.click(*center("toggle_wifi"))
        after = await frame(display)
        assert display.state.toggles == (True, False, False)
        assert region(before, WIDGETS["toggle_wifi"]) != region(after, WIDGETS["toggle_wifi"])
        assert region(before, WIDGETS["toggle_bluetooth"]) == region(after, WIDGETS["toggle_bluetooth"])
        await display.click(*center("toggle_wifi"))
        await display.move(W // 2, H // 2)  # the pointer is drawn too: move it off the button
        again = await frame(display)
        assert region(again, WIDGETS["toggle_wifi"]) == region(before, WIDGETS["toggle_wifi"])

    run(main())


def test_counter_checkbox_and_slider(display):
    async def main():
        await display.click(*center("counter_plus"), count=3)
        await display.click(*center("counter_minus"))
        assert display.state.count == 2
        await display.click(*center("checkbox"))
        assert display.state.checked
        before = await frame(display)
        sx, sy, sw, sh = WIDGETS["slider"]
        await display.drag(sx + 200, sy + sh // 2, sx + sw - 1, sy + sh // 2)
        assert display.state.slider == 100
        after = await frame(display)
        assert region(before, WIDGETS["slider"]) != region(after, WIDGETS["slider"])
        await display.click(*center("counter_reset"))
        assert display.state.count == 0

    run(main())


def test_button_fires_only_when_released_over_itself(display):
    async def main():
        bx, by = center("counter_plus")
        await display.drag(bx, by, bx + 300, by + 300)
        assert display.state.count == 0

    run(main())


def test_typed_unicode_appears_in_the_text_field(display):
    async def main():
        empty = await frame(display)
        await display.type_text("Grüße, мир ✓")
        assert display.state.text == "Grüße, мир ✓"
        typed = await frame(display)
        box = changed_box(empty, typed)
        # Only the field (and the details panel's "last event" line) changed.
        assert box is not None
        assert region(empty, WIDGETS["text_field"]) != region(typed, WIDGETS["text_field"])
        assert region(empty, WIDGETS["list"]) == region(typed, WIDGETS["list"])
        # Different text, different pixels: the field really draws the characters.
        await display.key("BackSpace")
        await display.type_text("✗")
        other = await frame(display)
        assert display.state.text == "Grüße, мир ✗"
        assert region(typed, WIDGETS["text_field"]) != region(other, WIDGETS["text_field"])

    run(main())


def test_select_all_replace_backspace_and_enter(display):
    async def main():
        initial = await frame(display)
        await display.type_text("first")
        await display.key("ctrl+a")
        assert display.state.text_selected
        await display.type_text("second")
        assert display.state.text == "second" and not display.state.text_selected
        await display.key("enter")
        assert display.state.text == "" and display.state.history == ("second",)
        sent = await frame(display)
        # The field is empty again and looks it; the history line is new.
        assert region(sent, WIDGETS["text_field"]) == region(initial, WIDGETS["text_field"])
        assert region(sent, WIDGETS["history"]) != region(initial, WIDGETS["history"])
        await display.type_text("xy")
        await display.key("ctrl+a")
        await display.key("BackSpace")
        assert display.state.text == ""
        await display.type_text("line one\nline two\n")
        assert display.state.history == ("second", "line one", "line two")

    run(main())


def test_text_field_keeps_at_most_max_chars_and_drops_control_characters(display):
    async def main():
        await display.type_text("a\x07b")
        assert display.state.text == "ab"
        await display.type_text("x" * (MAX_TEXT_CHARS + 100) + "\nafter")
        assert display.state.history == ("ab" + "x" * (MAX_TEXT_CHARS - 2),)
        assert display.state.text == "after"

    run(main())


def test_scroll_moves_the_list_and_back(display):
    async def main():
        before = await frame(display)
        await display.scroll(0, 2, *center("list"))
        assert display.state.list_top == 2 * SCROLL_ROWS_PER_CLICK
        scrolled = await frame(display)
        assert region(before, WIDGETS["list"]) != region(scrolled, WIDGETS["list"])
        await display.scroll(0, -2)
        await display.move(W // 2, H // 2)  # the pointer is drawn too: move it off the list
        back = await frame(display)
        assert region(back, WIDGETS["list"]) == region(before, WIDGETS["list"])
        await display.scroll(0, -5)
        assert display.state.list_top == 0  # clamped

    run(main())


def test_list_selection_by_click_and_keys(display):
    async def main():
        lx, ly, _, _ = WIDGETS["list"]
        await display.click(lx + 20, ly + 2 * 24 + 5)
        assert display.state.focus == "list" and display.state.list_selected == 2
        for _ in range(LIST_VISIBLE_ROWS):
            await display.key("Down")
        assert display.state.list_selected == 2 + LIST_VISIBLE_ROWS
        assert display.state.list_top > 0  # the selection was scrolled into view
        await display.type_text("ignored")  # the list has focus, not the field
        assert display.state.text == ""
        await display.key("Tab")
        await display.type_text("ok")
        assert display.state.text == "ok"

    run(main())


def test_notes_window_drags_by_its_title_bar(display):
    async def main():
        before = await frame(display)
        nx, ny = NOTES_DEFAULT_POS
        await display.drag(nx + 200, ny + 10, nx + 100, ny + 210)
        assert display.state.notes_pos == (nx - 100, ny + 200)
        after = await frame(display)
        old = (nx + 400, ny + 40, 60, 150)  # uncovered by the move
        assert region(before, old) != region(after, old)
        # The window's content moved with it.
        content = (nx + 20, ny + 40, 300, 60)
        moved = (nx - 80, ny + 240, 300, 60)
        assert region(before, content) == region(after, moved)
        # Dragging its body does not move it.
        await display.drag(nx, ny + 300, nx + 50, ny + 350)
        assert display.state.notes_pos == (nx - 100, ny + 200)

    run(main())


def test_cursor_follows_pointer_verbs(display):
    async def main():
        assert await display.cursor() == (W // 2, H // 2)
        await display.move(10, 20)
        assert await display.cursor() == (10, 20)
        await display.click(30, 40, button="right")
        assert await display.cursor() == (30, 40)
        with pytest.raises(DisplayError) as info:
            await display.click(1, 1, button="fourth")
        assert info.value.kind == ERR_BAD_ARGS

    run(main())


# -- change token ----------------------------------------------------------------------------


def test_change_token_changes_iff_pixels_change(display):
    async def main():
        actions = [
            display.move(100, 100),
            display.move(100, 100),  # same place: nothing changes
            display.scroll(0, 0),
            display.scroll(0, 0),  # same event again: same state
            display.type_text("a"),
            display.key("ctrl+a"),
            display.key("ctrl+a"),
            display.click(*center("toggle_dark")),
        ]
        observations = []
        for action in actions:
            await action
            observations.append((await display.change_token(), (await frame(display)).tobytes()))
        for (token_a, pixels_a), (token_b, pixels_b) in itertools.pairwise(observations):
            assert (token_a == token_b) == (pixels_a == pixels_b)
        # Both kinds of step occurred.
        equal_steps = sum(a[0] == b[0] for a, b in itertools.pairwise(observations))
        assert 0 < equal_steps < len(observations) - 1
        hash(observations[0][0])  # tokens are hashable (this raises otherwise)

    run(main())


# -- rendering paths and the shared cache --------------------------------------------------


def test_scaled_frame_equals_full_frame_resized(display):
    async def main():
        await display.type_text("scaled")
        await display.click(*center("toggle_bluetooth"))
        await display.drag(NOTES_DEFAULT_POS[0] + 50, NOTES_DEFAULT_POS[1] + 10, 300, 400)
        await display.scroll(0, 3, *center("list"))
        full = await frame(display)
        shot = await display.screenshot("png", max_long_edge=640)
        scaled = Image.open(io.BytesIO(shot.data)).convert("RGB")
        assert scaled.size == (640, 400) and shot.scale == 2.0
        reference = imaging.render(full, imaging.plan(W, H, max_long_edge=640).geometry)
        assert ImageChops.difference(scaled, reference).getbbox() is None

    run(main())


@pytest.mark.parametrize("max_long_edge", [None, 640])
def test_spliced_encodings_equal_a_plain_encode_of_the_frame(display, max_long_edge):
    async def main():
        await display.type_text("splice")
        await display.click(*center("toggle_wifi"))
        await display.scroll(0, 2, *center("list"))
        png = await display.screenshot("png", max_long_edge=max_long_edge)
        jpeg = await display.screenshot("jpeg", 70, max_long_edge=max_long_edge)
        pixels = Image.open(io.BytesIO(png.data)).convert("RGB")
        assert jpeg.data == imaging.encode(pixels, "jpeg", 70)
        assert png.data == imaging.encode(pixels, "png", 0)

    run(main())


def test_region_screenshot_is_the_same_pixels(display):
    async def main():
        await display.type_text("region")
        full = await frame(display)
        shot = await display.screenshot("png", region=WIDGETS["text_field"])
        part = Image.open(io.BytesIO(shot.data)).convert("RGB")
        assert (shot.x0, shot.y0) == WIDGETS["text_field"][:2]
        assert part.tobytes() == region(full, WIDGETS["text_field"])

    run(main())


def test_shared_cache_encodes_one_frame_for_displays_in_the_same_state():
    async def main():
        cache = SharedFrameCache(max_bytes=8 * 2**20)
        displays = [VirtualDisplay(W, H, shared_cache=cache) for _ in range(8)]
        shots = await asyncio.gather(*(d.screenshot("jpeg", 80, 640) for d in displays))
        assert cache.misses == 1 and cache.hits == 7
        assert all(s.data is shots[0].data for s in shots)
        # One display diverges: its frame is new, the others still share.
        await displays[0].type_text("x")
        diverged = await displays[0].screenshot("jpeg", 80, 640)
        again = await displays[1].screenshot("jpeg", 80, 640)
        assert diverged.data != shots[0].data and again.data is shots[0].data
        assert cache.misses == 2
        # Other encode parameters are another entry.
        await displays[1].screenshot("png", 80, 640)
        assert cache.misses == 3 and len(cache) == 3

    run(main())


def test_shared_cache_evicts_by_bytes():
    async def main():
        cache = SharedFrameCache(max_bytes=60_000)
        display = VirtualDisplay(W, H, shared_cache=cache)
        for ch in "abcdef":
            await display.type_text(ch)
            await display.screenshot("jpeg", 80, 640)
        assert cache.bytes <= 60_000 and 0 < len(cache) < 6

    run(main())


def test_shared_cache_hands_an_encode_failure_to_every_waiter():
    async def main():
        cache = SharedFrameCache()

        def broken():
            raise RuntimeError("encoder exploded")

        results = await asyncio.gather(
            *(cache.get_or_encode("k", broken) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, RuntimeError) for r in results)
        assert len(cache) == 0  # nothing cached, a later call retries

    run(main())


# -- key combos (shared by both backends) -----------------------------------------------------


@pytest.mark.parametrize(
    ("combo", "xdotool", "char"),
    [
        ("ctrl+shift+t", "ctrl+shift+t", None),
        ("Shift+Ctrl+T", "ctrl+shift+T", None),
        ("enter", "Return", None),
        ("cmd+space", "super+space", None),
        ("a", "a", "a"),
        ("shift+a", "shift+a", "A"),
        ("space", "space", " "),
        ("ctrl++", "ctrl+plus", None),
        ("PageDown", "Next", None),
        ("F5", "F5", None),
        ("KP_Enter", "KP_Enter", None),
    ],
)
def test_parse_combo(combo, xdotool, char):
    parsed = parse_combo(combo)
    assert parsed.xdotool() == xdotool
    assert parsed.char == char


@pytest.mark.parametrize("combo", ["", "ctrl+", "hyper+a", "ctrl+a+b+c+d+e+f", "bad key", "ctrl+é€"])
def test_parse_combo_rejects_malformed(combo):
    with pytest.raises(DisplayError) as info:
        parse_combo(combo)
    assert info.value.kind == ERR_BAD_ARGS
