"""The live fleet end to end: real virtual sandboxes (a shinkend ``--fleet`` host), the real
session server, ``FleetPublisher`` forwarding their screencasts, and ``shinken demo --view``."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests
from PIL import Image

import shinken_sync
from shinken_sync.fleet_view import FleetPublisher, FleetViewError, Tile
from webapp.serve import start_session_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server_url(tmp_path_factory) -> Iterator[str]:
    server = start_session_server(0, None, "127.0.0.1:0", "--data-dir", str(tmp_path_factory.mktemp("data")),
                                  log_path=tmp_path_factory.mktemp("log") / "server.log")
    try:
        yield server.url
    finally:
        server.close(timeout=15)


def _tiles(url: str) -> dict[str, dict]:
    fid = url.rsplit("/", 1)[1]
    return {t["tile_id"]: t for t in requests.get(f"{url.split('/ui/')[0]}/ui/api/fleets/{fid}",
                                                   timeout=10).json()["tiles"]}


def _wait(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition never held")


def test_publisher_forwards_low_rate_grid_and_full_rate_focus(server_url: str, fleet_host) -> None:
    sandboxes = [shinken_sync.connect(url, fleet_host.token) for url in fleet_host.urls]
    try:
        before = [sb.screenshot(format="png").data for sb in sandboxes]
        publisher = FleetPublisher(server_url, [Tile(f"sb{i}", f"sandbox {i}", sb) for i, sb in enumerate(sandboxes)],
                                   name="test", grid_long_edge=200, focus_long_edge=None)
        fleet_url = publisher.start()
        try:
            assert requests.get(fleet_url, timeout=10).status_code == 200
            def all_shown() -> dict | None:
                tiles = _tiles(fleet_url)
                return tiles if all(t["seq"] >= 1 for t in tiles.values()) else None
            tiles = _wait(all_shown)
            assert len(tiles) == len(sandboxes)
            assert all(max(t["width"], t["height"]) <= 200 for t in tiles.values())  # downscaled for the grid
            fid = publisher.fleet_id
            frame = requests.get(f"{server_url}/ui/api/fleets/{fid}/tiles/sb0/frame", timeout=10)
            assert frame.headers["Content-Type"] == "image/jpeg"
            assert max(Image.open(io.BytesIO(frame.content)).size) <= 200
            # A browser opens tile sb1: the publisher streams it at full size from then on.
            def full_size() -> bool:
                got = requests.get(f"{server_url}/ui/api/fleets/{fid}/tiles/sb1/frame?live=1", timeout=10)
                return int(got.headers.get("X-Frame-Width", 0)) > 200
            _wait(full_size)
            assert publisher._focus == "sb1"
            # Watching changes nothing the agents see.
            after = [sb.screenshot(format="png").data for sb in sandboxes]
            assert after == before
        finally:
            publisher.close()
        assert requests.get(f"{server_url}/ui/api/fleets/{publisher.fleet_id}", timeout=10).status_code == 404
    finally:
        for sb in sandboxes:
            sb.close()


def test_publisher_refuses_a_server_without_a_viewer() -> None:
    with pytest.raises(FleetViewError):
        FleetPublisher("http://127.0.0.1:9", [Tile("a", "a", None)]).start()


@pytest.mark.timeout(300)
def test_demo_view_prints_the_url_and_stays_up_until_ctrl_c(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "shinken_sync.cli", "demo", "--sandboxes", "2", "--turns", "2",
                             "--view", "--out", str(tmp_path / "out")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        fleet_url = None
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            match = re.search(r"live fleet: (http://\S+)\)", line)
            if match:
                fleet_url = match.group(1)
            if "the viewer stays up" in line:
                break
        assert fleet_url is not None, "".join(lines)
        base = fleet_url.split("/ui/")[0]
        time.sleep(1.0)
        assert proc.poll() is None  # still up after the episodes
        sessions = requests.get(f"{base}/ui/api/sessions", timeout=10).json()
        assert sessions["total"] == 2 and all(s["turns"] == 2 for s in sessions["sessions"])
        assert requests.get(fleet_url, timeout=10).status_code == 200
        assert all(t["seq"] >= 1 for t in _tiles(fleet_url).values())
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert (tmp_path / "out" / "trajectories.jsonl").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
