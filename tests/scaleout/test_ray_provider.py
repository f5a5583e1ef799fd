"""RayProvider on a real 3-node Ray cluster, one node per network namespace (tests/scaleout/hosts.py).

The driver runs on the head's host (tests/scaleout/ray_provider_driver.py); the node loss
test kills every process of one host mid-run (its raylet, its workers, its daemons).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.scaleout.conftest import driver, read_event

pytestmark = [pytest.mark.scaleout, pytest.mark.integration]

DRIVER = str(Path(__file__).with_name("ray_provider_driver.py"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"shinken_sync.daemon.server" in f.read()
    except FileNotFoundError:
        return False


def test_pack_puts_the_sandboxes_on_one_node(ray_cluster):
    proc = driver(ray_cluster, DRIVER, "pack", "3")
    placed = read_event(proc, "placed")
    assert len(placed["nodes"]) == 1 and sum(placed["nodes"].values()) == 3
    assert proc.wait(60) == 0


def test_a_request_no_node_can_hold_is_a_clear_error_not_a_hang(ray_cluster):
    proc = driver(ray_cluster, DRIVER, "unplaceable")
    err = read_event(proc, "error")
    assert err["type"] == "ProviderError"
    assert "could not place" in err["message"] and "sandbox" in err["message"]
    assert proc.wait(60) == 0


def test_fleet_hosts_serve_k_sandboxes_each_and_go_when_their_last_sandbox_is_destroyed(ray_cluster):
    proc = driver(ray_cluster, DRIVER, "fleet", "6")
    placed = read_event(proc, "placed")
    pids = {s["pid"] for s in placed["sandboxes"]}
    assert len(placed["sandboxes"]) == 6 and len(pids) == 2  # ceil(6 / 4) hosts
    assert all(read_event(proc, "stepped")["liveness"])
    read_event(proc, "destroyed")
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not [pid for pid in pids if _alive(pid)], "a fleet host outlived its last sandbox"
    refilled = read_event(proc, "placed")
    assert {s["pid"] for s in refilled["sandboxes"]}.isdisjoint(pids)
    assert read_event(proc, "refilled")["outcome"] == "ok"
    assert proc.wait(60) == 0


def test_a_killed_driver_leaves_no_sandbox_running(ray_cluster):
    proc = driver(ray_cluster, DRIVER, "hold", "3")
    placed = read_event(proc, "placed")
    pids = [s["pid"] for s in placed["sandboxes"]]
    assert len(placed["nodes"]) == 3 and all(_alive(pid) for pid in pids)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in pids if _alive(pid)], "shinkend daemons outlived their killed driver"


def test_a_killed_sandbox_actor_is_sandbox_died_with_rays_cause(ray_cluster):
    """The actor's worker process dies (its node lives on): its daemon dies with it, and the
    SDK's probe turns the lost connection into SandboxDied with Ray's cause."""
    proc = driver(ray_cluster, DRIVER, "spread", "2")
    try:
        placed = read_event(proc, "placed")
        read_event(proc, "connected")
        victim = placed["sandboxes"][0]
        with open(f"/proc/{victim['pid']}/status") as f:
            actor_pid = int(f.read().split("PPid:")[1].split()[0])
        with open(f"/proc/{actor_pid}/cmdline", "rb") as f:
            assert b"SandboxHostActor" in f.read()
        os.kill(actor_pid, signal.SIGKILL)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        results = read_event(proc, "result")["results"]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    dead, alive = results[victim["id"]], results[placed["sandboxes"][1]["id"]]
    assert dead.get("error") == "SandboxDied" and "ray actor died" in dead["detail"], dead
    assert "error" not in alive and alive["steps"] > 0, alive


def test_sandboxes_spread_and_a_lost_node_costs_only_its_sandboxes(ray_cluster, hosts):
    # Last in this module: the cluster keeps two nodes after it.
    proc = driver(ray_cluster, DRIVER, "spread", "6")
    try:
        placed = read_event(proc, "placed")
        assert set(placed["nodes"]) == set(hosts.addresses[:3]), placed["nodes"]
        assert all(count == 2 for count in placed["nodes"].values())
        read_event(proc, "connected")
        lost = hosts.addresses[2]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(2.0)  # the steps are under way (they run for RUN_S = 8 s)
        hosts.kill_host(2)  # the node "loses power": raylet, workers and daemons at once
        results = read_event(proc, "result")["results"]
        read_event(proc, "closed")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    on_lost = {sid: r for sid, r in results.items() if r["node_ip"] == lost}
    others = {sid: r for sid, r in results.items() if r["node_ip"] != lost}
    assert len(on_lost) == 2 and len(others) == 4
    for sid, r in on_lost.items():
        assert r.get("error") == "SandboxDied", (sid, r)
        assert lost in r["detail"] and "died" in r["detail"], r  # Ray's cause, with the node
    for sid, r in others.items():
        assert "error" not in r and r["steps"] > 0, (sid, r)
