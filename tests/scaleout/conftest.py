"""Fixtures of the scale-out tests (marker ``scaleout``; tox env ``scaleout``): several
"hosts" as network namespaces (:mod:`tests.scaleout.hosts`), a Ray cluster over them
(:mod:`tests.scaleout.cluster`). Skipped, with the reason, when not root."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scaleout.cluster import RayCluster
from tests.scaleout.front import NGINX
from tests.scaleout.hosts import Hosts, can_make_hosts

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = can_make_hosts()
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.scaleout)
            item.add_marker(pytest.mark.integration)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    with Hosts(3) as h:
        yield h


@pytest.fixture(scope="module")
def ray_cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> RayCluster:
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    return RayCluster(hosts, tmp_path_factory.mktemp("ray"))


def require_nginx() -> None:
    if NGINX is None:
        pytest.skip("needs nginx (Debian package nginx; .ci/run installs it)")


def read_event(proc: subprocess.Popen, event: str) -> dict:
    """The next JSON line on ``proc``'s stdout that is ``event`` (fails on EOF with stderr)."""
    for line in proc.stdout:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("event") == event:
            return obj
    proc.wait(30)
    raise AssertionError(f"driver exited ({proc.returncode}) before {event!r}: {proc.stderr.read()[-3000:]}")


def driver(cluster: RayCluster, *argv: str) -> subprocess.Popen:
    return cluster.driver([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
