"""A small Chrome DevTools Protocol client for the viewer's browser tests: Debian's headless
Chromium (``/usr/bin/chromium``, never a downloaded browser), one websocket to the browser
endpoint, pages as flattened target sessions (``Target.attachToTarget`` with ``flatten``).

Only what the tests use: navigate, evaluate, screenshot, cookies, viewport. Commands and
events are the protocol's own (https://chromedevtools.github.io/devtools-protocol/): each
message ``{"id", "method", "params", "sessionId"}``, answered by ``{"id", "result" | "error"}``.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

CHROMIUM = "/usr/bin/chromium"
# --disable-partial-raster: with partial raster (a tile re-rastered only in its changed rect, e.g.
# when the page's images arrive after its text), two renders of the same page differed by 1-6
# levels on a few glyph-edge pixels, in most runs on a loaded machine; with whole-tile raster,
# 20 of 20 such runs gave identical screenshots, so the viewer's "same pixels" test can be exact.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--disable-partial-raster",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class CdpError(Exception):
    """The browser answered a command with an error, or did not answer in time."""


class Browser:
    def __init__(self, timeout: float = 30.0) -> None:
        self._profile = tempfile.mkdtemp(prefix="shinken-chromium-")
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self._closed = False
        atexit.register(self.close)  # its own session ignores our Ctrl-C: never leave it behind
        url = self._endpoint(timeout)
        # Entered as a context manager (websockets' supported form), left in close().
        self._ws = connect(url, max_size=None, open_timeout=timeout).__enter__()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self.events: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _endpoint(self, timeout: float) -> str:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline().decode(errors="replace")
            if not line:
                break
            lines.append(line)
            match = _LISTENING.search(line)
            if match:
                threading.Thread(target=self._drain, daemon=True).start()
                return match.group(1)
        self.close()
        raise CdpError("chromium did not start:\n" + "".join(lines))

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for _ in self.proc.stderr:
            pass

    def _read(self) -> None:
        try:
            for raw in self._ws:
                message = json.loads(raw)
                with self._cond:
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self.events.append(message)
                    self._cond.notify_all()
        except (ConnectionClosed, OSError):  # the socket closed: waiters time out
            with self._cond:
                self._cond.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        call_id = next(self._ids)
        message: dict[str, Any] = {"id": call_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        with self._lock:
            self._ws.send(json.dumps(message))
        deadline = time.monotonic() + timeout
        with self._cond:
            while call_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CdpError(f"{method}: no answer within {timeout} s")
                self._cond.wait(left)
            reply = self._replies.pop(call_id)
        if "error" in reply:
            raise CdpError(f"{method}: {reply['error']}")
        return dict(reply.get("result") or {})

    def new_page(self, width: int = 1280, height: int = 800) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, target, session)
        page.send("Page.enable")
        page.send("Network.enable")
        page.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        return page

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_ws"):
            with contextlib.suppress(ConnectionClosed, OSError):  # already closed by the browser
                self._ws.__exit__(None, None, None)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        shutil.rmtree(self._profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, target: str, session: str) -> None:
        self.browser, self.target, self.session = browser, target, session

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        return self.browser.send(method, params, self.session, timeout)

    def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, timeout)
        if "exceptionDetails" in result:
            raise CdpError(f"evaluate {expression[:80]!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str, ready: bool = True, timeout: float = 30.0) -> int:
        """Open ``url``; wait for the viewer's ready flag (``ready``). The document's HTTP status."""
        self.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.evaluate("[location.href, document.readyState, !!(window.__viewer && window.__viewer.ready),"
                                  " (performance.getEntriesByType('navigation')[0] || {}).responseStatus || 0]")
            if state[0] != "about:blank" and state[1] == "complete" and (state[2] or not ready):
                return int(state[3])
            time.sleep(0.05)
        raise CdpError(f"{url}: not ready within {timeout} s")

    def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.05)
        raise CdpError(f"never true within {timeout} s: {expression}")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})
