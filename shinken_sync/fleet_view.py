"""Forward a fleet's screens to the session server's viewer (its *Live fleet* page).

The process that owns the sandboxes publishes them: the session server never dials a
sandbox (it imports nothing of this SDK's client), and the frames come from the screencast
streams this process opens on its own connections, on its own :class:`SharedLoop`, under
that loop's frame budget. Per sandbox, one low-rate stream for the grid (``grid_fps``,
downscaled to ``grid_long_edge``; the daemon sends nothing while a screen is still); for the
one tile a browser has open (the server answers every push with that *focus*), one more
stream at ``focus_fps`` and ``focus_long_edge``, stopped when the tile is closed. Frames go
to the server from one plain thread over HTTP (keep-alive), newest frame per tile only, the
grid's batched into one request per ``flush_interval`` (``shinken_sync.fleet_wire``), so a
slow viewer or server drops frames rather than queueing them, and never blocks the agents:
the screencasts read the screen without touching it, and their frames are encoded by the
daemon's screencast path, not in the agents' step calls.

Wire (docs/viewer.md): ``POST /ui/api/fleets`` registers ``{name, tiles: [{tile_id, label}]}``;
``POST /ui/api/fleets/<id>/frames`` with a batch of the newest frames; a heartbeat while
screens are still; ``DELETE`` at the end. Bearer auth when the server has a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests

from shinken_sync.errors import ShinkenError
from shinken_sync.fleet_wire import FrameItem, encode_batch

__all__ = ["FleetPublisher", "FleetViewError", "Tile"]

log = logging.getLogger(__name__)

# Without a frame for this long, a heartbeat: keeps the fleet registered (the server drops it
# after a minute) and learns of a tile opened while every screen is still.
HEARTBEAT_INTERVAL = 1.0
HTTP_TIMEOUT = (5.0, 15.0)


class FleetViewError(ShinkenError):
    """The viewer refused the fleet (bad key, no viewer at that URL, too many fleets)."""



@dataclass(frozen=True)
class Tile:
    tile_id: str
    label: str
    sandbox: Any  # a blocking ``shinken_sync.Sandbox`` on the publisher's loop


@dataclass
class _Pending:
    data: bytes
    mime: str
    width: int
    height: int


class FleetPublisher:
    """Publishes ``tiles`` to the viewer at ``server_url``; :meth:`start`, then :meth:`close`."""

    def __init__(self, server_url: str, tiles: Sequence[Tile], *, api_key: str | None = None,
                 name: str = "fleet", grid_fps: float = 1.0, grid_long_edge: int = 320, grid_quality: int = 60,
                 focus_fps: float = 10.0, focus_long_edge: int | None = 1280, focus_quality: int = 80,
                 flush_interval: float = 0.5) -> None:
        if not tiles:
            raise ValueError("a fleet needs at least one tile")
        self.server_url = server_url.rstrip("/")
        self.tiles = {t.tile_id: t for t in tiles}
        self.name = name
        self._grid = {"fps": grid_fps, "max_long_edge": grid_long_edge, "quality": grid_quality}
        self._focus_params = {"fps": focus_fps, "max_long_edge": focus_long_edge, "quality": focus_quality}
        self._http = requests.Session()
        if api_key:
            self._http.headers["Authorization"] = f"Bearer {api_key}"
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._focus: str | None = None  # the tile with a full-rate stream (the server's focus)
        self._focus_task: Any = None
        self._loop: Any = None
        self._pump: Any = None
        self._thread: threading.Thread | None = None
        self.fleet_id = ""
        self.flush_interval = flush_interval
        self.frames_sent = 0
        self.batches_sent = 0
        self.frames_dropped = 0  # replaced by a newer frame of the same tile before they were sent

    @property
    def viewer_url(self) -> str:
        return f"{self.server_url}/ui/fleet/{self.fleet_id}"

    def start(self) -> str:
        """Register the fleet and start forwarding; the fleet page's URL."""
        body: dict[str, Any] = {"name": self.name, "tiles": [{"tile_id": t.tile_id, "label": t.label} for t in self.tiles.values()]}
        try:
            reply = self._http.post(f"{self.server_url}/ui/api/fleets", json=body, timeout=HTTP_TIMEOUT)
        except requests.RequestException as exc:
            raise FleetViewError(f"cannot reach the viewer at {self.server_url}: {exc}") from exc
        if reply.status_code != 200:
            raise FleetViewError(f"the viewer refused the fleet: HTTP {reply.status_code} {reply.text[:200]}")
        self.fleet_id = reply.json()["fleet_id"]
        first = next(iter(self.tiles.values())).sandbox
        self._loop = first._shared  # the blocking facade's loop: the streams live beside the agents' calls
        self._pump = self._loop.submit(self._stream_all())
        self._thread = threading.Thread(target=self._post_loop, name="fleet-view", daemon=True)
        self._thread.start()
        return self.viewer_url

    # -- on the SharedLoop --------------------------------------------------------------------

    def _offer(self, tile_id: str, frame: Any, focus: bool) -> None:
        if not focus and tile_id == self._focus:
            return  # the full-rate stream shows this tile
        with self._lock:
            if tile_id in self._pending:
                self.frames_dropped += 1
            self._pending[tile_id] = _Pending(frame.data, f"image/{frame.format}", frame.width, frame.height)
        if focus:
            self._wake.set()

    async def _read(self, tile: Tile, params: dict[str, Any], focus: bool) -> None:
        stream = None
        try:
            stream = await tile.sandbox._async.screencast(**params)
            while not self._stop.is_set():
                frame = await stream.next_frame()
                if frame is None:
                    return
                self._offer(tile.tile_id, frame, focus)
        except asyncio.CancelledError:
            raise
        except ShinkenError as exc:  # a dead or closed sandbox: its tile stays on its last frame
            log.info("screencast of %s ended: %s", tile.tile_id, exc)
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.stop(timeout=5.0)

    async def _stream_all(self) -> None:
        await asyncio.gather(*(self._read(t, self._grid, False) for t in self.tiles.values()),
                             return_exceptions=True)

    async def _refocus(self, tile_id: str | None) -> None:
        if self._focus_task is not None:
            self._focus_task.cancel()
            with contextlib.suppress(BaseException):
                await self._focus_task
            self._focus_task = None
        if tile_id is not None and tile_id in self.tiles:
            self._focus_task = asyncio.ensure_future(self._read(self.tiles[tile_id], self._focus_params, True))

    # -- the posting thread ---------------------------------------------------------------------

    def _apply_focus(self, focus: Any) -> None:
        focus = focus if isinstance(focus, str) and focus in self.tiles else None
        if focus != self._focus and not self._stop.is_set():
            self._focus = focus
            with contextlib.suppress(Exception):
                self._loop.submit(self._refocus(focus))

    def _post_loop(self) -> None:
        last_contact = time.monotonic()
        url = f"{self.server_url}/ui/api/fleets/{self.fleet_id}/frames"
        while not self._stop.is_set():
            # Grid frames wait for the next flush (one request for all of them); a focus frame
            # wakes the thread at once, so the opened tile keeps its full rate.
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            with self._lock:
                pending, self._pending = self._pending, {}
            if pending:
                batch = encode_batch([FrameItem(tile_id, f.mime, f.width, f.height, f.data)
                                      for tile_id, f in pending.items()])
                try:
                    reply = self._http.post(url, data=batch, headers={"Content-Type": "application/octet-stream"},
                                            timeout=HTTP_TIMEOUT)
                except requests.RequestException as exc:
                    log.warning("fleet view: %d frames not delivered: %s", len(pending), exc)
                    continue
                if reply.status_code == 200:
                    self.frames_sent += len(pending)
                    self.batches_sent += 1
                    last_contact = time.monotonic()
                    self._apply_focus(reply.json().get("focus"))
                else:
                    log.warning("fleet view: frames refused: HTTP %d %s", reply.status_code, reply.text[:200])
            if time.monotonic() - last_contact > HEARTBEAT_INTERVAL:
                # Still screens send nothing: keep the fleet registered, and learn of a newly opened tile.
                with contextlib.suppress(requests.RequestException, ValueError):
                    reply = self._http.post(f"{self.server_url}/ui/api/fleets/{self.fleet_id}/heartbeat",
                                            timeout=HTTP_TIMEOUT)
                    if reply.status_code == 200:
                        self._apply_focus(reply.json().get("focus"))
                last_contact = time.monotonic()

    def close(self) -> None:
        """Stop the streams and unregister the fleet (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._pump is not None:
            self._pump.cancel()
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self._refocus(None), 10)
        if self.fleet_id:
            with contextlib.suppress(requests.RequestException):
                self._http.delete(f"{self.server_url}/ui/api/fleets/{self.fleet_id}", timeout=HTTP_TIMEOUT)
        self._http.close()
