"""Scale-out figures: demo throughput over Ray driver actors, and the nginx hop per chat.

    sudo PYTHONPATH=$PWD python bench/scaleout.py [--sandboxes 12] [--turns 8] [--chats 400]

1. ``shinken demo`` steps/s, in one run, side by side: the single-process demo, then
   ``shinken demo --ray`` with 1, 2 and 3 driver actors on a 3-node Ray cluster whose nodes
   are network namespaces of this machine (tests/scaleout: needs root). Same sandboxes,
   turns and session server (2 workers, started by the demo) each time. On a 2-core machine
   every node shares the same two cores, so this measures the cost and overlap of the
   distribution, not a speed-up from more hardware.
2. The nginx hop: one session server instance on loopback, nginx (config from
   ``shinken-session-server nginx-config``) in front of it on loopback; chat turns alternate
   direct / through nginx on keep-alive connections, each on a fresh session; p50 / p99 of
   each and of the difference.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from scratch import scratch_state_home

from webapp.serve import start_session_server

BODY = {"model": "reference", "messages": [{"role": "user", "content": "Click the OK button."}]}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def demo_throughput(sandboxes: int, turns: int) -> dict[str, float]:
    from tests.scaleout.cluster import RayCluster
    from tests.scaleout.hosts import Hosts

    results: dict[str, float] = {}
    tmp = Path(tempfile.mkdtemp(prefix="shinken-bench-scaleout-"))
    common = ["--sandboxes", str(sandboxes), "--turns", str(turns), "--workers", "2"]
    out = tmp / "single"
    subprocess.run([sys.executable, "-m", "shinken_sync.cli", "demo", *common, "--out", str(out)], check=True,
                   capture_output=True)
    results["single process"] = json.loads((out / "summary.json").read_text())["steps_per_s"]
    with Hosts(3) as hosts:
        cluster = RayCluster(hosts, tmp, nodes=3, sandboxes_per_node=sandboxes)
        for k in (1, 2, 3):
            out = tmp / f"ray{k}"
            proc = cluster.driver([sys.executable, "-m", "shinken_sync.cli", "demo", "--ray", cluster.address,
                                   "--node-ip", hosts.addresses[0], "--drivers", str(k), *common,
                                   "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"ray demo with {k} drivers failed: {err.decode()[-2000:]}")
            results[f"ray, {k} driver actor{'s' if k > 1 else ''}"] = json.loads(
                (out / "summary.json").read_text())["steps_per_s"]
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nginx_hop(chats: int) -> dict[str, float]:
    from tests.scaleout.front import NGINX

    server = start_session_server(2, None, "127.0.0.1:0", "--instance", "solo")
    prefix = Path(tempfile.mkdtemp(prefix="shinken-bench-nginx-"))
    prefix.chmod(0o755)
    nginx = None
    try:
        direct = server.url
        port = _free_port()
        conf = prefix / "nginx.conf"
        subprocess.run([sys.executable, "-m", "webapp.serve", "nginx-config", f"solo={direct[len('http://'):]}",
                        "--listen", f"127.0.0.1:{port}", "--full", str(prefix), "--out", str(conf)], check=True)
        nginx = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(conf)], stderr=subprocess.DEVNULL)
        front = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                requests.get(front + "/health", timeout=2)
                break
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        times: dict[str, list[float]] = {"direct": [], "nginx": []}
        clients = {"direct": (requests.Session(), direct), "nginx": (requests.Session(), front)}
        for i in range(chats * 2 + 20):
            name = ("direct", "nginx")[i % 2]
            http, base = clients[name]
            sid = http.post(base + "/sessions", timeout=30).json()["session_id"]
            t0 = time.perf_counter()
            reply = http.post(f"{base}/sessions/{sid}/v1/chat/completions", json=BODY, timeout=60)
            elapsed = time.perf_counter() - t0
            reply.raise_for_status()
            if i >= 20:  # warm-up: connections, the workers' first turns
                times[name].append(elapsed)
        result = {}
        for name, values in times.items():
            result[f"{name} p50 ms"] = round(_pct(values, 50) * 1e3, 2)
            result[f"{name} p99 ms"] = round(_pct(values, 99) * 1e3, 2)
        result["added p50 ms"] = round(result["nginx p50 ms"] - result["direct p50 ms"], 2)
        result["added p99 ms"] = round(result["nginx p99 ms"] - result["direct p99 ms"], 2)
        return result
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(15)
        server.close()
        shutil.rmtree(prefix, ignore_errors=True)


def main() -> None:
    scratch_state_home()  # the servers' journals go to a temporary directory
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=12)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--chats", type=int, default=400, help="timed chats per path for the nginx hop")
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    print(json.dumps({"nginx_hop": nginx_hop(args.chats)}, indent=2), flush=True)
    if not args.skip_demo:
        print(json.dumps({"demo_steps_per_s": demo_throughput(args.sandboxes, args.turns)}, indent=2), flush=True)


if __name__ == "__main__":
    main()
