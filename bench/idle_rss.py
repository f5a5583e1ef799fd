"""Marginal client memory per idle AsyncSandbox connection.

A ``shinkend --fleet N`` host runs in its own process (so its memory is not
counted); this process opens N connections on one event loop and measures its
own RSS before and after, once the connections are idle.

    python bench/idle_rss.py [--n 256] [--ping-jitter 10]

Target <= 1 MB per connection (the seed's thread-per-connection facade cost
~7 MB), goal <= 150 KB.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import threading

import procfs

from shinken_sync.client import aconnect
from shinken_sync.providers.local import LocalFleetProvider

#: Warm-up connections opened and closed first, so one-time costs (lazy
#: imports, allocator arenas, the executor) do not land on the measured ones.
WARMUP = 16
DIAL_CONCURRENCY = 32


def rss_bytes() -> int:
    rss = procfs.status_bytes("self", "VmRSS")
    assert rss is not None
    return rss


async def settle() -> int:
    await asyncio.sleep(1.0)
    gc.collect()
    await asyncio.sleep(0.2)
    return rss_bytes()


async def measure(endpoints: list[tuple[str, str]], jitter: float) -> tuple[int, int, int]:
    sem = asyncio.Semaphore(DIAL_CONCURRENCY)

    async def dial(url: str, token: str):
        async with sem:
            return await aconnect(url, token, ping_jitter=jitter)

    warm = await asyncio.gather(*(dial(u, t) for u, t in endpoints[:WARMUP]))
    for sb in warm:
        await sb.screen_size()
        await sb.close()
    before = await settle()
    sandboxes = await asyncio.gather(*(dial(u, t) for u, t in endpoints))
    await asyncio.gather(*(sb.screen_size() for sb in sandboxes))  # each connection used once
    after = await settle()
    threads = threading.active_count()
    for sb in sandboxes:
        await sb.close()
    return before, after, threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--ping-jitter", type=float, default=10.0)
    args = parser.parse_args()
    with LocalFleetProvider(args.n) as fleet:
        endpoints = [fleet.endpoint(h) for h in fleet.create_many(args.n)]
        random.shuffle(endpoints)
        before, after, threads = asyncio.run(measure(endpoints, args.ping_jitter))
    per_conn = (after - before) / args.n
    print(f"N={args.n} idle connections on one loop (fleet host in a separate process):")
    print(f"  RSS before {before / 2**20:.1f} MiB, after {after / 2**20:.1f} MiB, threads {threads}")
    print(f"  marginal RSS per connection: {per_conn / 1024:.1f} KiB  (target <= 1024 KiB, goal <= 150 KiB)")


if __name__ == "__main__":
    main()
