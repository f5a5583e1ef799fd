"""A real desktop (shinkend --desktop full: Xvfb, openbox, Chromium, xterm, Mousepad) driven
through both SDK faces, the way an agent would: find things on screenshots, click, type,
press combos, scroll, and read back what the apps did (the page's own reports, files the
apps wrote), never what the test sent.

One desktop per module and provider (Chromium's start dominates): a plain shinkend
(LocalProvider) and one inside the isolated provider (its own namespaces, read-only /usr,
the agent's exec as an unprivileged user); every test opens its own window, so they do
not depend on each other's order. The page and its recording server run INSIDE
the sandbox (tests/desktop/page_server.py, started with exec on the sandbox's loopback);
every file goes to a directory made with mktemp -d inside the sandbox and removed after.
"""

from __future__ import annotations

import asyncio
import pathlib
import shlex
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
from PIL import Image, ImageChops

from shinken_sync.daemon.display.desktop import DESKTOPS
from shinken_sync.errors import ActionError
from shinken_sync.providers import LocalProvider
from shinken_sync.providers.errors import IsolationUnavailable
from shinken_sync.providers.isolated import IsolatedProvider
from shinken_sync.sync import Sandbox
from tests.support import wait_for

MISSING = sorted(p for p in {*DESKTOPS["full"].programs, "Xvfb", "xdotool"} if shutil.which(p) is None)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.desktop,
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (images/desktop/packages.txt)"),
]

SCREEN = (1280, 800)
PAGE_SERVER = pathlib.Path(__file__).with_name("page_server.py")
MAGENTA = (255, 0, 255)
#: Chromium's first window and page take 1-2 s idle here, much longer on a loaded box.
SLOW_S = 60.0


@dataclass
class Desk:
    provider: Any
    handle: Any
    sb: Sandbox
    #: A directory inside the sandbox (mktemp -d there), removed at teardown.
    tmp: str
    #: The page server's base URL, on the sandbox's own loopback.
    url: str


