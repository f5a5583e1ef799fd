"""Session core throughput and latency against the reference backend, plus the parse cost of a big reply.

    python bench/session_core.py                      # 32 sessions x 50 turns, single-process server
    python bench/session_core.py --server-url URL     # against a server you started (e.g. --workers 3)

Part 1 starts the reference backend (R3 on) and the single-process app under gunicorn with the
gevent worker, then drives ``--sessions`` sessions concurrently (one client thread each) for
``--turns`` turns each, growing every conversation like an agent loop (reply appended, then a
short observation). It prints turns/s, reply latency p50/p95/max, and each session's final
records GET (size, time).

"Realistic" R3 here: ``--r3-layers 12 --r3-topk 8`` int32 ids per token, i.e. 384 B raw / 512 B
base64 per token of context — a quarter of a 48-layer top-8 MoE (Qwen3-30B-A3B shape). The
full shape (``--r3-layers 48``) makes the 1600 kept records of this run ~10 GB, which a shared
2-core/24 GiB box should not hold; part 2 covers the full production size per reply instead.

Part 2 times the core's own CPU work on one ~50 MB backend reply (``--parse-mb``): a bare
``json.loads`` (what a naive proxy pays), ``parse_backend_reply`` (the core's parse: R3 is
alphabet-checked, never decoded), and a whole ``SessionCore.chat`` turn (parse, validate,
record, strip R3, re-encode the client reply) against an in-process backend that returns the
prebuilt bytes.

Reports figures; gates nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import psutil
import requests
from scratch import scratch_state_home

from shinken_sync.stats import percentile
from webapp.backend import BackendReply, parse_backend_reply
from webapp.core import SessionCore
from webapp.reference_backend import R3Shape, reference_completion, start_reference_backend
from webapp.serve import gunicorn_version_flags
from webapp.tokenizers import ByteChatTokenizer

READY_TIMEOUT = 60.0
SYSTEM_PROMPT = ("You operate a 1920x1080 desktop. Reply with one JSON action: "
                 '{"action": {"verb": ..., ...}} using click, type, key or scroll.')


def start_server(backend_url: str, r3_layers: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "SHINKEN_BACKEND_URL": backend_url, "SHINKEN_ROUTING_REPLAY_LAYERS": str(r3_layers)}
    argv = [sys.executable, "-m", "gunicorn", "-k", "gevent", *gunicorn_version_flags(), "-w", "1",
            "-b", "127.0.0.1:0", "webapp.app:create_app()"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stderr:
            match = re.search(rb"Listening at: (http://\S+)", line)
            if match and not found:
                found.append(match.group(1).decode())
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(READY_TIMEOUT) or not found:
        proc.kill()
        raise RuntimeError("session server did not start")
    return proc, found[0]


def run_session(url: str, turns: int, latencies: list[float], gets: list[tuple[int, float]],
                errors: list[str], barrier: threading.Barrier) -> None:
    http = requests.Session()
    sid = http.post(url + "/sessions", timeout=30).json()["session_id"]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Open the report."}]
    barrier.wait(READY_TIMEOUT)
    for i in range(turns):
        t0 = time.perf_counter()
        resp = http.post(f"{url}/sessions/{sid}/v1/chat/completions",
                         json={"model": "bench", "messages": messages}, timeout=600)
        latencies.append(time.perf_counter() - t0)
        if resp.status_code != 200:
            errors.append(f"{resp.status_code} {resp.text[:200]}")
            return
        messages = messages + [resp.json()["choices"][0]["message"], {"role": "user", "content": f"obs {i}"}]
    t0 = time.perf_counter()
    with http.get(f"{url}/sessions/{sid}", timeout=600, stream=True) as resp:
        size = sum(len(chunk) for chunk in resp.iter_content(1 << 20))  # big reads: not client-bound
    gets.append((size, time.perf_counter() - t0))
    http.delete(f"{url}/sessions/{sid}", timeout=30)


def bench_sessions(args: argparse.Namespace) -> None:
    backend = server = None
    url = args.server_url
    if url is None:
        backend = start_reference_backend(r3_layers=args.r3_layers, r3_topk=args.r3_topk)
        server, url = start_server(backend.url, args.r3_layers)
    try:
        latencies: list[float] = []
        gets: list[tuple[int, float]] = []
        errors: list[str] = []
        barrier = threading.Barrier(args.sessions + 1)
        threads = [threading.Thread(target=run_session, args=(url, args.turns, latencies, gets, errors, barrier))
                   for _ in range(args.sessions)]
        for t in threads:
            t.start()
        barrier.wait(READY_TIMEOUT)
        t0 = time.perf_counter()
        peak_rss = 0
        while any(t.is_alive() for t in threads):
            time.sleep(0.2)
            if server is not None:
                tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree if "reference_backend" not in " ".join(p.cmdline()))
                peak_rss = max(peak_rss, rss)
        wall = time.perf_counter() - t0
        n = len(latencies)
        print(f"sessions x turns     {args.sessions} x {args.turns} (R3 {args.r3_layers} layers x top-{args.r3_topk}"
              f" int32/token)")
        print(f"turns/s              {n / wall:.1f}  ({n} turns in {wall:.1f} s, {len(errors)} errors)")
        print(f"reply latency        p50 {percentile(latencies, 50) * 1e3:.1f} ms  p95 "
              f"{percentile(latencies, 95) * 1e3:.1f} ms  max {max(latencies) * 1e3:.1f} ms")
        if gets:
            sizes = [s for s, _ in gets]
            print(f"records GET          {statistics.mean(sizes) / 2**20:.1f} MiB avg/session, "
                  f"p50 {percentile([t for _, t in gets], 50) * 1e3:.0f} ms, max {max(t for _, t in gets) * 1e3:.0f} ms")
        if peak_rss:
            print(f"server peak RSS      {peak_rss / 2**30:.2f} GiB")
        for e in errors[:5]:
            print("error:", e)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        if backend is not None:
            backend.close()


class FixedBackend:
    """Answers every turn with the same prebuilt bytes (the parse cost is what is measured)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        return BackendReply.from_raw(self.raw)

    def close(self) -> None:
        pass


