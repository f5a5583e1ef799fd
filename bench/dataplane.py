"""Data-plane benchmark: scaling, router overhead, IPC throughput, head-of-line blocking.

    python bench/dataplane.py [--quick] [--json OUT]

Prints four figures against its targets (speed targets live here, never in tests):

1. turns/s with workers=1 vs workers=2 on a parse-heavy shape (long, growing histories)
   -> target ratio >= 1.7
2. router added latency, p50 per chat, workers=1 vs the single-process server (workers=0)
   -> target <= 2 ms
3. IPC throughput worker -> router (streamed body) and router -> worker (one REQUEST frame,
   and the same body streamed in 1 MiB pieces as the router forwards a chat's HTTP body)
   for 64 MiB and 1 GiB bodies, over a spawned process's socketpair -> target >= 1.5 GiB/s
   (router -> worker: best of the runs, i.e. the worker's receive pool warm; the first body of
   each size, received into fresh memory, is printed too)
4. chat p99 on one shard with and without concurrent 1 GiB records GETs on the same shard
   -> target: within 2x; printed next to the same figure for chats on another shard, which
   share the CPU but not the channel with the GETs (what is left is CPU, not head-of-line)

The inference backend is a stub (a subprocess of this script) replaying one canned, valid
completion, optionally padded with a large ``routed_experts`` string, so the backend costs
almost nothing and the session server's own work is what is measured. The load generator is
a raw-socket HTTP/1.1 client in this (gevent-patched) process. Everything shares the same
cores: read the figures as ratios on a loaded box, not as absolute capacity.
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import gevent
import gevent.event
import gevent.pool
import psutil
from rawhttp import Http
from scratch import scratch_state_home

from shinken_sync.stats import percentile
from webapp.ipc_channel import IpcClient, IpcServer, open_socket
from webapp.serve import SessionServerProcess, start_session_server
from webapp.sharding import shard_for

MiB = 1024**2
GiB = 1024**3
R3_MARKER = 424242  # a session tag: the stub pads its replies with R3


# -- the stub backend ----------------------------------------------------------------------------

def capture_reply() -> dict:
    """One real completion from the reference backend (self-consistent ids and content)."""
    from webapp.reference_backend import start_reference_backend

    backend = start_reference_backend()
    try:
        req = urllib.request.Request(
            backend.url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    finally:
        backend.close()


def _http_reply(reply: dict) -> bytes:
    body = json.dumps(reply).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def stub_main(reply_path: str, r3_bytes: int) -> None:
    """Serve the canned reply to every POST; prompts naming R3_MARKER get ``r3_bytes`` of R3."""
    from gevent.server import StreamServer

    reply = json.loads(Path(reply_path).read_text())
    plain = _http_reply(reply)
    reply["choices"][0]["meta_info"]["routed_experts"] = "A" * r3_bytes
    padded = _http_reply(reply)
    marker = str(R3_MARKER).encode()

    def handle(sock, _addr):
        rfile = sock.makefile("rb")
        try:
            while True:
                length = 0
                line = rfile.readline()
                if not line:
                    return
                while line not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                    line = rfile.readline()
                request = rfile.read(length)
                sock.sendall(padded if b"s" + marker + b" " in request else plain)
        except OSError:
            return
        finally:
            rfile.close()
            sock.close()

    server = StreamServer(("127.0.0.1", 0), handle)
    server.start()
    print(json.dumps({"url": f"http://127.0.0.1:{server.server_port}"}), flush=True)
    from gevent.socket import wait_read

    while True:  # exit when the parent closes our stdin (or dies); never block the hub
        wait_read(sys.stdin.fileno())
        if not os.read(sys.stdin.fileno(), 4096):
            return


class Proc:
    """A subprocess whose stdout's first match of ``pattern`` gives its URL."""

    def __init__(self, argv: list[str], pattern: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            match = re.search(pattern, line)
            if match:
                self.url = match.group(1)
                return
            if not line and self.proc.poll() is not None:
                break
        self.close()
        raise RuntimeError(f"{argv} did not get ready")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_stub(reply_path: str, r3_bytes: int = 64 * MiB) -> Proc:
    return Proc([sys.executable, __file__, "_stub", reply_path, str(r3_bytes)], r'"url": "(http://[^"]+)"')


def start_server(workers: int, backend_url: str) -> SessionServerProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    return start_session_server(workers, backend_url, env=env)


# -- 1. scaling on a parse-heavy shape ------------------------------------------------------------

def turn_bodies(assistant: dict, turns: int, user_bytes: int, tag: int) -> list[bytes]:
    messages: list[dict] = []
    bodies = []
    for t in range(turns):
        text = f"s{tag} t{t}: " + ("select the third row, then open its context menu; " * (user_bytes // 50))
        messages.append({"role": "user", "content": text})
        bodies.append(json.dumps({"messages": messages, "max_tokens": 32}).encode())
        messages = [*messages, assistant]
    return bodies


def run_sessions(url: str, sessions: int, bodies_for, concurrency: int,
                 shards: int = 1) -> tuple[int, float, list[float]]:
    """Run ``sessions`` sessions, ``concurrency`` at a time, spread evenly over ``shards`` (a
    handful of random ids would leave one shard with most of the work)."""
    latencies: list[float] = []
    sids = [sid for shard in range(shards) for sid in sessions_on(url, shard, shards, sessions // shards)]

    def one(i: int) -> int:
        http = Http(url)
        try:
            sid = sids[i]
            for body in bodies_for(i):
                start = time.perf_counter()
                status, _ = http.request("POST", f"/sessions/{sid}/v1/chat/completions", body)
                latencies.append(time.perf_counter() - start)
                assert status == 200, status
            http.request("DELETE", f"/sessions/{sid}")
            return len(bodies_for(i))
        finally:
            http.close()

    pool = gevent.pool.Pool(concurrency)
    start = time.perf_counter()
    done = sum(pool.map(one, range(len(sids))))
    return done, time.perf_counter() - start, latencies


def bench_scaling(stub_url: str, assistant: dict, quick: bool) -> dict:
    """Alternating runs (w1, w2, w1, w2 ...), best of each: a shared box's load swings."""
    turns, user_bytes, sessions, rounds = (8, 16000, 8, 1) if quick else (12, 24000, 16, 2)
    cache = {i: turn_bodies(assistant, turns, user_bytes, i) for i in range(sessions)}
    servers = {workers: start_server(workers, stub_url) for workers in (1, 2)}
    best = {1: 0.0, 2: 0.0}
    worker_cpu = {1: 0.0, 2: 0.0}
    try:
        for server in servers.values():
            run_sessions(server.url, 2, cache.__getitem__, 2)  # warm up
        for _ in range(rounds):
            for workers, server in servers.items():
                workers_ps = [p for p in psutil.Process(server.pid).children(recursive=True)
                              if "shinken-session-worker" in " ".join(p.cmdline())]
                cpu0 = sum(sum(p.cpu_times()[:2]) for p in workers_ps)
                done, elapsed, _ = run_sessions(server.url, sessions, cache.__getitem__, sessions, workers)
                if done / elapsed > best[workers]:
                    best[workers] = done / elapsed
                    worker_cpu[workers] = (sum(sum(p.cpu_times()[:2]) for p in workers_ps) - cpu0) / elapsed
    finally:
        for server in servers.values():
            server.close()
    avg_body = statistics.mean(len(b) for bodies in cache.values() for b in bodies)
    return {"turns_per_s_w1": best[1], "turns_per_s_w2": best[2], "ratio": best[2] / best[1],
            "worker_cores_busy_w1": worker_cpu[1], "worker_cores_busy_w2": worker_cpu[2],
            "avg_body_kib": avg_body / 1024, "sessions": sessions, "turns": turns}


# -- 2. router added latency ----------------------------------------------------------------------

def bench_router_latency(stub_url: str, assistant: dict, quick: bool) -> dict:
    """Both servers up at once and called alternately, so load swings hit both alike."""
    n = 300 if quick else 1000
    body = turn_bodies(assistant, 1, 200, 0)[0]
    servers = {workers: start_server(workers, stub_url) for workers in (0, 1)}
    latencies: dict[int, list[float]] = {0: [], 1: []}
    try:
        clients = {workers: Http(server.url) for workers, server in servers.items()}
        for i in range(n):
            for workers, http in clients.items():
                _, sbody = http.request("POST", "/sessions")
                sid = json.loads(sbody)["session_id"]
                start = time.perf_counter()
                status, _ = http.request("POST", f"/sessions/{sid}/v1/chat/completions", body)
                if i >= n // 10:  # warm-up excluded
                    latencies[workers].append(time.perf_counter() - start)
                assert status == 200
                http.request("DELETE", f"/sessions/{sid}")
        for http in clients.values():
            http.close()
    finally:
        for server in servers.values():
            server.close()
    p50 = {workers: statistics.median(values) for workers, values in latencies.items()}
    paired = statistics.median(b - a for a, b in zip(latencies[0], latencies[1]))
    return {"p50_single_ms": p50[0] * 1e3, "p50_router_ms": p50[1] * 1e3,
            "added_ms": (p50[1] - p50[0]) * 1e3, "added_paired_median_ms": paired * 1e3}


# -- 3. IPC throughput ----------------------------------------------------------------------------

class _Blob:
    def __init__(self, body) -> None:
        self.status, self.body, self.content_type, self.headers = 200, body, "application/octet-stream", ()


def _ipc_child(conn, size: int) -> None:
    from gevent import monkey as child_monkey

    child_monkey.patch_all()
    fd = os.dup(conn.fileno())
    conn.close()
    blob = b"\x01" * size  # touched memory, like real records

    def handler(meta, body):
        return _Blob([blob] if meta["op"] == "get" else str(len(body)).encode())

    server = IpcServer(open_socket(fd), handler, name="bench-child")
    server.wait_closed(3600)


def bench_ipc(quick: bool) -> dict:
    ctx = multiprocessing.get_context("spawn")
    sizes = [64 * MiB, GiB]
    out = {}
    for size in sizes:
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_ipc_child, args=(child, size), daemon=True)
        proc.start()
        child.close()
        client = IpcClient(open_socket(os.dup(parent.fileno())), name="bench")
        parent.close()
        client.request({"op": "put"}, timeout=60)  # child ready
        reps = 3 if size < GiB else (1 if quick else 2)
        best_down = best_up = best_streamed = 0.0
        first_up = None
        cpu_router = cpu_worker = float("inf")
        child_ps = psutil.Process(proc.pid)
        payload = b"\x01" * size
        for _ in range(reps):
            start, own0, child0 = time.perf_counter(), time.process_time(), sum(child_ps.cpu_times()[:2])
            reply = client.request({"op": "get"}, timeout=60)
            got = sum(len(c) for c in reply.stream)
            assert got == size
            best_down = max(best_down, size / (time.perf_counter() - start) / GiB)
            cpu_router = min(cpu_router, (time.process_time() - own0) * GiB / size)
            cpu_worker = min(cpu_worker, (sum(child_ps.cpu_times()[:2]) - child0) * GiB / size)
            start = time.perf_counter()
            assert client.request({"op": "put"}, payload, timeout=60).body == str(size).encode()
            rate = size / (time.perf_counter() - start) / GiB
            best_up = max(best_up, rate)
            first_up = rate if first_up is None else first_up
            # the same body streamed in 1 MiB pieces, as the router forwards a chat's HTTP body
            view = memoryview(payload)
            start = time.perf_counter()
            reply = client.request({"op": "put"}, timeout=60, body_length=size,
                                   body_stream=(view[i : i + MiB] for i in range(0, size, MiB)))
            assert reply.body == str(size).encode()
            best_streamed = max(best_streamed, size / (time.perf_counter() - start) / GiB)
            view.release()
        del payload
        client.close()
        proc.join(10)
        label = f"{size // MiB}MiB"
        out[f"worker_to_router_{label}_gib_s"] = best_down
        out[f"router_to_worker_{label}_gib_s"] = best_up
        # the first body of its size lands in freshly mapped memory (the worker's receive pool
        # is still cold); later ones reuse a warm pooled buffer
        out[f"router_to_worker_{label}_first_gib_s"] = first_up
        out[f"router_to_worker_{label}_streamed_gib_s"] = best_streamed
        # CPU seconds per GiB streamed worker -> router, per side: what the rate would be with
        # a free core per process, whatever else runs on the box
        out[f"worker_to_router_{label}_router_cpu_s_per_gib"] = cpu_router
        out[f"worker_to_router_{label}_worker_cpu_s_per_gib"] = cpu_worker
    return out


# -- 4. chat p99 under concurrent 1 GiB records GETs on the same shard ------------------------------

def sessions_on(url: str, shard: int, shards: int, count: int) -> list[str]:
    http = Http(url)
    found: list[str] = []
    try:
        while len(found) < count:
            _, body = http.request("POST", "/sessions")
            sid = json.loads(body)["session_id"]
            if shard_for(sid, shards) == shard:
                found.append(sid)
            else:
                http.request("DELETE", f"/sessions/{sid}")
    finally:
        http.close()
    return found


def chat_loop(url: str, body: bytes, sids: list[str], latencies: list[float]) -> None:
    http = Http(url)
    try:
        for sid in sids:  # one fresh session per chat: every chat is a first turn
            start = time.perf_counter()
            status, _ = http.request("POST", f"/sessions/{sid}/v1/chat/completions", body)
            latencies.append(time.perf_counter() - start)
            assert status == 200, status
    finally:
        http.close()


def p99(values: list[float]) -> float:
    return percentile(values, 99)


def bench_head_of_line(stub_url: str, assistant: dict, quick: bool) -> dict:
    """workers=2; the big session lives on shard B. Chats on shard B share its channel with the
    GETs; chats on the other shard (the control) share only the machine's CPU with them."""
    server = start_server(2, stub_url)
    try:
        (big,) = sessions_on(server.url, 1, 2, 1)
        http = Http(server.url)
        # the stub pads replies to marked prompts with 64 MiB of R3: 16 turns = ~1 GiB of records
        for body in turn_bodies(assistant, 16, 100, R3_MARKER):
            status, _ = http.request("POST", f"/sessions/{big}/v1/chat/completions", body)
            assert status == 200, status
        start = time.perf_counter()
        _, size = http.request("GET", f"/sessions/{big}", sink=True)
        get_gib_s = size / (time.perf_counter() - start) / GiB
        http.close()
        chat_body = turn_bodies(assistant, 1, 200, 7)[0]
        loops, per_loop = 4, (40 if quick else 100)

        def measure(shard: int) -> list[float]:
            latencies: list[float] = []
            sids = sessions_on(server.url, shard, 2, loops * per_loop)
            gevent.joinall([gevent.spawn(chat_loop, server.url, chat_body, sids[i::loops], latencies)
                            for i in range(loops)], raise_error=True)
            return latencies

        idle = {"same": measure(1), "other": measure(0)}
        gets_done = [0]
        stop = gevent.event.Event()

        def get_loop() -> None:
            client = Http(server.url)
            try:
                while not stop.is_set():
                    status, got = client.request("GET", f"/sessions/{big}", sink=True)
                    assert status == 200 and got == size
                    gets_done[0] += 1
            finally:
                client.close()

        getters = [gevent.spawn(get_loop) for _ in range(2)]
        gevent.sleep(0.5)
        loaded = {"same": measure(1), "other": measure(0)}
        stop.set()
        gevent.joinall(getters, timeout=120, raise_error=True)
        out = {"records_bytes": size, "single_get_gib_s": get_gib_s, "concurrent_gets": 2,
               "gets_completed": gets_done[0]}
        for where in ("same", "other"):
            out[f"{where}_p50_idle_ms"] = statistics.median(idle[where]) * 1e3
            out[f"{where}_p99_idle_ms"] = p99(idle[where]) * 1e3
            out[f"{where}_p50_loaded_ms"] = statistics.median(loaded[where]) * 1e3
            out[f"{where}_p99_loaded_ms"] = p99(loaded[where]) * 1e3
            out[f"{where}_p99_ratio"] = p99(loaded[where]) / p99(idle[where])
        return out
    finally:
        server.close()


def main() -> None:
    scratch_state_home()  # the servers' journals go to a temporary directory
    if len(sys.argv) > 1 and sys.argv[1] == "_stub":
        stub_main(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description="session-server data-plane benchmark")
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke check, noisier)")
    parser.add_argument("--json", default=None, help="also write the figures as JSON here")
    parser.add_argument("--only", default=None, help="comma list of: scaling,latency,ipc,hol")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else {"scaling", "latency", "ipc", "hol"}
    reply = capture_reply()
    assistant = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
    report: dict = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(reply, f)
        reply_path = f.name
    try:
        if "ipc" in only:
            report["ipc"] = bench_ipc(args.quick)
            r = report["ipc"]
            for label in ("64MiB", "1024MiB"):
                bound = 1 / max(r[f"worker_to_router_{label}_router_cpu_s_per_gib"],
                                r[f"worker_to_router_{label}_worker_cpu_s_per_gib"])
                print(f"IPC {label}: worker->router {r[f'worker_to_router_{label}_gib_s']:.2f} GiB/s, "
                      f"router->worker {r[f'router_to_worker_{label}_gib_s']:.2f} GiB/s, streamed in 1 MiB "
                      f"pieces {r[f'router_to_worker_{label}_streamed_gib_s']:.2f} GiB/s (target >= 1.5; "
                      f"first, cold pool {r[f'router_to_worker_{label}_first_gib_s']:.2f}); "
                      f"CPU per GiB streamed: router {r[f'worker_to_router_{label}_router_cpu_s_per_gib']:.2f} s, "
                      f"worker {r[f'worker_to_router_{label}_worker_cpu_s_per_gib']:.2f} s "
                      f"(-> {bound:.2f} GiB/s with a free core each)", flush=True)
        stub = start_stub(reply_path)
        try:
            if "latency" in only:
                report["latency"] = r = bench_router_latency(stub.url, assistant, args.quick)
                print(f"router added latency p50: {r['added_ms']:.2f} ms (single-process {r['p50_single_ms']:.2f}"
                      f" ms, router {r['p50_router_ms']:.2f} ms; median of paired differences "
                      f"{r['added_paired_median_ms']:.2f} ms; target <= 2 ms)", flush=True)
            if "scaling" in only:
                report["scaling"] = r = bench_scaling(stub.url, assistant, args.quick)
                print(f"turns/s workers=1 {r['turns_per_s_w1']:.1f}, workers=2 {r['turns_per_s_w2']:.1f}: "
                      f"x{r['ratio']:.2f} (target >= 1.7; avg body {r['avg_body_kib']:.0f} KiB; session "
                      f"workers kept {r['worker_cores_busy_w1']:.2f} / {r['worker_cores_busy_w2']:.2f} "
                      f"cores busy)", flush=True)
            if "hol" in only:
                report["hol"] = r = bench_head_of_line(stub.url, assistant, args.quick)
                for where, label in (("same", "same shard"), ("other", "other shard (control)")):
                    print(f"chat on the {label}: p99 idle {r[where + '_p99_idle_ms']:.1f} ms, with 2 "
                          f"concurrent {r['records_bytes'] / GiB:.2f} GiB records GETs "
                          f"{r[where + '_p99_loaded_ms']:.1f} ms: x{r[where + '_p99_ratio']:.2f} (p50 "
                          f"{r[where + '_p50_idle_ms']:.1f} -> {r[where + '_p50_loaded_ms']:.1f} ms)", flush=True)
                print(f"  target: same-shard p99 within 2x; {r['gets_completed']} GETs done during the run; "
                      f"one GET alone {r['single_get_gib_s']:.2f} GiB/s", flush=True)
        finally:
            stub.close()
    finally:
        os.unlink(reply_path)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
