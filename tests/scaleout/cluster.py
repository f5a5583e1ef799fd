"""A real multi-node Ray cluster over :class:`~tests.scaleout.hosts.Hosts`: one node per namespace.

Every node is started with ``--node-ip-address`` = its namespace address (Ray would otherwise
advertise the machine's own address), a small footprint (``--num-cpus 1``, 100 MB object
store, no dashboard, no usage stats) and ``--resources {"sandbox": N}``; node death is
detected fast (GCS health checks every 500 ms, 3 misses) so a killed node is declared dead
in seconds. ``--block`` keeps each ``ray start`` in the foreground: its node dies with it,
and :meth:`Hosts.close` kills whatever is left in the namespaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.scaleout.hosts import Hosts

RAY = str(Path(sys.executable).with_name("ray"))
HEAD_PORT = 6379  # inside the head's own namespace: no other process on the machine sees it
FAST_FAILURE_DETECTION = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
                          "RAY_health_check_initial_delay_ms": "0", "RAY_health_check_timeout_ms": "1000"}


def ray_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
            **FAST_FAILURE_DETECTION, **extra}


class RayCluster:
    """``nodes`` Ray nodes on ``hosts`` 0..nodes-1; the head on host 0."""

    def __init__(self, hosts: Hosts, tmp: Path, nodes: int = 3, sandboxes_per_node: int = 8):
        self.hosts, self.tmp = hosts, tmp
        self.address = f"{hosts.addresses[0]}:{HEAD_PORT}"
        self.procs: list[subprocess.Popen] = []
        common = ["--block", "--num-cpus", "1", "--object-store-memory", str(100 * 2**20),
                  "--disable-usage-stats", "--resources", json.dumps({"sandbox": sandboxes_per_node})]
        for i in range(nodes):
            ip = hosts.addresses[i]
            role = (["--head", "--port", str(HEAD_PORT), "--include-dashboard", "false",
                     "--temp-dir", str(tmp / "ray")] if i == 0 else ["--address", self.address])
            log = open(tmp / f"ray-node{i}.log", "w")  # noqa: SIM115 (the child's)
            self.procs.append(hosts.popen(i, [RAY, "start", "--node-ip-address", ip, *role, *common],
                                          env=ray_env(), stdout=log, stderr=subprocess.STDOUT))
            # One at a time: nodes sharing a session directory pick their socket and log
            # names on start-up, and two starting together can collide.
            self._wait_for(i + 1)

    def _wait_for(self, alive: int, timeout: float = 90.0) -> None:
        code = ("import ray,sys,time\n"
                f"ray.init(address={self.address!r}, _node_ip_address={self.hosts.addresses[0]!r},"
                " logging_level='error', log_to_driver=False)\n"
                "d=time.time()+float(sys.argv[2])\n"
                "while sum(n['Alive'] for n in ray.nodes())<int(sys.argv[1]) and time.time()<d: time.sleep(0.3)\n"
                "sys.exit(sum(n['Alive'] for n in ray.nodes())<int(sys.argv[1]))\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.hosts.run(0, [sys.executable, "-c", code, str(alive), "60"], env=ray_env(),
                               capture_output=True, text=True, timeout=timeout)
            if r.returncode == 0:
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(1)
        logs = "\n".join((self.tmp / f"ray-node{i}.log").read_text()[-1500:] for i in range(len(self.procs)))
        raise RuntimeError(f"Ray cluster: {alive} nodes not alive after {timeout:g} s\n{logs}")

    def driver(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """A driver process on the head's host (it must reach every node, and they it)."""
        env = ray_env(RAY_ADDRESS=self.address, SHINKEN_RAY_NODE_IP=self.hosts.addresses[0])
        return self.hosts.popen(0, argv, env=env, **kwargs)