def _wait_for(probe: Callable[[], Any], what: str, timeout: float = SLOW_S, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _read(sb: Sandbox, path: str) -> bytes | None:
    try:
        return sb.read_file(path)
    except ActionError:  # not written yet
        return None


PROVIDERS = {"local": LocalProvider, "isolated": IsolatedProvider}


@pytest.fixture(scope="module", params=list(PROVIDERS))
def desk(request: pytest.FixtureRequest) -> Iterator[Desk]:
    try:
        provider = PROVIDERS[request.param](display="xvfb", screen=SCREEN, extra_args=["--desktop", "full"],
                                            start_timeout=SLOW_S)  # fmt: skip
    except IsolationUnavailable as exc:
        pytest.skip(f"no isolated sandbox on this host: {exc}")
    with provider:
        handle = provider.create()
        sb = provider.connect(handle, rpc_timeout=SLOW_S)
        tmp = sb.exec("mktemp -d").stdout.strip()
        try:
            sb.write_file(f"{tmp}/page_server.py", PAGE_SERVER.read_bytes())
            # setsid + output to a file: exec returns at once; timeout bounds a server the
            # teardown would miss.
            started = sb.exec(f"cd {shlex.quote(tmp)} && setsid timeout 900 python3 page_server.py . "
                              f"> server.log 2>&1 < /dev/null &")  # fmt: skip
            assert started.exit_code == 0, started
            port = _wait_for(lambda: _read(sb, f"{tmp}/port"), "the page server's port", 20)
            yield Desk(provider, handle, sb, tmp, f"http://127.0.0.1:{int(port)}/")
        finally:
            sb.exec(f"kill $(cat {shlex.quote(tmp)}/pid) 2>/dev/null; rm -rf {shlex.quote(tmp)}")
            sb.close()


def _screen(sb: Sandbox) -> Image.Image:
    shot = sb.screenshot(format="png")
    assert (shot.width, shot.height, shot.scale) == (*SCREEN, 1.0)
    return shot.to_image().convert("RGB")


def _bbox_of(image: Image.Image, colour: tuple[int, int, int]) -> tuple[int, int, int, int] | None:
    """The bounding box of every pixel of exactly ``colour`` (None: there is none)."""
    solid = Image.new("RGB", image.size, colour)
    mask = ImageChops.difference(image, solid).convert("L").point(lambda v: 255 if v == 0 else 0)
    return mask.getbbox()


PAGE_TITLE = "shinken desktop test page"
ACTIVE_TITLE = "xdotool getactivewindow getwindowname"


def _open_page(sb: Sandbox, url: str) -> tuple[int, int, int, int]:
    """Open the test page in a new browser window; the input's box on the screen once painted.

    The new window shows the page only once it loaded (its title says so): until then the
    screen may still show an earlier window's page under it (X keeps the old pixels of an
    unpainted window), whose input a click would hit while the keys went to the new one.
    """
    opened = sb.launch("browser", [url])
    assert opened["app"] == "browser" and opened["window"] > 0 and opened["pid"] > 0, opened
    _wait_for(lambda: sb.exec(ACTIVE_TITLE).stdout.startswith(PAGE_TITLE), "the new window to load the page")
    return _wait_for(lambda: _bbox_of(_screen(sb), MAGENTA), "the page's magenta input on the screen")


def _type_into_page(sb: Sandbox, desk: Desk, text: str) -> None:
    box = _open_page(sb, desk.url)
    before = _screen(sb)
    x, y = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2
    sb.click(x, y)
    sb.type(text)
    try:
        _wait_for(lambda: _read(sb, f"{desk.tmp}/typed") == text.encode(), f"the page to report {text!r}", 30)
    except AssertionError as exc:
        got = _read(sb, f"{desk.tmp}/typed")
        active = sb.exec("xdotool getactivewindow getwindowname").stdout.strip()
        raise AssertionError(f"{exc}; the page reported {got!r}; the active window: {active!r}") from None
    after = _screen(sb)
    # The typed characters show inside the input (the pixels changed there) ...
    inside = ImageChops.difference(before.crop(box), after.crop(box)).getbbox()
    assert inside is not None, "the input looks the same after typing"
    # ... and the page itself did not move: the input is where it was.
    assert _bbox_of(after, MAGENTA) == box
    # The pointer still follows after Unicode typing. Each keymap change makes openbox re-grab
    # its keys, and until it has, its click grab holds the pointer frozen: one change per
    # character kept it busy for seconds (the pointer never came). One change per text leaves
    # a short lag on a loaded machine, hence a bounded wait, not an instant check.
    sb.click(x, box[3] + 40)
    sb.move(x + 101, box[3] + 61)
    _wait_for(lambda: sb.cursor() == (x + 101, box[3] + 61), "the pointer to follow the move", 15)


def test_sync_face_clicks_the_browser_input_types_and_the_page_reports_it(desk: Desk) -> None:
    _type_into_page(desk.sb, desk, "hello sync Grüße мир 42")


def test_async_face_does_the_same_in_another_window(desk: Desk) -> None:
    text = "hello async ✓ 日本"

    async def main() -> None:
        sb = await desk.provider.aconnect(desk.handle, rpc_timeout=SLOW_S)
        try:
            opened = await sb.launch("browser", [desk.url])
            assert opened["app"] == "browser", opened
            deadline = time.monotonic() + SLOW_S
            while not (await sb.exec(ACTIVE_TITLE)).stdout.startswith(PAGE_TITLE):  # see _open_page
                assert time.monotonic() < deadline, "the new window never loaded the page"
                await asyncio.sleep(0.1)
            box = None
            while box is None:
                assert time.monotonic() < deadline, "the page never showed its input"
                shot = await sb.screenshot(format="png")
                assert shot.pointer is True  # the X screen composites the pointer in
                box = _bbox_of(shot.to_image().convert("RGB"), MAGENTA)
            await sb.click((box[0] + box[2]) // 2, (box[1] + box[3]) // 2)
            await sb.type(text)
            got = None
            while True:
                assert time.monotonic() < deadline, f"the page never reported {text!r}; it reported {got!r}"
                try:
                    got = await sb.read_file(f"{desk.tmp}/typed")
                    if got == text.encode():
                        return
                except ActionError:
                    pass
                await asyncio.sleep(0.1)
        finally:
            await sb.close()

    asyncio.run(main())


def test_key_combos_reach_the_page(desk: Desk) -> None:
    sb = desk.sb
    box = _open_page(sb, desk.url)
    sb.click((box[0] + box[2]) // 2, (box[1] + box[3]) // 2)
    sb.type("replace me")
    _wait_for(lambda: _read(sb, f"{desk.tmp}/typed") == b"replace me", "the first text")
    sb.key("ctrl+a")  # select all, then typing replaces it: only a real combo does that
    sb.type("x")
    _wait_for(lambda: _read(sb, f"{desk.tmp}/typed") == b"x", "ctrl+a then x to leave just 'x'")
    keys = _read(sb, f"{desk.tmp}/keys") or b""
    assert b"ctrl+a\n" in keys, keys


def test_the_wheel_scrolls_the_page(desk: Desk) -> None:
    sb = desk.sb
    box = _open_page(sb, desk.url)
    sb.exec(f"rm -f {shlex.quote(desk.tmp)}/scroll")
    sb.scroll(0, 5, x=SCREEN[0] // 2, y=SCREEN[1] // 2)
    scrolled = _wait_for(lambda: _read(sb, f"{desk.tmp}/scroll"), "the page to report scrolling")
    assert int(scrolled) > 100, scrolled
    # The input scrolled up by as much (or out of view).
    moved = _bbox_of(_screen(sb), MAGENTA)
    assert moved is None or moved[1] < box[1], (box, moved)


def test_the_editor_gets_typed_text_and_saves_it(desk: Desk) -> None:
    sb = desk.sb
    path = f"{desk.tmp}/note.txt"
    sb.write_file(path, b"")
    opened = sb.launch("editor", [path])
    assert opened["app"] == "editor", opened
    text = "written in Mousepad: Grüße ✓"
    sb.type(text)
    sb.key("ctrl+s")
    _wait_for(lambda: (_read(sb, path) or b"").rstrip(b"\n") == text.encode(), "Mousepad to save the file", 20)


def test_the_terminal_runs_what_is_typed_and_alt_f4_closes_it(desk: Desk) -> None:
    sb = desk.sb
    opened = sb.launch("terminal")
    out = f"{desk.tmp}/term.txt"
    sb.type(f"echo terminal-$((6*7)) $(id -u) > {out}\n")
    # The terminal's shell is the agent's, like exec's commands (in the isolated provider
    # an unprivileged uid, never the daemon's).
    uid = sb.exec("id -u").stdout.strip()
    expected = f"terminal-42 {uid}\n".encode()
    _wait_for(lambda: _read(sb, out) == expected, "the shell in xterm to write the file", 20)
    # alt+F4 goes to the window manager (without one xterm printed it as ESC[1;3S).
    window = str(opened["window"])

    def closed() -> bool:
        listed = sb.exec("xdotool search --onlyvisible --class XTerm").stdout.split()
        return window not in listed

    assert not closed()
    sb.key("alt+F4")
    _wait_for(closed, "alt+F4 to close the terminal window", 20)


def test_launch_refuses_an_unknown_app_by_name(desk: Desk) -> None:
    with pytest.raises(ActionError, match="unknown app 'spreadsheet'.*browser, terminal, editor"):
        desk.sb.launch("spreadsheet")


def test_a_killed_window_manager_is_restarted(desk: Desk) -> None:
    if not isinstance(desk.provider, LocalProvider):
        pytest.skip("finds openbox by host pid: the local provider's desktop")
    daemon = psutil.Process(desk.handle.pid)

    def managers() -> list[psutil.Process]:
        found = []
        for p in daemon.children(recursive=True):
            try:  # a child can exit between the listing and the look (a launcher, the killed one)
                if p.name() == "openbox" and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.NoSuchProcess:
                continue
        return found

    (old,) = managers()
    old.kill()
    _wait_for(lambda: [p for p in managers() if p.pid != old.pid], "the daemon to start openbox again", 15)
    # ... and the new one manages the screen: alt+F4 closes a window again.
    sb = desk.sb
    window = str(sb.launch("terminal")["window"])

    def closed() -> bool:
        return window not in sb.exec("xdotool search --onlyvisible --class XTerm").stdout.split()

    for _ in range(10):  # the new openbox may still be grabbing its keys: press until it acts
        sb.key("alt+F4")
        if wait_for(closed, 1.0, period=0.1):
            return
    raise AssertionError("alt+F4 did not close the terminal after the window manager restarted")


