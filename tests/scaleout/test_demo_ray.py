"""``shinken demo --ray`` end to end on a 3-node Ray cluster (one node per namespace), with
the session servers reached through nginx (two instances on hosts 0 and 1, nginx on host 0).

The driver is the demo process itself, run on the head's host. A healthy run writes the same
outputs as the single-process demo with consistent records; a run that loses node 2 mid-run
loses only the episodes of that node's sandboxes and driver actor, each marked with the cause.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.scaleout.conftest import require_nginx
from tests.scaleout.front import nginx_front

pytestmark = [pytest.mark.scaleout, pytest.mark.integration]

SANDBOXES = 6


@pytest.fixture(scope="module")
def front(hosts, ray_cluster):
    require_nginx()
    with nginx_front(hosts, ("east", "west")) as (nginx, _):
        yield nginx


def _demo(ray_cluster, hosts, nginx, out, turns: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shinken_sync.cli", "demo", "--ray", ray_cluster.address,
            "--node-ip", hosts.addresses[0], "--session-server", nginx.url, "--drivers", "3",
            "--sandboxes", str(SANDBOXES), "--turns", str(turns), "--out", str(out)]
    return ray_cluster.driver(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read(out) -> tuple[dict, list[dict]]:
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    return summary, lines


def _finish(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The demo's stderr once it exited; on ``timeout``, kill it and fail with that stderr (the
    one place that says where it hung), before pytest's own timeout would say nothing."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the demo did not exit {timeout:.0f} s after {what}:\n{proc.communicate()[1][-3000:]}")


def _wait_for_chats(nginx, proc, at_least: int) -> None:
    deadline = time.monotonic() + 120
    while sum("chat/completions" in line for line in nginx.access_log()) < at_least:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{at_least} chats never came (exit {proc.poll()}):\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_demo_in_ray_mode_end_to_end(ray_cluster, hosts, front, tmp_path):
    proc = _demo(ray_cluster, hosts, front, tmp_path, turns=3)
    stderr = _finish(proc, 240, "its start")
    assert proc.returncode == 0, stderr[-3000:]
    summary, lines = _read(tmp_path)
    assert summary["episodes"] == SANDBOXES and summary["steps"] == SANDBOXES * 3
    assert summary["consistent"] and not summary["episode_errors"]
    assert all(line["check"]["accumulated_matches_last_record"] and line["check"]["actions_match_records"]
               for line in lines)
    # Sandboxes on every node, sessions on both instances behind nginx.
    assert {line["sandbox"].split("@")[1] for line in lines} == set(hosts.addresses[:3])
    assert {line["session_id"].split("-")[0] for line in lines} == {"east", "west"}
    assert (tmp_path / "contact_sheet.png").exists()


@pytest.mark.timeout(240)
def test_ctrl_c_keeps_every_episodes_records_so_far(ray_cluster, hosts, front, tmp_path):
    before = sum("chat/completions" in line for line in front.access_log())
    proc = _demo(ray_cluster, hosts, front, tmp_path, turns=200)
    _wait_for_chats(front, proc, before + 2 * SANDBOXES)
    proc.send_signal(signal.SIGINT)
    stderr = _finish(proc, 60, "Ctrl-C")
    assert proc.returncode == 130, stderr[-3000:]
    summary, lines = _read(tmp_path)
    assert summary["interrupted"] and summary["episodes"] == SANDBOXES and summary["consistent"]
    assert all(line["interrupted"] and 0 < len(line["steps"]) < 200 for line in lines)


@pytest.mark.timeout(420)
def test_a_node_lost_mid_run_costs_only_its_episodes(ray_cluster, hosts, front, tmp_path):
    before = sum("chat/completions" in line for line in front.access_log())
    proc = _demo(ray_cluster, hosts, front, tmp_path, turns=30)
    _wait_for_chats(front, proc, before + 2 * SANDBOXES)  # the run is under way
    hosts.kill_host(2)
    stderr = _finish(proc, 280, "its node was lost")
    # episodes were lost; the run still finished and wrote its outputs
    assert proc.returncode == 1, stderr[-3000:]
    summary, lines = _read(tmp_path)
    lost_ip = hosts.addresses[2]
    errors = summary["episode_errors"]
    assert summary["episodes_started"] == SANDBOXES
    assert 2 <= len(errors) < SANDBOXES and summary["episodes"] == SANDBOXES - len(errors)
    for error in errors.values():
        assert error.startswith(("SandboxDied", "DriverLost")), error
        # Ray's cause: "...died..." once the GCS has declared the lost node's actor dead, or
        # ActorUnavailableError's "...is unavailable..." when the call fails before it has.
        assert "died" in error or "unavailable" in error, error
    # The lost node held one of the 3 spread driver actors: its share is marked DriverLost.
    assert sum(error.startswith("DriverLost") for error in errors.values()) == SANDBOXES // 3, errors
    assert all(lost_ip not in line["sandbox"] for line in lines)  # every sandbox of the lost node: an error
    assert summary["consistent"]
    assert all(len(line["steps"]) == 30 for line in lines)
