"""Hostile input, measured: records GETs while clients stall, worker memory per body in flight,
and session-create latency at 10k sessions. Each figure for the tree under test and, with
``--baseline TREE``, the same run against another source tree (e.g. ``git archive`` of main),
side by side.

    PYTHONPATH=. python bench/hostile_input.py [--only stall,rss,create] [--baseline DIR]

1. ``stall``: p50 of a records GET of a one-turn session, idle and while 64 clients hold GETs of a
   ~10 MiB session without reading (target: within 2x of idle).
2. ``rss``: 8 concurrent 60 MiB chat bodies (a message over max_message_bytes: each is read,
   parsed and refused, the most a body costs before the engine), single worker: the worker's
   peak RSS growth over the bytes in flight (target <= 1.3x), with the default budget and a
   128 MiB one.
3. ``create``: create p50 of 16 clients creating at once, with 0 and with 10,000 sessions on disk
   (target: within 1.5x).

Everything goes to one ``tempfile.mkdtemp`` directory, deleted at the end; loopback only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path

import psutil
import requests

from webapp.reference_backend import start_reference_backend
from webapp.serve import start_session_server

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
CREATE_CLIENTS, CREATE_CALLS = 16, 800  # a create storm: 16 clients at once


def server(tree: Path, workers: int, backend_url: str, data: Path, *extra: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    env["PYTHONPATH"] = str(tree)
    return start_session_server(workers, backend_url, "127.0.0.1:0", "--data-dir", str(data), *extra, env=env)


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def conversation(url: str, sid: str, texts: list[str]) -> None:
    messages: list[dict] = []
    for text in texts:
        messages.append({"role": "user", "content": text})
        resp = requests.post(f"{url}/sessions/{sid}/v1/chat/completions", timeout=120, json={"messages": messages})
        resp.raise_for_status()
        messages.append(resp.json()["choices"][0]["message"])


def bench_stall(tree: Path, tmp: Path) -> dict:
    backend = start_reference_backend(r3_layers=256, r3_topk=8)
    srv = server(tree, 1, backend.url, tmp / "stall", "--routing-replay-layers", "256")
    try:
        url = srv.url
        big = requests.post(f"{url}/sessions", timeout=30).json()["session_id"]
        conversation(url, big, ["heavy step 0: " + "click the button on the screen " * 12,
                                "heavy step 1: " + "click the button on the screen " * 12])
        small = requests.post(f"{url}/sessions", timeout=30).json()["session_id"]
        conversation(url, small, ["small step 0: click the button on the screen "])
        size = len(requests.get(f"{url}/sessions/{big}", timeout=60).content)
        small_size = len(requests.get(f"{url}/sessions/{small}", timeout=60).content)

        def gets(n: int) -> list[float]:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                try:
                    requests.get(f"{url}/sessions/{small}", timeout=30).raise_for_status()
                except requests.RequestException:
                    out.append(30.0)  # no answer within the timeout: counted as 30 s
                    continue
                out.append(time.perf_counter() - t)
            return out

        idle = gets(50)
        host, port = url.rsplit("/", 1)[1].split(":")
        stalled = []
        for _ in range(64):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(f"GET /sessions/{big} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            stalled.append(sock)
        time.sleep(2.0)
        loaded = gets(50 if tree == REPO else 3)
        for sock in stalled:
            sock.close()
        return {"big_get_bytes": size, "small_get_bytes": small_size, "idle_p50_ms": p50(idle), "stalled_p50_ms": p50(loaded),
                "ratio": p50(loaded) / p50(idle)}
    finally:
        srv.close()
        backend.close()


def bench_rss(tree: Path, tmp: Path, budget: int | None) -> dict:
    backend = start_reference_backend()
    extra = ["--max-inflight-bytes", str(budget)] if budget else []
    srv = server(tree, 1, backend.url, tmp / f"rss{budget}", *extra)
    try:
        url = srv.url
        worker = next(p for p in psutil.Process(srv.pid).children(recursive=True)
                      if "shinken-session-worker" in " ".join(p.cmdline()))
        sid = requests.post(f"{url}/sessions", timeout=30).json()["session_id"]
        body = json.dumps({"messages": [{"role": "user", "content": "a" * (60 * MiB)}]}).encode()
        base = worker.memory_info().rss
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], worker.memory_info().rss)
                stop.wait(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        barrier = threading.Barrier(8)

        def send(_: int) -> int:
            barrier.wait()
            return requests.post(f"{url}/sessions/{sid}/v1/chat/completions", data=body, timeout=300,
                                 headers={"Content-Type": "application/json", "Connection": "close"}).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            statuses = sorted(pool.map(send, range(8)))
        stop.set()
        sampler.join()
        admitted = sum(1 for s in statuses if s != 503)
        in_flight = min(8, budget // len(body) if budget else 8) * len(body)
        return {"budget": budget, "statuses": statuses, "admitted": admitted, "in_flight_bytes": in_flight,
                "worker_base_mib": base / MiB, "worker_peak_mib": peak[0] / MiB,
                "growth_over_in_flight": (peak[0] - base) / in_flight}
    finally:
        srv.close()
        backend.close()


def _journal(sid: str) -> bytes:
    payload = json.dumps({"session_id": sid, "created_at": time.time()}).encode()
    entry = struct.pack("<QBI", len(payload), 1, zlib.crc32(bytes((1,)) + payload)) + payload
    return b"SHKJ" + struct.pack("<I", 1) + entry


def bench_create(tree: Path, tmp: Path, existing: int) -> dict:
    backend = start_reference_backend()
    data = tmp / f"create{existing}"
    (data / "sessions").mkdir(parents=True)
    os.chmod(data, 0o700)
    os.chmod(data / "sessions", 0o700)
    for _ in range(existing):  # sessions already on disk: the server loads them at start
        sid = uuid.uuid4().hex
        path = data / "sessions" / f"{sid}.journal"
        path.write_bytes(_journal(sid))
        path.chmod(0o600)
    srv = server(tree, 2, backend.url, data, "--max-sessions", "100000")
    try:
        url = srv.url
        local = threading.local()

        def one(_: int) -> float:
            http = getattr(local, "http", None) or requests.Session()
            local.http = http
            t = time.perf_counter()
            http.post(f"{url}/sessions", timeout=60).raise_for_status()
            return time.perf_counter() - t

        with concurrent.futures.ThreadPoolExecutor(CREATE_CLIENTS) as pool:
            list(pool.map(one, range(100)))  # warm-up: connections, the usage count, the page cache
            took = list(pool.map(one, range(CREATE_CALLS)))
        return {"sessions_on_disk": existing, "clients": CREATE_CLIENTS, "create_p50_ms": p50(took),
                "create_p90_ms": sorted(took)[int(0.9 * len(took))] * 1e3}
    finally:
        srv.close()
        backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="stall,rss,create")
    parser.add_argument("--baseline", type=Path, default=None, help="another source tree, run the same way")
    args = parser.parse_args()
    trees = [("this tree", REPO)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    only = set(args.only.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    report: dict = {}
    try:
        for label, tree in trees:
            out: dict = {}
            if "stall" in only:
                out["stall"] = bench_stall(tree, tmp / label.replace(" ", "-"))
                print(label, "stall", json.dumps(out["stall"]), flush=True)
            if "rss" in only:
                out["rss"] = [bench_rss(tree, tmp / label.replace(" ", "-"), b)
                              for b in ((None, 128 * MiB) if tree == REPO else (None,))]
                print(label, "rss", json.dumps(out["rss"]), flush=True)
            if "create" in only:
                out["create"] = [bench_create(tree, tmp / label.replace(" ", "-"), n) for n in (0, 10_000)]
                c0, c1 = out["create"]
                out["create_ratio"] = c1["create_p50_ms"] / c0["create_p50_ms"]
                print(label, "create", json.dumps(out["create"]), f"ratio x{out['create_ratio']:.2f}", flush=True)
            report[label] = out
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
