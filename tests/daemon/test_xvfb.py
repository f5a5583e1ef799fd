"""shinkend with a real X server: typing through the daemon into xterm changes its pixels."""

from __future__ import annotations

import base64
import io
import shutil
import time

import psutil
import pytest
from PIL import Image, ImageChops

from shinken_sync import protocol

MISSING = [p for p in ("Xvfb", "xdotool", "xterm") if shutil.which(p) is None]
# A shell without the user's rc files (they may block: a stale pyenv rehash lock held an
# interactive bash for a minute); the tests are about the desktop, not the account.
XTERM = "xterm -geometry 80x24+0+0 -e bash --norc --noprofile"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.xvfb,
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} installed (apt-get install xvfb xdotool xterm)"),
]

SCREEN = (1024, 768)


@pytest.fixture(scope="module")
def xdaemon(module_shinkend):
    return module_shinkend(display="xvfb", screen=SCREEN, args=["--launch", XTERM])


def test_ready_line_and_hello_report_the_x_screen(xdaemon, aci):
    assert xdaemon.ready["display"] == "xvfb" and xdaemon.ready["x_display"].startswith(":")
    client = aci(xdaemon.url, xdaemon.token)
    assert (client.hello.display, client.hello.width, client.hello.height) == ("xvfb", *SCREEN)


def test_typing_into_xterm_changes_the_pixels(xdaemon, aci, tmp_path):
    client = aci(xdaemon.url, xdaemon.token, timeout=60)
    client.ok("wait_stable", stable_ms=300, timeout_ms=20_000)
    before = client.call("screenshot", format="png", region=[0, 0, 500, 300])
    out = tmp_path / "typed.txt"
    client.ok("type", text=f"echo shinken-$((6*7)) > {out}")
    client.ok("key", combo="Return")
    client.ok("wait_stable", stable_ms=300, timeout_ms=20_000)
    after = client.call("screenshot", format="png", region=[0, 0, 500, 300])
    img_before, img_after = (Image.open(io.BytesIO(bytes(r.image))).convert("RGB") for r in (before, after))
    assert img_before.size == img_after.size == (500, 300)
    changed = sum(ImageChops.difference(img_before, img_after).convert("L").histogram()[1:])
    assert changed > 200, f"only {changed} pixels changed"
    # xterm's shell really ran what was typed
    deadline = time.monotonic() + 10
    while not (out.exists() and out.read_bytes().endswith(b"\n")) and time.monotonic() < deadline:
        time.sleep(0.05)
    reply = client.call("read_file", path=str(out))
    assert reply.outcome == protocol.OK, reply
    assert base64.b64decode(reply.result["data"]) == b"shinken-42\n"


def test_pointer_and_full_screenshot_on_xvfb(xdaemon, aci):
    client = aci(xdaemon.url, xdaemon.token, timeout=60)
    client.ok("move", x=600, y=500)
    assert client.ok("cursor") == {"x": 600, "y": 500}
    reply = client.call("screenshot", format="jpeg", max_long_edge=512)
    assert reply.outcome == protocol.OK
    img = Image.open(io.BytesIO(bytes(reply.image)))
    assert img.size == (512, 384) == (reply.result["width"], reply.result["height"])


def test_sigterm_stops_xvfb_and_everything_it_started(shinkend, aci):
    daemon = shinkend(display="xvfb", screen=SCREEN, args=["--launch", XTERM])
    aci(daemon.url, daemon.token).ok("screen_size")
    children = psutil.Process(daemon.proc.pid).children(recursive=True)
    assert any(c.name() == "Xvfb" for c in children), [c.name() for c in children]
    assert daemon.stop() == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.name() for p in alive]
