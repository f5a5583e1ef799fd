"""Marginal RSS per sandbox, ours beside a thread-per-connection client, in one run.

For each client: dial all N sandboxes of the fleet host, take
:data:`SCREENSHOTS` JPEG q80 @1280 screenshots per sandbox (all sandboxes at
once, round after round, as a fleet would), then read ``VmRSS``.
Marginal = (after - before dialing) / N. The clients:

* ``sync``: the blocking facade, one gevent greenlet per sandbox, one SharedLoop;
* ``async``: ``AsyncSandbox`` + ``asyncio.gather`` on one loop;
* ``wsclient``: the thread-per-connection baseline the seed compares against:
  websocket-client (``websocket.create_connection``), one reader thread per
  connection parked in ``recv()`` handing replies to the caller.

The SDK clients run with the fleet GC helper (``tune_gc_for_fleet``) applied
after connecting, as docs/concurrency.md recommends for fleets.
"""

from __future__ import annotations

import gc
import json
import threading
from typing import Any

import procfs

SCREENSHOTS = 3
OBSERVE = {"format": "jpeg", "quality": 80, "max_long_edge": 1280}


def _settle() -> None:
    gc.collect()


def memory_sync(spec: dict[str, Any], rss: Any, callers: Any) -> dict[str, Any]:
    from shinken_sync.fleetgc import tune_gc_for_fleet
    from shinken_sync.sharedloop import SharedLoop
    from shinken_sync.sync import connect

    shared = SharedLoop()
    shared.loop  # noqa: B018 -- start the thread before the baseline
    _settle()
    before = rss()
    gate = threading.BoundedSemaphore(64)

    def dial(url: str) -> Any:
        with gate:
            return connect(url, token=spec["token"], loop=shared, ping_jitter=10.0)

    sandboxes = callers.map(dial, spec["urls"])
    tune_gc_for_fleet()
    connected = rss()
    for _ in range(SCREENSHOTS):
        callers.map(lambda sb: sb.screenshot(**OBSERVE), sandboxes)
    # gevent's Pool.map keeps the last result list in its finished map greenlet
    # until the hub has run that greenlet's link callbacks: let it, or every
    # sandbox's last screenshot is counted as ours.
    callers.sleep(0.01)
    _settle()
    after = rss()
    report = _report(spec, "sync", before, connected, after)
    callers.map(lambda sb: sb.close(), sandboxes)
    shared.close()
    return report


async def memory_async(spec: dict[str, Any], rss: Any) -> dict[str, Any]:
    import asyncio

    from shinken_sync.client import aconnect
    from shinken_sync.fleetgc import tune_gc_for_fleet

    _settle()
    before = rss()
    gate = asyncio.Semaphore(64)

    async def dial(url: str) -> Any:
        async with gate:
            return await aconnect(url, token=spec["token"], ping_jitter=10.0)

    sandboxes = await asyncio.gather(*(dial(u) for u in spec["urls"]))
    tune_gc_for_fleet()
    connected = rss()
    for _ in range(SCREENSHOTS):
        await asyncio.gather(*(sb.screenshot(**OBSERVE) for sb in sandboxes))
    # Measure from a fresh loop callback: the one that resumed us still holds
    # the gather's future, and so every screenshot of the last round.
    await asyncio.sleep(0)
    _settle()
    after = rss()
    report = _report(spec, "async", before, connected, after)
    await asyncio.gather(*(sb.close() for sb in sandboxes))
    return report


class _ThreadPerConnection:
    """One websocket-client connection and its parked reader thread."""

    def __init__(self, url: str, token: str) -> None:
        import websocket

        self.ws = websocket.create_connection(url, header=[f"Authorization: Bearer {token}"],
                                              enable_multithread=True)  # fmt: skip
        self.ws.recv()  # the hello
        self.replies: list[Any] = []
        self.ready = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.call_id = 0

    def _read(self) -> None:
        while True:
            try:
                message = self.ws.recv()
            except Exception:  # noqa: BLE001 -- closed: the thread ends
                return
            with self.ready:
                self.replies.append(message)
                self.ready.notify()

    def send_screenshot(self) -> None:
        self.call_id += 1
        self.ws.send(json.dumps({"type": "call", "call_id": self.call_id, "verb": "screenshot", "args": OBSERVE}))

    def wait_reply(self) -> Any:
        with self.ready:
            if not self.ready.wait_for(lambda: self.replies, timeout=60):
                raise TimeoutError("no screenshot reply within 60 s")
            return self.replies.pop()


def memory_wsclient(spec: dict[str, Any], rss: Any) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    _settle()
    before = rss()
    with ThreadPoolExecutor(64) as pool:  # bounded dialing; the pool's threads end before measuring
        conns = list(pool.map(lambda u: _ThreadPerConnection(u, spec["token"]), spec["urls"]))
    connected = rss()
    # Like a fleet round: every sandbox's call in flight at once; the reader threads receive.
    for _ in range(SCREENSHOTS):
        for conn in conns:
            conn.send_screenshot()
        for conn in conns:
            conn.wait_reply()
    _settle()
    after = rss()
    report = _report(spec, "wsclient", before, connected, after)
    for conn in conns:
        conn.ws.close()
    return report


def _report(spec: dict[str, Any], client: str, before: int, connected: int, after: int) -> dict[str, Any]:
    n = max(1, len(spec["urls"]))
    return {
        "n": spec["n"], "client": client, "screenshots_per_sandbox": SCREENSHOTS,
        "rss_before_bytes": before, "rss_connected_bytes": connected, "rss_after_bytes": after,
        "marginal_connect_bytes": (connected - before) / n, "marginal_steady_bytes": (after - before) / n,
        "threads": _native_threads(),
    }  # fmt: skip


def _native_threads() -> int:
    """OS threads of this process (under gevent, threading.active_count() counts greenlets)."""
    return int(procfs.status()["Threads"])
