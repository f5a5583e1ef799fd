"""--rtt-ms emulation and --fleet mode."""

from __future__ import annotations

import time

import pytest
from websockets.exceptions import InvalidStatus

from shinken_sync import protocol

pytestmark = pytest.mark.integration

RTT_MS = 300
#: Pipelined calls in one test: held one behind another they take at least
#: CALLS x RTT, overlapped about one RTT, so many calls leave a wide margin.
CALLS = 10


@pytest.fixture(scope="module")
def slow_daemon(module_shinkend):
    return module_shinkend(rtt_ms=RTT_MS)


def test_each_reply_is_held_for_the_rtt(slow_daemon, aci):
    client = aci(slow_daemon.url, slow_daemon.token)
    start = time.monotonic()
    for _ in range(3):
        client.ok("screen_size")
    # A lower bound only: the daemon must hold every reply at least RTT_MS.
    assert time.monotonic() - start >= 3 * RTT_MS / 1000


def test_pipelined_calls_are_not_held_behind_each_other(slow_daemon, aci):
    client = aci(slow_daemon.url, slow_daemon.token)
    start = time.monotonic()
    sent = [client.send("move", x=10 + i, y=10) for i in range(CALLS)]
    replies = [client.recv_reply() for _ in sent]
    elapsed = time.monotonic() - start
    assert [r.call_id for r in replies] == sent
    assert all(r.outcome == protocol.OK for r in replies)
    assert elapsed >= RTT_MS / 1000
    # Held one behind another, these take at least CALLS x RTT; overlapped, about
    # one RTT. The bound sits one RTT below the serial floor, so broken pipelining
    # always fails it, and leaves (CALLS - 2) x RTT (2.4 s) for a loaded machine.
    assert elapsed < (CALLS - 1) * RTT_MS / 1000, elapsed


def test_fleet_serves_each_sandbox_on_its_own_path(fleet_host, aci):
    assert len(fleet_host.urls) == 4 and len(set(fleet_host.urls)) == 4
    assert [u.rsplit("/", 2)[-2:] for u in fleet_host.urls] == [["sb", str(i)] for i in range(4)]
    clients = [aci(url, fleet_host.token) for url in fleet_host.urls]
    assert len({c.hello.sandbox_id for c in clients}) == 4
    for i, client in enumerate(clients):
        client.ok("move", x=100 + i, y=50)
    for i, client in enumerate(clients):
        assert client.ok("cursor") == {"x": 100 + i, "y": 50}  # state is per sandbox


def test_fleet_sandboxes_in_the_same_state_share_frames(fleet_host, aci):
    a, b = (aci(url, fleet_host.token) for url in fleet_host.urls[2:4])
    for client in (a, b):
        client.ok("move", x=640, y=400)
    shot_a = a.call("screenshot", max_long_edge=640)
    shot_b = b.call("screenshot", max_long_edge=640)
    assert bytes(shot_a.image) == bytes(shot_b.image)


def test_fleet_refuses_paths_past_the_last_sandbox(fleet_host, aci):
    base = fleet_host.url.rsplit("/sb/", 1)[0]
    with pytest.raises(InvalidStatus) as info:
        aci(f"{base}/sb/4", fleet_host.token)
    assert info.value.response.status_code == 404
    with pytest.raises(InvalidStatus) as info:
        aci(fleet_host.urls[1], "not-the-token")
    assert info.value.response.status_code == 401