def bench_parse(args: argparse.Namespace) -> None:
    tok = ByteChatTokenizer()
    messages = [{"role": "user", "content": "Open the report."}]
    ids = tok.encode(tok.render(messages, add_generation_prompt=True))
    shape = R3Shape(layers=48, top_k=8)
    per_token = shape.layers * shape.top_k * 4 * 4 / 3  # base64 bytes of R3 per token
    prompt = ids + [ord("a")] * int(args.parse_mb * 2**20 / per_token)
    raw = json.dumps(reference_completion(prompt, tok, want_r3=True, r3=shape)).encode()
    loads, turns = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        json.loads(raw)
        loads.append(time.perf_counter() - t0)
    skips = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        parse_backend_reply(raw)
        skips.append(time.perf_counter() - t0)
    core = SessionCore(tok, FixedBackend(raw))
    body = json.dumps({"model": "bench", "messages": messages}).encode()
    for _ in range(args.repeat):
        sid = json.loads(core.create_session().body)["session_id"]
        t0 = time.perf_counter()
        reply = core.chat(sid, body)
        turns.append(time.perf_counter() - t0)
        assert reply.status == 200, reply.body
    print(f"50 MB reply          {len(raw) / 2**20:.1f} MiB ({len(prompt)} tokens x 48 layers x top-8 R3)")
    print(f"  json.loads         median {statistics.median(loads) * 1e3:.0f} ms  min {min(loads) * 1e3:.0f} ms")
    print(f"  parse_backend_reply median {statistics.median(skips) * 1e3:.0f} ms  min {min(skips) * 1e3:.0f} ms"
          "  (what the core does: R3 alphabet-checked, not decoded)")
    print(f"  SessionCore.chat   median {statistics.median(turns) * 1e3:.0f} ms  min {min(turns) * 1e3:.0f} ms"
          "  (whole turn incl. parse_backend_reply)")


def main() -> None:
    scratch_state_home()  # the servers' journals go to a temporary directory
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--r3-layers", type=int, default=12)
    parser.add_argument("--r3-topk", type=int, default=8)
    parser.add_argument("--server-url", default=None, help="bench a running server instead of starting one")
    parser.add_argument("--parse-mb", type=float, default=50.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-sessions", action="store_true")
    args = parser.parse_args()
    if not args.skip_sessions:
        bench_sessions(args)
    bench_parse(args)


if __name__ == "__main__":
    main()
