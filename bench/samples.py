"""``POST /sessions/{id}/samples`` vs ``GET /sessions/{id}`` for one long agentic session.

    python bench/samples.py [--turns 50] [--r3-layers 48] [--r3-topk 8] [--user-bytes 64]
                            [--repeats 3] [--workers 0 2]

It starts the reference backend (R3 of ``--r3-layers`` x top-``--r3-topk`` int32 per token)
and, per server mode (``--workers 0``: the single-process app; ``--workers N``: the router
with N session workers), ``shinken-session-server`` with routing replay on, drives one
session for ``--turns`` turns (reply appended, then a tool observation of ``--user-bytes``
bytes), then fetches, alternating, ``--repeats`` times each:

- ``GET /sessions/{id}``: every record, each with its backend reply's R3 for its whole
  sequence, so the body grows quadratically with the turns; the client then ``json.loads`` it
  (what miles' ``collect_records`` does before assembling).
- ``POST /sessions/{id}/samples``: the assembled training sample, R3 of the final sequence
  only, as safetensors; the client then loads it.

It prints bytes on the wire and wall time (median; request, and request + client decode) side
by side, with the ratios of the same run. Reports figures; gates nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import requests
import safetensors.numpy
from scratch import scratch_state_home

from webapp.reference_backend import start_reference_backend
from webapp.serve import start_session_server

READY_TIMEOUT = 120.0


def build_session(url: str, turns: int, user_bytes: int) -> tuple[str, int]:
    http = requests.Session()
    sid = http.post(f"{url}/sessions", timeout=30).json()["session_id"]
    messages = [{"role": "system", "content": "You operate a 1920x1080 desktop."},
                {"role": "user", "content": "Rename report.pdf to q3.pdf"}]
    tokens = 0
    for i in range(turns):
        reply = http.post(f"{url}/sessions/{sid}/v1/chat/completions", json={"messages": messages}, timeout=300)
        reply.raise_for_status()
        body = reply.json()
        tokens = body["usage"]["total_tokens"]
        messages = messages + [body["choices"][0]["message"],
                               {"role": "tool", "tool_call_id": f"c{i}", "content": f"obs {i} " + "x" * user_bytes}]
    return sid, tokens


def fetch(http: requests.Session, method: str, url: str, decode) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    resp = http.request(method, url, json={"max_seq_len": None} if method == "POST" else None, timeout=600)
    t1 = time.perf_counter()
    resp.raise_for_status()
    decode(resp.content)
    t2 = time.perf_counter()
    return len(resp.content), t1 - t0, t2 - t0


def run(workers: int, backend_url: str, args: argparse.Namespace) -> None:
    with start_session_server(workers, backend_url, "127.0.0.1:0", "--routing-replay-layers", str(args.r3_layers),
                              wait=False) as server:
        url = server.wait_ready(READY_TIMEOUT)
        t0 = time.perf_counter()
        sid, tokens = build_session(url, args.turns, args.user_bytes)
        build = time.perf_counter() - t0
        http = requests.Session()
        results: dict[str, list[tuple[int, float, float]]] = {"GET records": [], "POST samples": []}
        for _ in range(args.repeats):
            results["GET records"].append(fetch(http, "GET", f"{url}/sessions/{sid}", json.loads))
            results["POST samples"].append(fetch(http, "POST", f"{url}/sessions/{sid}/samples",
                                                 safetensors.numpy.load))
        print(f"\n--workers {workers}: {args.turns} turns, final sequence {tokens} tokens, "
              f"R3 {args.r3_layers} layers x top-{args.r3_topk} (session built in {build:.1f} s)")
        print(f"  {'':14} {'bytes':>14} {'request ms':>11} {'+decode ms':>11}")
        medians = {}
        for name, rows in results.items():
            size = rows[0][0]
            req, full = statistics.median(r[1] for r in rows), statistics.median(r[2] for r in rows)
            medians[name] = (size, req, full)
            print(f"  {name:14} {size:>14,} {req * 1e3:>11.0f} {full * 1e3:>11.0f}")
        (gs, gr, gf), (ss, sr, sf) = medians["GET records"], medians["POST samples"]
        print(f"  ratio GET/samples: bytes {gs / ss:.1f}x, request {gr / sr:.1f}x, with decode {gf / sf:.1f}x")


def main() -> None:
    scratch_state_home()  # the servers' journals go to a temporary directory
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--r3-layers", type=int, default=48)
    parser.add_argument("--r3-topk", type=int, default=8)
    parser.add_argument("--user-bytes", type=int, default=64, help="bytes of each tool observation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    print(f"python {' '.join(sys.argv)}")
    backend = start_reference_backend(r3_layers=args.r3_layers, r3_topk=args.r3_topk)
    try:
        for workers in args.workers:
            run(workers, backend.url, args)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
