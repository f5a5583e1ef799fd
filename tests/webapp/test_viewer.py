"""The viewer in a real headless Chromium (Debian's, over the DevTools protocol: tests/cdp.py)
against real session servers in both modes, with real sessions through the reference backend:
screenshots, a client-written tool call, a one-step rollback and a message full of markup.

One browser for the module; both servers have an API key (the viewer's login): the viewer
follows the API's auth, which is the same in both modes.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import requests
import safetensors.numpy
from PIL import Image

from shinken_sync.fleet_wire import FrameItem, encode_batch
from tests.cdp import CHROMIUM, Browser, Page
from tests.viewer_rollout import HOSTILE_TEXT, Rollout, drive, screen_colour, screenshot_png

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium")]

KEY = "viewer-test-key-0123456789abcdef"
TURNS = 6


@dataclass
class Served:
    url: str
    key: str | None
    rollout: Rollout
    workers: int


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="module", params=[0, 2], ids=["single-process", "router"])
def served(request: pytest.FixtureRequest, session_server_factory, tmp_path_factory) -> Iterator[Served]:
    workers = request.param
    key = KEY
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    flags = ["--api-key-file", str(key_file)]
    server = session_server_factory.launch(workers, None, *flags)
    rollout = drive(server.url, TURNS, key=key)
    for _ in range(2):  # other sessions, so the list has something to sort and filter
        drive(server.url, 1, key=key, rollback_at=None, hostile=False)
    yield Served(server.url, key, rollout, workers)


@pytest.fixture
def page(browser: Browser, served: Served) -> Iterator[Page]:
    p = browser.new_page()
    p.send("Network.clearBrowserCookies")
    if served.key:
        login(p, served, served.key)
    yield p
    p.close()


def login(p: Page, served: Served, key: str) -> int:
    p.navigate(f"{served.url}/ui/login")
    p.evaluate(f"document.getElementById('key').value = {key!r}; document.querySelector('form.login').submit()")
    time.sleep(0.2)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        state = p.evaluate("[document.readyState, !!(window.__viewer && window.__viewer.ready), "
                           "performance.getEntriesByType('navigation')[0].responseStatus, location.pathname]")
        if state[0] == "complete" and state[1]:
            return int(state[2])
        time.sleep(0.05)
    raise AssertionError("login page never settled")


def _pixel_of_image(p: Page, selector: str) -> list[int]:
    p.wait_for(f"(() => {{ const i = document.querySelector({selector!r}); return i && i.complete && i.naturalWidth > 0; }})()")
    return p.evaluate(f"""(() => {{
        const img = document.querySelector({selector!r});
        const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
        const g = c.getContext('2d'); g.drawImage(img, 0, 0);
        return Array.from(g.getImageData(3, 3, 1, 1).data.slice(0, 3)); }})()""")


def test_wrong_key_is_401_and_the_login_sets_an_httponly_strict_cookie(browser: Browser, served: Served) -> None:
    p = browser.new_page()
    try:
        p.send("Network.clearBrowserCookies")
        assert p.navigate(f"{served.url}/ui/") == 401
        assert p.evaluate("!!document.getElementById('key')")  # the login form, not the data
        assert login(p, served, "not-the-key") == 401
        assert p.evaluate("document.getElementById('login-error').textContent") == "Wrong key."
        assert login(p, served, served.key) == 200
        assert p.evaluate("location.pathname") == "/ui/"
        cookies = p.send("Network.getCookies", {"urls": [served.url + "/ui/"]})["cookies"]
        (cookie,) = [c for c in cookies if c["name"] == "shinken_viewer"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
        assert served.key not in cookie["value"]
        assert p.evaluate("document.cookie") == ""  # no script can read it
    finally:
        p.close()
    sid = served.rollout.session_id
    for path in ("/ui/", f"/ui/sessions/{sid}", f"/ui/api/sessions/{sid}/timeline", "/ui/api/sessions"):
        assert requests.get(served.url + path, timeout=10).status_code == 401, path
        assert requests.get(served.url + path, headers={"Authorization": "Bearer wrong"},
                            timeout=10).status_code == 401, path
        assert requests.get(served.url + path, headers={"Authorization": f"Bearer {served.key}"},
                            timeout=10).status_code == 200, path
    # The API's own routes keep their bearer check; the viewer's cookie is no key for them.
    assert requests.get(f"{served.url}/sessions/{sid}", cookies={"shinken_viewer": cookie["value"]},
                        timeout=10).status_code == 401


def test_session_list_sorts_and_filters(page: Page, served: Served) -> None:
    assert page.navigate(f"{served.url}/ui/") == 200
    rows = page.evaluate("Array.from(document.querySelectorAll('#sessions tbody tr')).map(r => r.dataset.session)")
    assert served.rollout.session_id in rows and len(rows) == 3
    # Sorted by turns, descending: the long rollout first.
    page.evaluate("Array.from(document.querySelectorAll('#sessions th')).find(th => th.textContent.startsWith('turns')).click()")
    page.wait_for("document.querySelector('#sessions th:nth-child(2)').textContent.includes('▾')")
    first = page.evaluate("document.querySelector('#sessions tbody tr').dataset.session")
    assert first == served.rollout.session_id
    cells = page.evaluate("Array.from(document.querySelector('#sessions tbody tr').children).map(td => td.textContent)")
    assert cells[1] == str(TURNS) and cells[3] == str(len(served.rollout.images))
    page.evaluate(f"const i = document.getElementById('prefix'); i.value = {served.rollout.session_id[:6]!r};"
                  " i.dispatchEvent(new Event('input'))")
    page.wait_for("document.querySelectorAll('#sessions tbody tr').length === 1")


def test_session_page_shows_every_turn_its_screens_and_the_rollback(page: Page, served: Served) -> None:
    rollout = served.rollout
    assert page.navigate(f"{served.url}/ui/sessions/{rollout.session_id}") == 200
    assert page.evaluate("document.getElementById('turn-count').textContent") == str(TURNS)
    assert page.evaluate("document.querySelectorAll('.turn').length") == TURNS
    assert page.evaluate("document.querySelectorAll('.turn.rollback').length") == rollout.rollbacks == 1
    # The first turn's screenshot, its pixels as decoded by the browser from the server's bytes.
    assert _pixel_of_image(page, "#turn-0 img.shot") == list(screen_colour(0))
    # The client-written tool call and the model's parsed action.
    card = page.evaluate("document.getElementById('turn-0').textContent")
    assert 'tool call click {"x": 10, "y": 20}' in card and "parsed action" in card


def test_markup_in_a_message_renders_as_text(page: Page, served: Served) -> None:
    assert page.navigate(f"{served.url}/ui/sessions/{served.rollout.session_id}") == 200
    texts = page.evaluate("Array.from(document.querySelectorAll('.turn pre')).map(p => p.textContent)")
    assert any(HOSTILE_TEXT in t for t in texts)
    assert page.evaluate("window.__xss") is None
    assert page.evaluate("document.querySelectorAll('main script, img[src=\"x\"]').length") == 0


def test_token_colours_follow_the_samples_loss_mask(page: Page, served: Served) -> None:
    sid = served.rollout.session_id
    headers = {"Authorization": f"Bearer {served.key}"} if served.key else {}
    got = requests.post(f"{served.url}/sessions/{sid}/samples", json={}, headers=headers, timeout=30)
    tensors = safetensors.numpy.load(got.content)
    tokens, mask = tensors["tokens.0"], tensors["loss_mask.0"]
    prompt = len(tokens) - len(mask)
    trained, masked = prompt + int(np.argmax(mask == 1)), prompt + int(np.argmax(mask == 0))
    assert page.navigate(f"{served.url}/ui/sessions/{sid}") == 200
    assert f"trains on {int(mask.sum())} of {len(tokens)} tokens" in page.evaluate(
        "document.getElementById('sample').textContent")

    def style(pos: int) -> dict:
        page.evaluate(f"window.__viewer.scrollToPos({pos})")
        page.wait_for(f"!!document.querySelector('.tok[data-pos=\"{pos}\"]')")
        return page.evaluate(f"""(() => {{ const t = document.querySelector('.tok[data-pos="{pos}"]');
            const s = getComputedStyle(t); return {{kind: t.dataset.kind, bg: s.backgroundColor, fg: s.color}}; }})()""")

    on, off, first = style(trained), style(masked), style(0)
    assert on["kind"] == "1" and off["kind"] == "0" and first["kind"] == "0"
    assert off["bg"] == first["bg"] == "rgba(0, 0, 0, 0)" and off["fg"] == "rgb(138, 143, 152)"
    assert on["bg"] != "rgba(0, 0, 0, 0)"  # coloured by its logprob
    # An image pad run is one entry showing the image it stands for.
    timeline = requests.get(f"{served.url}/ui/api/sessions/{sid}/timeline", headers=headers, timeout=10).json()
    run = timeline["tokens"]["image_runs"][0]
    assert run["count"] > 1 and tokens[run["start"]:run["start"] + run["count"]].tolist() == [tokens[run["start"]]] * run["count"]
    assert style(run["start"])["kind"] == "0"
    shown = page.evaluate(f"document.querySelector('.tok.img[data-pos=\"{run['start']}\"] img').dataset.sha256")
    assert shown == hashlib.sha256(served.rollout.images[0]).hexdigest()
    assert _pixel_of_image(page, f'.tok.img[data-pos="{run["start"]}"] img') == list(screen_colour(0))


def test_unknown_session_is_a_404_page(page: Page, served: Served) -> None:
    assert page.navigate(f"{served.url}/ui/sessions/no-such-session") == 404
    assert page.evaluate("document.getElementById('notfound').textContent") == "Not found"
    headers = {"Authorization": f"Bearer {served.key}"} if served.key else {}
    assert requests.get(f"{served.url}/ui/api/sessions/no-such-session/timeline", headers=headers,
                        timeout=10).status_code == 404


def test_screenshots_show_the_screens_and_repeat_exactly(page: Page, served: Served) -> None:
    assert page.navigate(f"{served.url}/ui/sessions/{served.rollout.session_id}") == 200
    _pixel_of_image(page, "#turn-0 img.shot")
    box = page.evaluate("(() => { const r = document.querySelector('#turn-0 img.shot').getBoundingClientRect();"
                        " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    first = Image.open(io.BytesIO(page.screenshot())).convert("RGB")
    assert first.getpixel((int(box[0]), int(box[1]))) == screen_colour(0)
    assert page.navigate(f"{served.url}/ui/sessions/{served.rollout.session_id}") == 200
    _pixel_of_image(page, "#turn-0 img.shot")
    second = Image.open(io.BytesIO(page.screenshot())).convert("RGB")
    diff = np.abs(np.asarray(first, dtype=np.int16) - np.asarray(second, dtype=np.int16))
    assert diff.max() == 0, "the same session renders the same pixels"


def test_live_fleet_grid_and_full_rate_tile(page: Page, served: Served) -> None:
    headers = {"Authorization": f"Bearer {served.key}"} if served.key else {}
    api = f"{served.url}/ui/api/fleets"
    fleet = requests.post(api, json={"name": "test fleet <b>x</b>", "tiles": [
        {"tile_id": f"sb{i}", "label": f"sandbox {i}"} for i in range(4)]}, headers=headers, timeout=10).json()
    fid = fleet["fleet_id"]

    def push(frames: dict[int, int]) -> dict:
        batch = encode_batch([FrameItem(f"sb{i}", "image/png", 64, 48, screenshot_png(c)) for i, c in frames.items()])
        r = requests.post(f"{api}/{fid}/frames", data=batch, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    assert push({i: 10 + i for i in range(4)})["seqs"] == {f"sb{i}": 1 for i in range(4)}
    assert page.navigate(f"{served.url}/ui/fleet/{fid}") == 200
    assert "test fleet <b>x</b>" in page.evaluate("document.querySelector('h1').textContent")
    assert _pixel_of_image(page, '.tile[data-tile="sb2"] img') == list(screen_colour(12))
    page.evaluate("document.querySelector('.tile[data-tile=\"sb1\"]').click()")
    page.wait_for("window.__viewer.liveSeq === 1")
    assert push({1: 20})["focus"] == "sb1"  # the opened tile is the one the publisher streams at full rate
    page.wait_for("window.__viewer.liveSeq === 2")
    assert _pixel_of_image(page, "#live") == list(screen_colour(20))
    # HTML is not a frame type: the hub serves only images back.
    html = encode_batch([FrameItem("sb0", "text/html", 1, 1, b"<script>")])
    assert requests.post(f"{api}/{fid}/frames", data=html, headers=headers, timeout=10).status_code == 400
    assert requests.post(f"{api}/{fid}/frames", data=b"\x00\x00\x00\x09{}", headers=headers,
                         timeout=10).status_code == 400  # a batch that does not parse
    assert page.navigate(f"{served.url}/ui/fleet/nope") == 404


def test_a_session_without_turns_opens_empty(page: Page, served: Served) -> None:
    headers = {"Authorization": f"Bearer {served.key}"} if served.key else {}
    sid = requests.post(f"{served.url}/sessions", headers=headers, timeout=10).json()["session_id"]
    assert page.navigate(f"{served.url}/ui/sessions/{sid}") == 200
    assert page.evaluate("document.getElementById('turn-count').textContent") == "0"
    assert "no sample (no_records)" in page.evaluate("document.getElementById('sample').textContent")
    requests.delete(f"{served.url}/sessions/{sid}", headers=headers, timeout=10)
