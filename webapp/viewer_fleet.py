"""Live fleets for the viewer: the latest frame of each sandbox a registered process drives.

The process that owns the sandboxes (``shinken demo --view``, or anything using
``shinken_sync.fleet_view.FleetPublisher``) registers its fleet and pushes frames; the server
keeps only the newest frame per tile (memory is bounded by tiles, never by time) and browsers
read them. The server never dials a sandbox, so it imports nothing of the SDK's client and
watching costs the agents nothing beyond the publisher's low-rate screencasts.

Browsers long-poll one tile's frame (``after=<seq>``: answered as soon as a newer frame is
here, or after ``wait`` seconds with the current one): that is the full-rate stream of the one
opened tile, and a tile asked for with ``live`` within :data:`FOCUS_TTL` seconds is the fleet's
*focus*, which every frame push answers so the publisher streams that tile at full rate. A
fleet without a push for :data:`FLEET_TTL` seconds is dropped. Imports nothing of the session
core; thread-safe (gevent-patched threads in the servers).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from webapp.errors import WebappError

__all__ = ["FLEET_TTL", "FOCUS_TTL", "FRAME_TYPES", "MAX_FLEETS", "MAX_FRAME_BYTES", "MAX_HUB_BYTES", "MAX_TILES", "Fleet",
           "FleetError", "FleetHub", "FleetNotFound", "FrameRefused"]

MAX_FLEETS = 16
MAX_TILES = 1024  # per fleet
MAX_FRAME_BYTES = 8 << 20
MAX_HUB_BYTES = 512 << 20  # every tile's newest frame together: what the hub may hold at most
FLEET_TTL = 60.0
FOCUS_TTL = 3.0
MAX_WAIT = 10.0  # the longest long-poll
FRAME_TYPES = frozenset({"image/jpeg", "image/png"})  # served back as such: never text/html
_MAX_LABEL = 200


class FleetError(WebappError):
    """The live-fleet branch of the webapp error tree (webapp.errors)."""

    status = 400


class FleetNotFound(FleetError):
    """No such fleet (never registered, unregistered, or silent past FLEET_TTL) or tile."""

    status = 404


class FrameRefused(FleetError):
    """A frame or registration the hub does not take (size, type, tile count, fleet count)."""

    status = 400


@dataclass
class Tile:
    tile_id: str
    label: str
    seq: int = 0
    mime: str = ""
    data: bytes = b""
    width: int = 0
    height: int = 0
    ts: float = 0.0
    watched: float = 0.0  # monotonic time a browser last asked for it live


@dataclass
class Fleet:
    fleet_id: str
    name: str
    tiles: dict[str, Tile]
    created: float = field(default_factory=time.time)
    pushed: float = field(default_factory=time.monotonic)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def focus(self, now: float) -> str | None:
        best = max(self.tiles.values(), key=lambda t: t.watched, default=None)
        return best.tile_id if best is not None and best.watched and now - best.watched < FOCUS_TTL else None

    def describe(self, now: float) -> dict[str, Any]:
        return {"fleet_id": self.fleet_id, "name": self.name, "created": self.created,
                "focus": self.focus(now),
                "tiles": [{"tile_id": t.tile_id, "label": t.label, "seq": t.seq, "width": t.width,
                           "height": t.height, "ts": t.ts} for t in self.tiles.values()]}


def _label(value: Any) -> str:
    return str(value)[:_MAX_LABEL]


class FleetHub:
    def __init__(self, max_bytes: int = MAX_HUB_BYTES) -> None:
        self._lock = threading.Lock()
        self._fleets: dict[str, Fleet] = {}
        self.max_bytes = max_bytes
        self.held = 0  # bytes of the frames held

    def _expire(self, now: float) -> None:
        for fid in [f for f, fleet in self._fleets.items() if now - fleet.pushed > FLEET_TTL]:
            self._drop(fid)

    def _drop(self, fleet_id: str) -> Fleet | None:
        fleet = self._fleets.pop(fleet_id, None)
        if fleet is not None:
            self.held -= sum(len(t.data) for t in fleet.tiles.values())
        return fleet

    def register(self, name: Any, tiles: Any) -> dict[str, Any]:
        """A new fleet of ``tiles`` (``[{"tile_id", "label"}]``); its description."""
        if not isinstance(tiles, list) or not tiles or len(tiles) > MAX_TILES:
            raise FrameRefused(f"tiles must be a list of 1..{MAX_TILES} objects")
        made: dict[str, Tile] = {}
        for t in tiles:
            if not isinstance(t, dict) or not isinstance(t.get("tile_id"), str) or not t["tile_id"]:
                raise FrameRefused("each tile needs a non-empty string tile_id")
            tid = _label(t["tile_id"])
            made[tid] = Tile(tid, _label(t.get("label", tid)))
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            if len(self._fleets) >= MAX_FLEETS:
                raise FrameRefused(f"{MAX_FLEETS} fleets registered already")
            fleet = Fleet(secrets.token_hex(8), _label(name or "fleet"), made)
            self._fleets[fleet.fleet_id] = fleet
        return fleet.describe(now)

    def get(self, fleet_id: str) -> Fleet:
        with self._lock:
            self._expire(time.monotonic())
            fleet = self._fleets.get(fleet_id)
        if fleet is None:
            raise FleetNotFound(f"no fleet {fleet_id[:40]!r} (gone, or never registered)")
        return fleet

    def unregister(self, fleet_id: str) -> None:
        with self._lock:
            if self._drop(fleet_id) is None:
                raise FleetNotFound(f"no fleet {fleet_id[:40]!r}")

    def fleets(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            found = list(self._fleets.values())
        return [{"fleet_id": f.fleet_id, "name": f.name, "created": f.created, "tiles": len(f.tiles)}
                for f in found]

    def push(self, fleet_id: str, tile_id: str, data: bytes, mime: str, width: int, height: int) -> dict[str, Any]:
        """Store a tile's newest frame; answers its seq and the fleet's focus (the tile to stream
        at full rate)."""
        seqs = self.push_many(fleet_id, [(tile_id, data, mime, width, height)])
        return {"seq": seqs[tile_id], "focus": self.get(fleet_id).focus(time.monotonic())}

    def push_many(self, fleet_id: str, frames: list[tuple[str, bytes, str, int, int]]) -> dict[str, int]:
        """Store several tiles' newest frames, all or none (each checked first); their seqs."""
        for _tile_id, data, mime, _w, _h in frames:
            if mime not in FRAME_TYPES:
                raise FrameRefused(f"frame type must be one of {sorted(FRAME_TYPES)}, got {mime[:60]!r}")
            if not data or len(data) > MAX_FRAME_BYTES:
                raise FrameRefused(f"a frame is 1..{MAX_FRAME_BYTES} bytes, got {len(data)}")
        fleet = self.get(fleet_id)
        latest = {f[0]: f for f in frames}  # a tile twice in one batch: its last frame
        with self._lock, fleet.changed:
            missing = [t for t in latest if t not in fleet.tiles]
            if missing:
                raise FleetNotFound(f"fleet {fleet_id} has no tile {missing[0][:40]!r}")
            grow = sum(len(f[1]) - len(fleet.tiles[t].data) for t, f in latest.items())
            if self.held + grow > self.max_bytes:
                raise FrameRefused(f"the viewer holds {self.held} bytes of frames (at most {self.max_bytes})")
            self.held += grow
            now, wall = time.monotonic(), time.time()
            for tile_id, data, mime, width, height in latest.values():
                tile = fleet.tiles[tile_id]
                tile.seq += 1
                tile.data, tile.mime, tile.width, tile.height, tile.ts = data, mime, width, height, wall
            fleet.pushed = now
            fleet.changed.notify_all()
            return {t: fleet.tiles[t].seq for t in latest}

    def heartbeat(self, fleet_id: str) -> dict[str, Any]:
        """Keep a fleet whose screens are still (no frames) registered; answers its focus."""
        fleet = self.get(fleet_id)
        now = time.monotonic()
        fleet.pushed = now
        return {"focus": fleet.focus(now)}

    def frame(self, fleet_id: str, tile_id: str, after: int = -1, wait: float = 0.0,
              live: bool = False) -> Tile:
        """The tile's frame once its seq is past ``after`` (or ``wait`` seconds passed)."""
        fleet = self.get(fleet_id)
        tile = fleet.tiles.get(tile_id)
        if tile is None:
            raise FleetNotFound(f"fleet {fleet_id} has no tile {tile_id[:40]!r}")
        if live:
            tile.watched = time.monotonic()
        deadline = time.monotonic() + min(max(wait, 0.0), MAX_WAIT)
        with fleet.changed:
            while tile.seq <= after:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                fleet.changed.wait(left)
            return Tile(tile.tile_id, tile.label, tile.seq, tile.mime, tile.data, tile.width, tile.height, tile.ts)
