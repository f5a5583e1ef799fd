"""Blocking-facade overhead: ``Sandbox`` vs the async core, small calls, same run.

One fleet host (``shinkend --fleet C``) serves C sandboxes; one client process
opens C blocking ``Sandbox`` facades on the shared loop and measures
``cursor()`` round trips per second two ways over the *same* connections:

* ``async``: ``AsyncSandbox.cursor()`` from C tasks gathered on the loop thread
  (the async core alone, no thread crossing);
* ``sync``:  ``Sandbox.cursor()`` from C callers, OS threads (``plain``) or
  gevent greenlets (``gevent``, a process patched before anything else).

The two alternate for ``--repeats`` rounds and the best of each is kept. Also
reported: one caller alone (serial round trips/s, latency-bound) both ways.
The target is facade >= 70% of the async core at concurrency C.

    python bench/sync_overhead.py                       # plain and gevent, C=64
    python bench/sync_overhead.py --concurrency 256 --calls 100 --modes gevent
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

TARGET_RATIO = 0.70


def child(mode: str, urls: list[str], token: str, calls: int, repeats: int) -> dict[str, float]:
    if mode == "gevent":
        from gevent import monkey

        monkey.patch_all()
    import asyncio
    import threading

    from shinken_sync.sharedloop import SharedLoop
    from shinken_sync.sync import connect

    shared = SharedLoop.default()
    sandboxes = [connect(url, token=token) for url in urls]

    def run_callers(target, n: int) -> None:
        if mode == "gevent":
            import gevent

            gevent.joinall([gevent.spawn(target, sb) for sb in sandboxes[:n]], raise_error=True)
        else:
            threads = [threading.Thread(target=target, args=(sb,)) for sb in sandboxes[:n]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def sync_rate(n: int) -> float:
        def caller(sb) -> None:
            for _ in range(calls):
                sb.cursor()

        start = time.perf_counter()
        run_callers(caller, n)
        return n * calls / (time.perf_counter() - start)

    def async_rate(n: int) -> float:
        async def caller(asb) -> None:
            for _ in range(calls):
                await asb.cursor()

        async def fan_out() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(caller(sb._async) for sb in sandboxes[:n]))
            return n * calls / (time.perf_counter() - start)

        return shared.run(fan_out(), timeout=600)

    sync_rate(len(sandboxes))  # warm up both paths (lazy imports, first allocations)
    async_rate(len(sandboxes))
    best: dict[str, float] = {"async_1": 0.0, "sync_1": 0.0, "async_c": 0.0, "sync_c": 0.0}
    for _ in range(repeats):
        best["async_1"] = max(best["async_1"], async_rate(1))
        best["sync_1"] = max(best["sync_1"], sync_rate(1))
        best["async_c"] = max(best["async_c"], async_rate(len(sandboxes)))
        best["sync_c"] = max(best["sync_c"], sync_rate(len(sandboxes)))
    for sb in sandboxes:
        sb.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64, help="sandboxes = callers (default 64)")
    parser.add_argument("--calls", type=int, default=200, help="cursor() calls per caller per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["plain", "gevent"], choices=["plain", "gevent"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(spec["mode"], spec["urls"], spec["token"], args.calls, args.repeats)))
        return

    from shinken_sync.providers.local import LocalFleetProvider

    with LocalFleetProvider(args.concurrency, screen=(1024, 768)) as fleet:
        handles = fleet.create_many(args.concurrency)
        urls = [h.url for h in handles]
        token = handles[0].token
        print(f"cursor() round trips/s, {args.concurrency} sandboxes on one fleet host, "
              f"{args.calls} calls per caller, best of {args.repeats}")  # fmt: skip
        print(f"{'mode':8} {'callers':>8} {'async core':>11} {'facade':>9} {'facade/async':>13}")
        for mode in args.modes:
            spec = json.dumps({"mode": mode, "urls": urls, "token": token})
            out = subprocess.run(
                [sys.executable, __file__, "--child", spec, "--calls", str(args.calls),
                 "--repeats", str(args.repeats)],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            r = json.loads(out)
            for label, a, s in (("1", r["async_1"], r["sync_1"]), (str(args.concurrency), r["async_c"], r["sync_c"])):
                print(f"{mode:8} {label:>8} {a:11.0f} {s:9.0f} {s / a:12.0%}")
            verdict = "PASS" if r["sync_c"] / r["async_c"] >= TARGET_RATIO else "FAIL"
            print(f"{mode:8} target facade >= {TARGET_RATIO:.0%} of async at {args.concurrency} callers: {verdict}")


if __name__ == "__main__":
    main()
