"""Screenshot round trip through a real shinkend on loopback, per kind of screen change.

Starts ``python -m shinken_sync.daemon.server --display virtual|xvfb`` as a
subprocess, reads its ready line and speaks the ACI protocol over a plain
``websockets`` client. Each sample first changes the screen (untimed, and
acknowledged: for Xvfb also ``wait_stable`` so xterm has drawn), then times
ONE ``screenshot`` call from send to the decoded binary reply. Scenarios:

* ``small change``: type one character (the text field / the xterm line);
  every sample is a new screen state, so no cached frame can answer.
* ``large change``: virtual: drag the Notes window (two 640x400 areas) and type;
  xvfb: alternate ``seq 1 100`` and ``clear`` in a screen-filling xterm, so the
  whole terminal changes.
* ``unchanged``: nothing changed since the last shot.

    python bench/screenshot.py [--backends virtual,xvfb] [--samples 40] [--long-edge 1280]

Targets on this 2-core machine (small change, 1920x1080 -> 1280 JPEG q80):
virtual p50 <= 15 ms, xvfb p50 <= 25 ms. See docs/displays.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

from websockets.asyncio.client import ClientConnection, connect

from shinken_sync import protocol
from shinken_sync.stats import percentile

TARGET_P50_MS = {"virtual": 15.0, "xvfb": 25.0}
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
WARMUP = 5
#: 318x82 cells of xterm's default 6x13 font fill a 1920x1080 screen.
XTERM = "xterm -geometry 318x82+0+0 -e bash --norc --noprofile"  # no rc files: they may block


class Daemon:
    """One shinkend subprocess, stopped on exit."""

    def __init__(self, display: str, screen: str, extra: list[str]):
        self.token = secrets.token_urlsafe(24)
        fd, self._token_path = tempfile.mkstemp(prefix="bench-shinkend-", suffix=".token")
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        cmd = [sys.executable, "-m", "shinken_sync.daemon.server", "--host", "127.0.0.1", "--port", "0",
               "--token-file", self._token_path, "--display", display, "--screen", screen,
               "--log-level", "WARNING", *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            self.ready = self._read_ready()
        except BaseException:
            self.stop()
            raise

    def _read_ready(self) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                raise RuntimeError(f"shinkend did not become ready (exit {self.proc.poll()})")
            if select.select([self.proc.stdout], [], [], min(remaining, 0.2))[0]:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    continue
                line += chunk
        ready = json.loads(line)
        if ready.get("event") != "ready":
            raise RuntimeError(f"unexpected first line: {line[:200]!r}")
        return ready

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self._token_path)


class Session:
    """A raw protocol connection; calls are sent one at a time."""

    def __init__(self, ws: ClientConnection):
        self.ws = ws
        self.call_id = 0

    async def call(self, verb: str, **args) -> protocol.Reply:
        self.call_id += 1
        await self.ws.send(protocol.encode_call(self.call_id, verb, args))
        while True:
            msg = protocol.decode_server_message(await self.ws.recv())
            if isinstance(msg, protocol.Reply) and msg.call_id == self.call_id:
                if msg.outcome != protocol.OK:
                    raise RuntimeError(f"{verb} failed: {msg.error}")
                return msg


Change = Callable[[Session, int], Awaitable[None]]


def _changes(backend: str) -> dict[str, Change]:
    async def small(s: Session, i: int) -> None:
        await s.call("type", text="abcdefghijklmnopqrstuvwxyz"[i % 26])
        if i % 50 == 49:  # keep the field (and the xterm line) from filling up
            await s.call("key", combo="ctrl+u" if backend == "xvfb" else "Return")
        if backend == "xvfb":
            await s.call("wait_stable", stable_ms=40, timeout_ms=5000)

    async def large(s: Session, i: int) -> None:
        if backend == "xvfb":
            await s.call("type", text="clear\n" if i % 2 else "seq 1 100\n")
            await s.call("wait_stable", stable_ms=60, timeout_ms=5000)
        else:  # the Notes window's title bar between (800, 60) and (200, 360)
            start, end = ((900, 75), (300, 375)) if i % 2 == 0 else ((300, 375), (900, 75))
            await s.call("drag", x0=start[0], y0=start[1], x1=end[0], y1=end[1])
            await s.call("type", text="abcdefghijklmnopqrstuvwxyz"[i % 26])  # a new state every time

    async def unchanged(s: Session, i: int) -> None:
        return None

    return {"small change": small, "large change": large, "unchanged": unchanged}


async def measure(url: str, token: str, change: Change, shot: dict, samples: int) -> tuple[list[float], list[int]]:
    latencies: list[float] = []
    sizes: list[int] = []
    headers = {"Authorization": f"Bearer {token}"}
    async with connect(url, additional_headers=headers, compression=None, max_size=protocol.MAX_MESSAGE_SIZE) as ws:
        protocol.decode_server_message(await ws.recv())  # hello
        session = Session(ws)
        for i in range(samples + WARMUP):
            await change(session, i)
            start = time.perf_counter()
            reply = await session.call("screenshot", **shot)
            elapsed_ms = (time.perf_counter() - start) * 1000
            if i >= WARMUP:
                latencies.append(elapsed_ms)
                sizes.append(len(reply.image))
    return latencies, sizes


async def _prepare_xterm(url: str, token: str) -> None:
    """Fill the terminal with text, like a text-heavy reference screen."""
    headers = {"Authorization": f"Bearer {token}"}
    async with connect(url, additional_headers=headers, compression=None, max_size=protocol.MAX_MESSAGE_SIZE) as ws:
        protocol.decode_server_message(await ws.recv())
        s = Session(ws)
        await s.call("wait_stable", stable_ms=300, timeout_ms=10_000)
        await s.call("type", text="ls -la /usr/lib/*/ /usr/bin | head -n 78\n")
        await s.call("wait_stable", stable_ms=300, timeout_ms=10_000)


def _p95(values: list[float]) -> float:
    return percentile(values, 95)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="virtual,xvfb")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--screen", default="1920x1080")
    parser.add_argument("--long-edge", type=int, default=1280)
    args = parser.parse_args()
    edge = args.long_edge
    cases = [
        ("small change", {"format": "jpeg", "quality": 80, "max_long_edge": edge}),
        ("small change", {"format": "png", "max_long_edge": edge}),
        ("small change", {"format": "jpeg", "quality": 80}),
        ("large change", {"format": "jpeg", "quality": 80, "max_long_edge": edge}),
        ("unchanged", {"format": "jpeg", "quality": 80, "max_long_edge": edge}),
    ]
    print(f"screenshot round trip through shinkend, {args.screen} screen, loopback, "
          f"{args.samples} samples per line, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for backend in args.backends.split(","):
        if backend == "xvfb" and not all(shutil.which(p) for p in ("Xvfb", "xdotool", "xterm")):
            print("xvfb: skipped (needs Xvfb, xdotool and xterm installed)")
            continue
        extra = ["--launch", XTERM] if backend == "xvfb" else []
        daemon = Daemon(backend, args.screen, extra)
        try:
            url = daemon.ready["url"]
            if backend == "xvfb":
                asyncio.run(_prepare_xterm(url, daemon.token))
            changes = _changes(backend)
            for scenario, shot in cases:
                lat, sizes = asyncio.run(measure(url, daemon.token, changes[scenario], shot, args.samples))
                size = f"-> {edge}" if "max_long_edge" in shot else "full size"
                label = f"{scenario}, {shot['format']} {size}"
                line = (f"{backend:8} {label:32} p50 {percentile(lat, 50):6.1f} ms  p95 {_p95(lat):6.1f} ms  "
                        f"frame {statistics.mean(sizes) / 1024:6.1f} KiB")  # fmt: skip
                if (scenario, shot["format"], "max_long_edge" in shot) == ("small change", "jpeg", True):
                    goal = TARGET_P50_MS[backend]
                    line += f"  (target p50 <= {goal:.0f} ms: {'met' if percentile(lat, 50) <= goal else 'MISSED'})"
                print(line, flush=True)
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()
