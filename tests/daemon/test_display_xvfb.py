"""The Xvfb display against a real X server and a real X client (xterm)."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from PIL import Image, ImageChops

from bench import procfs
from shinken_sync.daemon import imaging
from shinken_sync.daemon.display import DisplayError, DisplayUnavailable, make_display
from shinken_sync.daemon.display import xvfb as xvfb_module
from shinken_sync.daemon.display.xkeymap import KeycodePool, keysym_for
from shinken_sync.protocol import ERR_FAILED, ERR_UNSUPPORTED

MISSING = [name for name in ("Xvfb", "xdotool", "xterm") if shutil.which(name) is None]
# A shell without the user's rc files: those may block (a stale pyenv rehash lock held an
# interactive bash here for a minute) and the test is about typing, not about the account.
XTERM = ["xterm", "-geometry", "80x24+0+0", "-e", "bash", "--norc", "--noprofile"]
needs_x = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} installed (apt-get install xvfb "
                             "xdotool xterm)")

W, H = 800, 600




async def _settle(display, quiet_s: float = 0.4, timeout_s: float = 10.0) -> None:
    """Wait until the screen stops changing (xterm drew its prompt, echoed a line)."""
    deadline = time.monotonic() + timeout_s
    token, since = await display.change_token(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the screen never settled"
        await asyncio.sleep(0.05)
        current = await display.change_token()
        if current != token:
            token, since = current, time.monotonic()


async def _wait_for_file(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text(encoding="utf-8").endswith("\n"):
            return path.read_text(encoding="utf-8")
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def test_missing_programs_raise_display_unavailable(monkeypatch):
    monkeypatch.setattr(xvfb_module.shutil, "which", lambda name: None)
    with pytest.raises(DisplayUnavailable) as info:
        make_display("xvfb", W, H)
    assert info.value.kind == ERR_UNSUPPORTED
    assert "apt-get install xvfb xdotool" in str(info.value)


def test_every_missing_prerequisite_is_reported_at_once(monkeypatch):
    monkeypatch.setattr(xvfb_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(xvfb_module, "mss", None)
    with pytest.raises(DisplayUnavailable) as info:
        make_display("xvfb", W, H)
    message = str(info.value)
    assert "Xvfb and xdotool" in message and "apt-get install xvfb xdotool" in message, message
    assert "mss" in message and "pip install 'shinken[xvfb]'" in message, message
    assert "\n" not in message


def test_keysyms_of_latin1_and_beyond():
    assert keysym_for("a") == 0x61 and keysym_for("ü") == 0xFC
    assert keysym_for("✓") == 0x01000000 + 0x2713


def test_keycode_pool_binds_unmapped_characters_once():
    pool = KeycodePool(mapped_keysyms={ord(c) for c in "abc "}, spare_keycodes=[8, 93, 97, 103])
    (chunk,) = pool.plan("abc üü ✓")
    assert chunk.text == "abc üü ✓" and not chunk.rebinds
    # One keycode kept for xdotool's own use; ü and ✓ each get one of the others.
    assert sorted(chunk.bindings.values()) == [keysym_for("ü"), keysym_for("✓")]
    assert set(chunk.bindings) <= {93, 97, 103}
    (again,) = pool.plan("ü✓")
    assert again.bindings == {} and not again.rebinds


def test_keycode_pool_splits_text_when_keycodes_run_out():
    pool = KeycodePool(mapped_keysyms=set(), spare_keycodes=[8, 9, 10])  # two usable
    chunks = pool.plan("αβγαδ")
    assert [c.text for c in chunks] == ["αβ", "γα", "δ"]
    assert [c.rebinds for c in chunks] == [False, True, True]
    # Within a chunk no keycode means two characters.
    for chunk in chunks:
        assert len(set(chunk.bindings)) == len(chunk.bindings)
    assert "".join(c.text for c in chunks) == "αβγαδ"


@pytest.mark.integration
@pytest.mark.xvfb
@needs_x
def test_typing_into_a_real_xterm(tmp_path):
    """Typed text, Unicode included, and key combos reach a real X client;
    its pixels and the change token follow; close() leaves nothing behind."""
    target = tmp_path / "typed.txt"
    # More distinct non-keymap characters than Xvfb has spare keycodes (19):
    # typing it rebinds keycodes between chunks.
    unicode_text = "Grüße мир ✓ 日本 αβγδεζηθικλμνξοπρστυφχψω"

    async def main():
        display = make_display("xvfb", W, H, launch=XTERM)
        await display.start()
        pids = display.pids
        try:
            assert display.display_name and display.display_name.startswith(":")
            assert all(procfs.alive(pid) for pid in pids)
            await _settle(display)  # the shell's prompt is up; earlier keys could be flushed

            before_token = await display.change_token()
            before = await display.screenshot("png")
            await display.type_text("abc")
            await display.key("ctrl+u")  # bash: kill the line, so "abc" never runs
            await display.type_text(f"printf '%s\\n' '{unicode_text}' > {target}\n")
            assert await _wait_for_file(target) == unicode_text + "\n"
            await _settle(display)

            after_token = await display.change_token()
            after = await display.screenshot("png")
            assert after_token != before_token
            old = Image.open(io.BytesIO(before.data)).convert("RGB")
            new = Image.open(io.BytesIO(after.data)).convert("RGB")
            box = ImageChops.difference(old, new).getbbox()
            assert box is not None and box[1] < H // 2  # the typed lines, at the top of the terminal

            # Nothing changes -> same token.
            assert await display.change_token() == await display.change_token()

            # A scaled shot after a change is patched from the previous scaled frame;
            # it must equal a full resize of the same pixels.
            await display.type_text("echo patched\n")
            await _settle(display)
            full = Image.open(io.BytesIO((await display.screenshot("png")).data)).convert("RGB")
            for _ in range(2):  # the second one takes the incremental path
                shot = await display.screenshot("png", max_long_edge=400)
            scaled = Image.open(io.BytesIO(shot.data)).convert("RGB")
            assert scaled.size == (400, 300) and shot.scale == 2.0
            reference = imaging.render(full, imaging.plan(W, H, max_long_edge=400).geometry)
            assert ImageChops.difference(scaled, reference).getbbox() is None

            # JPEG rows are patched across shots, also across a PNG shot in between.
            await display.screenshot("jpeg", 80, max_long_edge=400)
            await display.type_text("echo one\n")
            await _settle(display)
            await display.screenshot("png", max_long_edge=400)
            await display.type_text("echo two\n")
            await _settle(display)
            png = await display.screenshot("png", max_long_edge=400)
            jpeg = await display.screenshot("jpeg", 80, max_long_edge=400)
            pixels = Image.open(io.BytesIO(png.data)).convert("RGB")
            assert jpeg.data == imaging.encode(pixels, "jpeg", 80)
            await display.type_text("echo three\n")
            await _settle(display)
            jpeg = await display.screenshot("jpeg", 80, max_long_edge=400)  # patched bands
            png = await display.screenshot("png", max_long_edge=400)  # patched bands too
            pixels = Image.open(io.BytesIO(png.data)).convert("RGB")
            assert jpeg.data == imaging.encode(pixels, "jpeg", 80)
            assert png.data == imaging.encode(pixels, "png", 0)

            jpeg = await display.screenshot("jpeg", 80, 640, region=(0, 0, 400, 300))
            assert Image.open(io.BytesIO(jpeg.data)).size == (400, 300) == (jpeg.width, jpeg.height)

            # Pointer verbs drive the real pointer.
            await display.move(123, 45)
            assert await display.cursor() == (123, 45)
            await display.click(200, 100, button="left", count=2)
            await display.drag(10, 10, 300, 200)
            assert await display.cursor() == (300, 200)
            await display.scroll(0, 3, 50, 60)
            assert await display.cursor() == (50, 60)
        finally:
            await display.close()
        await display.close()  # idempotent
        assert not any(procfs.alive(pid) for pid in pids)
        number = display.display_name[1:]
        assert not Path(f"/tmp/.X11-unix/X{number}").exists()

    asyncio.run(main())


@pytest.mark.integration
@pytest.mark.xvfb
@needs_x
def test_xvfb_dies_with_a_killed_owner():
    """SIGKILL the process that owns the display: PR_SET_PDEATHSIG takes Xvfb with it."""
    script = textwrap.dedent(
        """
        import asyncio, sys
        from shinken_sync.daemon.display import make_display

        async def main():
            display = make_display("xvfb", 320, 240, window_manager=False)
            await display.start()
            print(" ".join(map(str, display.pids)), flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert pids and all(procfs.alive(pid) for pid in pids)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
    deadline = time.monotonic() + 10
    while any(procfs.alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(procfs.alive(pid) for pid in pids), "Xvfb outlived its owner"


@pytest.mark.integration
@pytest.mark.xvfb
@needs_x
def test_a_dead_xvfb_is_a_display_error_and_close_still_works():
    async def main():
        display = make_display("xvfb", 320, 240, window_manager=False)
        await display.start()
        assert (await display.screenshot("png")).width == 320
        os.kill(display.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while procfs.alive(display.pids[0]) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with pytest.raises(DisplayError) as info:
            await display.screenshot("png")
        assert info.value.kind == ERR_FAILED and "signal 9" in str(info.value)
        await display.close()

    asyncio.run(main())
