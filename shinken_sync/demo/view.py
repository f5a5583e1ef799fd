"""``shinken demo --view``: the demo's sandboxes on the session server's viewer, live.

The demo owns the sandboxes, their SharedLoop and its frame budget, so it is the process that
publishes them (``shinken_sync.fleet_view``): low-rate downscaled screencasts for the grid, a
full-rate one for the tile a browser opens. The viewer's URL is printed at the start; when the
episodes are done, the server, the sandboxes and the viewer stay up until Ctrl-C.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from shinken_sync.fleet_view import FleetPublisher, Tile

__all__ = ["hold", "start"]


def start(server_url: str, sandboxes: Sequence[Any], labels: Sequence[str],
          api_key: str | None = None) -> FleetPublisher:
    tiles = [Tile(f"sb{i}", label, sb) for i, (sb, label) in enumerate(zip(sandboxes, labels))]
    publisher = FleetPublisher(server_url, tiles, api_key=api_key, name=f"shinken demo ({len(tiles)} sandboxes)")
    fleet_url = publisher.start()
    print(f"shinken demo: viewer at {server_url}/ui/  (live fleet: {fleet_url})", file=sys.stderr, flush=True)
    return publisher


def hold(publisher: FleetPublisher, interrupted: Callable[[], bool]) -> None:
    """Keep everything up until ``interrupted()`` (the demo's Ctrl-C count), then stop publishing."""
    print(f"shinken demo: episodes done; the viewer stays up at {publisher.server_url}/ui/ until Ctrl-C",
          file=sys.stderr, flush=True)
    try:
        while not interrupted():
            time.sleep(0.2)
    finally:
        publisher.close()
