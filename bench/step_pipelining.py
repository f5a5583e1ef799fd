"""Pipelined ``step`` vs serial ``act_batch`` at an emulated WAN round trip.

One RL step = 5 input actions + an observation screenshot. ``act_batch``
awaits each reply before sending the next call (6 round trips); ``step``
sends all six calls first and awaits the replies together (about 1 round
trip). shinkend's ``--rtt-ms`` holds every reply that long without delaying
the calls queued behind it, as a real network would.

    python bench/step_pipelining.py [--rtt-ms 150] [--rounds 15] [--long-edge 1280]

Prints the median wall time of each and the ratio; the seed measured
0.94 s -> 0.17 s (5.7x against a 6x bound); the target here is >= 5.5x.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from shinken_sync import actions as A
from shinken_sync.client import aconnect
from shinken_sync.providers.local import LocalProvider
from shinken_sync.stats import percentile


def five_actions(i: int) -> list[dict]:
    x, y = 200 + 10 * (i % 50), 300 + 5 * (i % 40)  # the screen changes every round
    return [A.move(x, y), A.click(x, y), A.type("ok"), A.key("BackSpace"), A.scroll(0, 1, x, y)]


async def measure(url: str, token: str, rounds: int, long_edge: int) -> tuple[list[float], list[float]]:
    observe = {"format": "jpeg", "quality": 80, "max_long_edge": long_edge}
    async with await aconnect(url, token) as sb:
        await sb.step(five_actions(0), observe=observe)  # warm up both ends
        serial, pipelined = [], []
        for i in range(rounds):  # interleaved so drift hits both alike
            start = time.perf_counter()
            batch = await sb.act_batch([*five_actions(2 * i + 1), A.screenshot(**observe)])
            serial.append(time.perf_counter() - start)
            assert batch.ok, batch.outcomes

            start = time.perf_counter()
            step = await sb.step(five_actions(2 * i + 2), observe=observe)
            pipelined.append(time.perf_counter() - start)
            assert step.ok and step.observation is not None, step.outcomes
        return serial, pipelined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtt-ms", type=float, default=150.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--long-edge", type=int, default=1280, help="observation downscale")
    args = parser.parse_args()
    with LocalProvider(display="virtual", rtt_ms=args.rtt_ms) as provider:
        url, token = provider.endpoint(provider.create())
        serial, pipelined = asyncio.run(measure(url, token, args.rounds, args.long_edge))
    s, p = statistics.median(serial), statistics.median(pipelined)
    rtt = args.rtt_ms / 1000
    # What a step costs beyond its one round trip: the daemon running six calls
    # (chiefly encoding the observation) plus the client's share. Pipelining
    # cannot hide it, so it caps the ratio at (6 RTT + work) / (RTT + work).
    work = max(0.0, p - rtt)
    print(
        f"emulated RTT {args.rtt_ms:g} ms, 5 actions + observe (JPEG q80 @{args.long_edge}), "
        f"{args.rounds} rounds each, medians:"
    )
    print(f"  act_batch (serial)  : {s * 1000:7.1f} ms  (p90 {_p90(serial) * 1000:.1f})")
    print(f"  step (pipelined)    : {p * 1000:7.1f} ms  (p90 {_p90(pipelined) * 1000:.1f})")
    print(f"  speedup             : {s / p:7.2f}x   (bound 6x, target >= 5.5x)")
    print(
        f"  work per step beyond one RTT: {work * 1000:.1f} ms -> best possible ratio at that work "
        f"{(6 * rtt + work) / (rtt + work):.2f}x"
    )


def _p90(samples: list[float]) -> float:
    return percentile(samples, 90)

if __name__ == "__main__":
    main()
