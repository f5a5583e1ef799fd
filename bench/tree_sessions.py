"""Tree sessions (v2) against linear sessions (v1): the cost of a turn, and ``/samples`` of a big tree.

    python bench/tree_sessions.py [--turns 50] [--conversations 4] [--workers 1]
                                  [--branches 31] [--branch-turns 33] [--repeats 5]

It starts the reference backend (R3 4 layers x top-8) and two ``shinken-session-server``s with
``--workers N`` and routing replay on, one with linear sessions (the default) and one with tree
sessions, then, alternating between the two servers conversation by conversation (the machine
is shared: both see the same load):

- ``linear``: ``--conversations`` agent conversations of ``--turns`` turns each (the reply
  appended, then a tool observation);
- ``retry``: the same, but every 4th turn is sent twice (the agent retries it: the second
  request is the first one again). A linear session rolls the first attempt back; a tree
  session keeps both as siblings.

For each: client wall time per turn (p50 / p99) and the server's CPU (user + system of the
launcher and its workers, from /proc) per turn. Then ``samples``: one tree session of
``1 + branches x branch_turns`` nodes (1,024 by default: a first turn shared, then
``--branches`` conversations off it, each diverging at its second user message), and
``POST /sessions/{id}/samples`` on it ``--repeats`` times (request wall time, server CPU, bytes,
samples, the client's decode), beside a linear session of one branch's length. Reports
figures; gates nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import procfs
import psutil
import requests
import safetensors.numpy
from scratch import scratch_state_home

from shinken_sync.stats import percentile
from webapp.reference_backend import start_reference_backend
from webapp.serve import start_session_server

READY_TIMEOUT = 120.0
R3_LAYERS, R3_TOPK = 4, 8
# The flag that makes a server's sessions trees (miles' --use-session-server v2).
TREE_FLAGS: tuple[str, ...] = ("--session-mode", "v2")
SYSTEM = {"role": "system", "content": "You operate a 1920x1080 desktop."}


class Client:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = requests.Session()

    def session(self) -> str:
        return str(self.http.post(f"{self.url}/sessions", timeout=30).json()["session_id"])

    def chat(self, sid: str, messages: list[dict[str, Any]], latencies: list[float]) -> dict[str, Any]:
        t0 = time.perf_counter()
        reply = self.http.post(f"{self.url}/sessions/{sid}/v1/chat/completions", json={"messages": messages},
                               timeout=300)
        latencies.append(time.perf_counter() - t0)
        reply.raise_for_status()
        message: dict[str, Any] = reply.json()["choices"][0]["message"]
        return message

    def samples(self, sid: str) -> tuple[float, int, int, float]:
        """(request wall seconds, bytes, samples, client decode seconds)."""
        t0 = time.perf_counter()
        reply = self.http.post(f"{self.url}/sessions/{sid}/samples", json={"max_seq_len": None}, timeout=600)
        elapsed = time.perf_counter() - t0
        reply.raise_for_status()
        meta = json.loads(bytes(safetensors.numpy.load(reply.content)["_samples_meta"]))
        return elapsed, len(reply.content), len(meta["samples"]), time.perf_counter() - t0 - elapsed


def conversation(client: Client, turns: int, retry_every: int | None, latencies: list[float], tag: str) -> None:
    sid = client.session()
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"Task {tag}: rename report.pdf"}]
    for i in range(turns):
        reply = client.chat(sid, messages, latencies)
        if retry_every and i % retry_every == retry_every - 1:
            reply = client.chat(sid, messages, latencies)  # the agent retries the same request
        messages = [*messages, reply, {"role": "user", "content": f"obs {tag}.{i}: the dialog shows step {i}"}]


def run_turns(servers: dict[str, tuple[Client, int]], args: argparse.Namespace, retry_every: int | None,
              name: str) -> dict[str, dict[str, float]]:
    latencies: dict[str, list[float]] = {mode: [] for mode in servers}
    cpu: dict[str, float] = dict.fromkeys(servers, 0.0)
    for c in range(args.conversations):
        order = list(servers) if c % 2 == 0 else list(reversed(servers))  # alternate who goes first
        for mode in order:
            client, pid = servers[mode]
            before = procfs.tree_cpu(pid)
            conversation(client, args.turns, retry_every, latencies[mode], f"{name}{c}")
            cpu[mode] += procfs.tree_cpu(pid) - before
    return {mode: {"turns": len(lat), "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
                   "cpu_ms_per_turn": cpu[mode] / len(lat) * 1e3} for mode, lat in latencies.items()}


def build_tree(client: Client, branches: int, branch_turns: int) -> str:
    """One shared first turn, then ``branches`` conversations off it (each a new second user
    message, so each is a child of the first turn)."""
    sid = client.session()
    first = [SYSTEM, {"role": "user", "content": "Task: rename report.pdf"}]
    shared = [*first, client.chat(sid, first, [])]
    for b in range(branches):
        messages = [*shared, {"role": "user", "content": f"branch {b}: try the file menu"}]
        for i in range(branch_turns):
            reply = client.chat(sid, messages, [])
            messages = [*messages, reply, {"role": "user", "content": f"obs {b}.{i}: the dialog shows step {i}"}]
    return sid


def build_linear(client: Client, turns: int) -> str:
    sid = client.session()
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Task: rename report.pdf"}]
    for i in range(turns):
        messages = [*messages, client.chat(sid, messages, []),
                    {"role": "user", "content": f"obs {i}: the dialog shows step {i}"}]
    return sid


def time_samples(client: Client, pid: int, sid: str, repeats: int) -> dict[str, float]:
    runs = []
    before = procfs.tree_cpu(pid)
    for _ in range(repeats):  # the first call computes each leaf's mismatch check; later ones reuse it
        runs.append(client.samples(sid))
    cpu = (procfs.tree_cpu(pid) - before) / repeats
    times = [r[0] for r in runs]
    return {"p50_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3, "bytes": runs[0][1],
            "samples": runs[0][2], "cpu_ms": cpu * 1e3, "decode_ms": statistics.median(r[3] for r in runs) * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--branches", type=int, default=31)
    parser.add_argument("--branch-turns", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    scratch_state_home()
    backend = start_reference_backend(r3_layers=R3_LAYERS, r3_topk=R3_TOPK)
    flags = ("--routing-replay-layers", str(R3_LAYERS))
    try:
        with start_session_server(args.workers, backend.url, "127.0.0.1:0", *flags) as v1, \
                start_session_server(args.workers, backend.url, "127.0.0.1:0", *flags, *TREE_FLAGS) as v2:
            servers = {"v1": (Client(v1.url), v1.pid), "v2": (Client(v2.url), v2.pid)}
            print(f"load at start {psutil.getloadavg()}; --workers {args.workers}, R3 {R3_LAYERS} x top-{R3_TOPK}")
            show: Callable[[str, dict[str, dict[str, float]]], None] = lambda title, rows: print(
                f"\n{title}\n" + "\n".join(
                    f"  {mode}: {r['turns']:.0f} turns, p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
                    f"server CPU {r['cpu_ms_per_turn']:.2f} ms/turn" for mode, r in rows.items())
                + f"\n  v2/v1: p50 x{rows['v2']['p50_ms'] / rows['v1']['p50_ms']:.2f}, "
                  f"CPU x{rows['v2']['cpu_ms_per_turn'] / rows['v1']['cpu_ms_per_turn']:.2f}")
            show(f"linear: {args.conversations} conversations x {args.turns} turns",
                 run_turns(servers, args, None, "linear"))
            show(f"retry: {args.conversations} conversations x {args.turns} turns, every 4th sent twice",
                 run_turns(servers, args, 4, "retry"))
            nodes = 1 + args.branches * args.branch_turns
            t0 = time.perf_counter()
            tree_sid = build_tree(servers["v2"][0], args.branches, args.branch_turns)
            built = time.perf_counter() - t0
            linear_sid = build_linear(servers["v1"][0], 1 + args.branch_turns)
            tree = time_samples(*servers["v2"], tree_sid, args.repeats)
            linear = time_samples(*servers["v1"], linear_sid, args.repeats)
            print(f"\nsamples: v2 tree of {nodes} nodes ({args.branches} leaves, built in {built:.1f} s) vs "
                  f"v1 one path of {1 + args.branch_turns} turns; {args.repeats} repeats")
            for name, row in (("v2 tree", tree), ("v1 path", linear)):
                print(f"  {name}: {row['samples']:.0f} samples, {row['bytes'] / 1e6:.2f} MB, p50 {row['p50_ms']:.1f} ms"
                      f" (max {row['max_ms']:.1f}), server CPU {row['cpu_ms']:.1f} ms per call, client decode "
                      f"{row['decode_ms']:.1f} ms")
            print(f"load at end {psutil.getloadavg()}")
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
