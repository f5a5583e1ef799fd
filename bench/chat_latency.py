"""Tiny-chat latency: straight to the reference backend, and through the session server.

    python bench/chat_latency.py [--n 200] [--workers 2]

A "tiny chat" is one short user message, answered by the embedded reference backend (no R3),
on one keep-alive connection (``requests.Session``, as the demo and OpenAI clients use):

1. straight to ``python -m webapp.reference_backend``: ``POST /v1/chat/completions``;
2. through ``shinken-session-server --workers W`` (router + worker + the same backend):
   a fresh session per sample (its ``POST /sessions`` not timed), then one timed
   ``POST /sessions/{id}/v1/chat/completions``.

Prints p50 / p95 / max and the first call's time for each. A reply written in two pieces on
a socket with Nagle's algorithm on costs a delayed ACK (~40 ms) per call from the second call
of a keep-alive connection on; the first call does not show it (TCP quick-ACK mode). Compare
with an older tree by pointing PYTHONPATH at it. Everything shares the machine's cores: read
the figures against each other within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import requests
from scratch import scratch_state_home

from shinken_sync.stats import percentile
from webapp.reference_backend import start_reference_backend
from webapp.serve import start_session_server

BODY = {"model": "reference", "messages": [{"role": "user", "content": "Click the OK button."}]}


def _summary(name: str, samples: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples[1:])
    return (f"{name:<34} p50 {percentile(ms, 50):7.2f} ms  p95 {percentile(ms, 95):7.2f} ms  max {ms[-1]:7.2f} ms  "
            f"(first call {samples[0] * 1e3:.2f} ms, n={len(ms)})")


def straight(n: int) -> list[float]:
    backend = start_reference_backend()
    try:
        with requests.Session() as http:
            samples = []
            for _ in range(n + 1):
                t0 = time.perf_counter()
                reply = http.post(backend.url + "/v1/chat/completions", json=BODY, timeout=30)
                samples.append(time.perf_counter() - t0)
                reply.raise_for_status()
            return samples
    finally:
        backend.close()


def through_server(n: int, workers: int) -> list[float]:
    with start_session_server(workers, None, "127.0.0.1:0", "--reference-r3-layers", "0") as server, \
            requests.Session() as http:
        samples = []
        for _ in range(n + 1):
            session = http.post(server.url + "/sessions", timeout=30).json()["session_id"]
            t0 = time.perf_counter()
            reply = http.post(f"{server.url}/sessions/{session}/v1/chat/completions", json=BODY, timeout=30)
            samples.append(time.perf_counter() - t0)
            reply.raise_for_status()
            http.delete(f"{server.url}/sessions/{session}", timeout=30)
        return samples


def main() -> int:
    scratch_state_home()  # the servers' journals go to a temporary directory
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="timed calls per case (after the first)")
    parser.add_argument("--workers", type=int, default=2, help="session-server workers")
    args = parser.parse_args()
    results = {"straight": straight(args.n), "through": through_server(args.n, args.workers)}
    print(_summary("tiny chat, straight to the backend", results["straight"]))
    print(_summary(f"tiny chat, session server (W={args.workers})", results["through"]))
    print(json.dumps({k: round(statistics.median(v[1:]) * 1e3, 3) for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
