"""Screenshot turns benchmark: image chats through the session server.

    python bench/images.py [--sessions 32] [--turns 20] [--workers 1 2] [--hol] [--old DIR] [--json OUT]

Per worker count, in one run: ``--sessions`` concurrent sessions x ``--turns`` turns, each turn
adding one distinct 1280x720 JPEG (q80) as an OpenAI image part to a user message and
resending the full history (as agents do: turn k's body carries k screenshots). Prints:

1. turns/s and chat p50/p99 (the image chats);
2. bytes stored per session (its records as ``GET /sessions/{id}`` returns them, plus each
   image's bytes once) vs the sum of its request bodies;
3. head-of-line: a probe session on the same shard (with workers=1 every session shares the
   one shard) sends small text chats one after the other, idle and while the image chats
   flow; the router streams each multi-MiB body to the worker in 1 MiB pieces, so a probe
   chat waits for CPU, not behind whole bodies.

The backend is the reference backend (it checks that the image pad runs match ``image_data``
and hashes the images), so the backend's work is part of every figure; the CPU per turn is
printed for the session server's processes (launcher, gunicorn router, workers: user + system
from /proc over the image phase, the probe's few chats included) and for the backend apart.

``--old DIR``: the same figures for the code of another checkout (its server and its reference
backend started with ``PYTHONPATH=DIR``), alternated with this checkout's, worker count by
worker count, ``--rounds`` times, in one run. Everything shares the
same cores with the load generator (and, on the team's box, with other engineers' runs): read
the figures as same-run ratios, not capacity.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gevent
import gevent.event
import gevent.pool
import numpy as np
import procfs
from dataplane import Http, sessions_on  # importing it gevent-patches this process
from PIL import Image
from scratch import scratch_state_home

from shinken_sync.stats import percentile  # the one definition (docs/benchmarks.md)
from webapp.reference_backend import ReferenceBackendProcess, start_reference_backend
from webapp.serve import SessionServerProcess, start_session_server

SIZE = (1280, 720)


def screenshots(count: int, seed: int = 0) -> list[bytes]:
    """``count`` distinct 1280x720 JPEGs (q80) with desktop-like content: flat panels, bars,
    and a noisy region (text-like detail), ~100-200 KB each."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        img = np.full((SIZE[1], SIZE[0], 3), 235, dtype=np.uint8)
        img[:40] = (40, 60, 90)  # title bar
        for _ in range(12):  # windows and buttons
            x, y = rng.integers(0, SIZE[0] - 200), rng.integers(40, SIZE[1] - 120)
            img[y:y + rng.integers(40, 120), x:x + rng.integers(80, 200)] = rng.integers(0, 255, 3)
        text = rng.integers(0, 2, (SIZE[1] // 4, SIZE[0] // 2), dtype=np.uint8) * 200
        block = np.repeat(np.repeat(text, 2, axis=1), 2, axis=0)[:300, :600]
        img[100 + (k % 50):400 + (k % 50), 300:900] = block[..., None]
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=80)
        out.append(buf.getvalue())
    return out


class ImageConversation:
    """One session's agent loop: each turn adds one screenshot and resends the history."""

    def __init__(self, url: str, sid: str, shots: list[bytes]) -> None:
        self.url = url
        self.http = Http(url)
        self.sid = sid
        self.shots = shots
        self.encoded: list[bytes] = [json.dumps({"role": "system", "content": "You operate a desktop."}).encode()]
        self.sent = 0

    def turn(self, turn: int, latencies: list[float]) -> None:
        url_ = "data:image/jpeg;base64," + base64.b64encode(self.shots[turn]).decode()
        self.encoded.append(json.dumps({"role": "user", "content": [
            {"type": "text", "text": f"turn {turn}: the screen now"},
            {"type": "image_url", "image_url": {"url": url_}}]}).encode())
        # The body as pieces, sent gathered: joining ~3.6 MB per turn cost this load generator
        # copies that the server under test then waited for on the same two cores.
        body = [b'{"model":"m","max_tokens":64,"messages":[']
        for k, message in enumerate(self.encoded):
            body += (b",", message) if k else (message,)
        body.append(b"]}")
        self.sent += sum(map(len, body))
        start = time.perf_counter()
        status, reply = self.http.request("POST", f"/sessions/{self.sid}/v1/chat/completions", body)
        latencies.append(time.perf_counter() - start)
        if status != 200:
            raise RuntimeError(f"turn {turn}: {status} {reply[:300]!r}")
        content = json.loads(reply)["choices"][0]["message"]["content"]
        self.encoded.append(json.dumps({"role": "assistant", "content": content}).encode())

    def finish(self) -> dict:
        """The bytes sent and stored; deletes the session."""
        # A new connection: this one may have idled past the server's keep-alive (5 s) while the
        # sessions before it finished (a lockstep run finishes them one after the other).
        self.http.close()
        self.http = Http(self.url)
        try:
            _, records = self.http.request("GET", f"/sessions/{self.sid}")
            _, with_images = self.http.request("GET", f"/sessions/{self.sid}?images=1")
            images = json.loads(with_images)["images"]
            image_bytes = sum(len(base64.b64decode(i["data"])) for i in images.values())
            self.http.request("DELETE", f"/sessions/{self.sid}")
            return {"sent": self.sent, "records": len(records), "images": image_bytes, "unique_images": len(images)}
        finally:
            self.http.close()


def image_session(url: str, sid: str, shots: list[bytes], latencies: list[float]) -> dict:
    """One session's turns; returns the bytes sent and stored."""
    conversation = ImageConversation(url, sid, shots)
    try:
        for turn in range(len(shots)):
            conversation.turn(turn, latencies)
    except BaseException:
        conversation.http.close()
        raise
    return conversation.finish()


def run_lockstep(workers: int, backend: ReferenceBackendProcess, sessions: int, turns: int,
                 pool_of_shots: list[bytes], code: str | None = None) -> dict:
    """Every session's turn k together, then turn k + 1: the server's and the backend's CPU per
    turn at each history length (turn k's body carries k screenshots)."""
    log = Path(tempfile.mkstemp(prefix="images-lockstep-", suffix=".log")[1])
    server = start_session_server(workers, backend.url, env=code_env(code), log_path=log)
    try:
        http = Http(server.url)
        sids = [json.loads(http.request("POST", "/sessions")[1])["session_id"] for _ in range(sessions)]
        http.close()
        conversations = [ImageConversation(server.url, sids[i], [pool_of_shots[(i * 7 + t) % len(pool_of_shots)]
                                                                   for t in range(turns)]) for i in range(sessions)]
        server_ms, backend_ms, latencies = [], [], []
        for turn in range(turns):
            cpu0, backend0 = procfs.tree_cpu(server.pid), procfs.tree_cpu(backend.proc.pid)
            gevent.joinall([gevent.spawn(c.turn, turn, latencies) for c in conversations], raise_error=True)
            server_ms.append(1e3 * (procfs.tree_cpu(server.pid) - cpu0) / sessions)
            backend_ms.append(1e3 * (procfs.tree_cpu(backend.proc.pid) - backend0) / sessions)
        for c in conversations:
            c.finish()
    except BaseException:  # which code failed, and what its server said
        print(f"[{code or 'this checkout'}] lockstep workers={workers} failed; server log {log}:\n"
              f"{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        raise
    finally:
        server.close()
    return {"code": code or "this checkout", "workers": workers, "server_cpu_ms_by_images": server_ms,
            "backend_cpu_ms_by_images": backend_ms}


def probe(url: str, shards: int, latencies: list[float], stop: gevent.event.Event | None, count: int,
          shard: int = 0) -> None:
    """Small text chats one after the other on ``shard`` (a fresh session every 50 turns)."""
    http = Http(url)
    (sid,) = sessions_on(url, shard, shards, 1)
    messages: list[dict] = []
    try:
        n = 0
        while (stop is None and n < count) or (stop is not None and not stop.is_set()):
            if len(messages) > 100:
                http.request("DELETE", f"/sessions/{sid}")
                (sid,) = sessions_on(url, shard, shards, 1)
                messages = []
            messages.append({"role": "user", "content": f"probe {n}"})
            body = json.dumps({"messages": messages, "max_tokens": 64}).encode()
            start = time.perf_counter()
            try:
                status, reply = http.request("POST", f"/sessions/{sid}/v1/chat/completions", body)
            except (OSError, IndexError):  # the server closed the keep-alive connection: not timed
                http.close()
                http = Http(url)
                messages.pop()
                continue
            latencies.append(time.perf_counter() - start)
            assert status == 200, reply[:300]
            messages.append({"role": "assistant", "content": json.loads(reply)["choices"][0]["message"]["content"]})
            n += 1
    finally:
        http.close()


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_env(code: str | None) -> dict[str, str]:
    """The environment of a server or backend running ``code`` (a checkout; None: this one).
    They start as ``python -m``, which puts the working directory first on ``sys.path``:
    :func:`main` leaves the checkout for ``/`` so PYTHONPATH decides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    env["PYTHONPATH"] = os.path.abspath(code) if code is not None else CHECKOUT
    return env


def run(workers: int, backend: ReferenceBackendProcess, sessions: int, turns: int, pool_of_shots: list[bytes],
        code: str | None = None) -> dict:
    server: SessionServerProcess = start_session_server(workers, backend.url, env=code_env(code))
    try:
        url = server.url
        idle: list[float] = []
        probe(url, workers, idle, None, 40)
        http = Http(url)
        sids = [json.loads(http.request("POST", "/sessions")[1])["session_id"] for _ in range(sessions)]
        http.close()
        latencies: list[float] = []
        loaded: list[float] = []
        stop = gevent.event.Event()
        prober = gevent.spawn(probe, url, workers, loaded, stop, 0)
        pool = gevent.pool.Pool(sessions)
        cpu0, backend0 = procfs.tree_cpu(server.pid), procfs.tree_cpu(backend.proc.pid)
        start = time.perf_counter()
        results = pool.map(lambda i: image_session(url, sids[i], [pool_of_shots[(i * 7 + t) % len(pool_of_shots)]
                                                                   for t in range(turns)], latencies),
                           range(sessions))
        elapsed = time.perf_counter() - start
        server_cpu, backend_cpu = procfs.tree_cpu(server.pid) - cpu0, procfs.tree_cpu(backend.proc.pid) - backend0
        stop.set()
        prober.join()
    finally:
        server.close()
    stored = [r["records"] + r["images"] for r in results]
    sent = [r["sent"] for r in results]
    return {"code": code or "this checkout", "workers": workers, "turns": sessions * turns, "elapsed_s": elapsed,
            "server_cpu_ms_per_turn": 1e3 * server_cpu / (sessions * turns),
            "backend_cpu_ms_per_turn": 1e3 * backend_cpu / (sessions * turns),
            "turns_per_s": sessions * turns / elapsed,
            "chat_p50_ms": 1e3 * percentile(latencies, 50), "chat_p99_ms": 1e3 * percentile(latencies, 99),
            "stored_per_session_bytes": statistics.mean(stored), "sent_per_session_bytes": statistics.mean(sent),
            "records_per_session_bytes": statistics.mean(r["records"] for r in results),
            "images_per_session_bytes": statistics.mean(r["images"] for r in results),
            "probe_idle_p50_ms": 1e3 * percentile(idle, 50), "probe_idle_p99_ms": 1e3 * percentile(idle, 99),
            "probe_loaded_p50_ms": 1e3 * percentile(loaded, 50), "probe_loaded_p99_ms": 1e3 * percentile(loaded, 99),
            "probe_loaded_n": len(loaded)}


def run_hol(backend: ReferenceBackendProcess, sessions: int, turns: int, pool_of_shots: list[bytes],
            code: str | None = None) -> dict:
    """workers=2, every image session on shard 0; a probe on shard 0 and one on shard 1 at once.
    Both share the machine's CPU; only the shard-0 probe shares the channel and the worker with
    the image chats, so the gap between the two is what the shard itself costs a small chat."""
    server = start_session_server(2, backend.url, env=code_env(code))
    try:
        url = server.url
        sids = sessions_on(url, 0, 2, sessions)
        probes: dict[int, list[float]] = {0: [], 1: []}
        stop = gevent.event.Event()
        probers = [gevent.spawn(probe, url, 2, probes[shard], stop, 0, shard) for shard in (0, 1)]
        pool = gevent.pool.Pool(sessions)
        latencies: list[float] = []
        pool.map(lambda i: image_session(url, sids[i], [pool_of_shots[(i * 7 + t) % len(pool_of_shots)]
                                                         for t in range(turns)], latencies), range(sessions))
        stop.set()
        gevent.joinall(probers)
    finally:
        server.close()
    out: dict = {"code": code or "this checkout", "image_chat_p50_ms": 1e3 * percentile(latencies, 50)}
    for shard, values in probes.items():
        out[f"shard{shard}_p50_ms"] = 1e3 * percentile(values, 50)
        out[f"shard{shard}_p99_ms"] = 1e3 * percentile(values, 99)
        out[f"shard{shard}_n"] = len(values)
    return out


def bands(turns: int) -> list[tuple[int, int]]:
    """The first, middle and last five turns (turn k carries k screenshots)."""
    width = min(5, turns)
    middle = max(0, turns // 2 - width // 2)
    return sorted({(0, width), (middle, middle + width), (turns - width, turns)})


def band(values: list[float], lo: int, hi: int) -> float:
    return statistics.mean(values[lo:hi])


def report_run(r: dict) -> None:
    print(f"[{r['code']}] workers={r['workers']}: {r['turns_per_s']:.1f} turns/s ({r['turns']} turns in "
          f"{r['elapsed_s']:.1f} s), chat p50 {r['chat_p50_ms']:.0f} ms p99 {r['chat_p99_ms']:.0f} ms; CPU per turn: "
          f"server {r['server_cpu_ms_per_turn']:.1f} ms, reference backend {r['backend_cpu_ms_per_turn']:.1f} ms",
          flush=True)
    print(f"  per session: sent {r['sent_per_session_bytes'] / 2**20:.1f} MiB in request bodies, stored "
          f"{r['stored_per_session_bytes'] / 2**20:.2f} MiB (records {r['records_per_session_bytes'] / 2**20:.2f}"
          f" MiB + images once {r['images_per_session_bytes'] / 2**20:.2f} MiB): "
          f"{r['sent_per_session_bytes'] / r['stored_per_session_bytes']:.1f}x less", flush=True)
    print(f"  probe text chat on shard 0: idle p50 {r['probe_idle_p50_ms']:.1f} / p99 "
          f"{r['probe_idle_p99_ms']:.1f} ms; during the image chats p50 {r['probe_loaded_p50_ms']:.1f} / p99 "
          f"{r['probe_loaded_p99_ms']:.1f} ms ({r['probe_loaded_n']} probes)", flush=True)


def with_backend(code: str | None, measure: Callable[..., dict], **kwargs: object) -> dict:
    """``measure(backend=..., code=code, **kwargs)`` over a reference backend started for
    ``code`` (its PYTHONPATH), closed after."""
    backend = start_reference_backend(env=code_env(code))
    try:
        return measure(backend=backend, code=code, **kwargs)
    finally:
        backend.close()


def main() -> None:
    scratch_state_home()  # the servers' journals go to a temporary directory
    parser = argparse.ArgumentParser(description="screenshot turns through the session server")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--hol", action="store_true",
                        help="also: workers=2, all image sessions on shard 0, probes on shard 0 and shard 1")
    parser.add_argument("--old", default=None, help="also run this checkout's code (PYTHONPATH), alternated")
    parser.add_argument("--rounds", type=int, default=1, help="with --old: alternations")
    parser.add_argument("--no-throughput", action="store_true", help="skip the turns/s runs")
    parser.add_argument("--lockstep", action="store_true",
                        help="also: the sessions' turns in lockstep, CPU per turn by its number of screenshots")
    parser.add_argument("--json", default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    os.chdir("/")  # see code_env
    shots = screenshots(max(args.turns, 40))
    print(f"screenshots: {SIZE[0]}x{SIZE[1]} JPEG q80, mean {statistics.mean(map(len, shots)) / 1024:.0f} KiB; "
          f"{args.sessions} sessions x {args.turns} turns, full history resent each turn", flush=True)
    codes: list[str | None] = [args.old, None] if args.old else [None]
    report: list[dict] = []
    load = {"sessions": args.sessions, "turns": args.turns, "pool_of_shots": shots}
    for _ in range(args.rounds):
        for workers in [] if args.no_throughput else args.workers:
            for code in codes:
                r = with_backend(code, run, workers=workers, **load)
                report.append(r)
                report_run(r)
        if args.lockstep:
            for workers in args.workers:
                for code in codes:
                    k = with_backend(code, run_lockstep, workers=workers, **load)
                    report.append({"lockstep": k})
                    print(f"[{k['code']}] lockstep workers={workers}: CPU per turn, server / reference backend: "
                          + "; ".join(f"turns {lo + 1}-{hi}: {band(k['server_cpu_ms_by_images'], lo, hi):.1f} / "
                                      f"{band(k['backend_cpu_ms_by_images'], lo, hi):.1f} ms"
                                      for lo, hi in bands(args.turns)), flush=True)
        if args.hol:
            for code in codes:
                h = with_backend(code, run_hol, **{**load, "sessions": args.sessions // 2})
                report.append({"hol": h})
                print(f"[{h['code']}] head-of-line (workers=2, {args.sessions // 2} image sessions all on shard 0, "
                      f"image chat p50 {h['image_chat_p50_ms']:.0f} ms): text probe on shard 0 p50 "
                      f"{h['shard0_p50_ms']:.1f} / p99 {h['shard0_p99_ms']:.1f} ms ({h['shard0_n']}), on shard 1 p50 "
                      f"{h['shard1_p50_ms']:.1f} / p99 {h['shard1_p99_ms']:.1f} ms ({h['shard1_n']})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
