"""Memory and threads of one process holding N blocking ``Sandbox`` facades.

For each N (default 64, 256, 1024) a fleet host (``shinkend --fleet N``)
serves N sandboxes, and a fresh client interpreter:

1. imports the SDK, starts the shared loop and records RSS, threads and fds;
2. opens N ``Sandbox`` facades (at most 64 dials in flight, the seed's pacing)
   and calls ``cursor()`` on each, from the callers you pick: ``gevent`` (one
   greenlet per sandbox, patched process) or ``threads`` (a pool of 32 OS
   threads shared by all sandboxes);
3. records RSS, threads and fds again, with every sandbox still open.

The claim under test: native threads do not depend on N (the loop thread
multiplexes every connection), and the marginal memory per sandbox is far
below the ~7 MB and 2 threads a thread-per-connection facade costs.

    python bench/sync_scale.py                     # gevent callers, N = 64 256 1024
    python bench/sync_scale.py --callers threads --ns 64 256
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import procfs

DIALS_IN_FLIGHT = 64
THREAD_POOL = 32


def sample() -> dict[str, int]:
    return {
        "rss_kb": int(procfs.status()["VmRSS"].split()[0]),
        "threads": procfs.thread_count(),
        "fds": procfs.fd_count(),
    }


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def child(callers: str, urls: list[str], token: str) -> dict[str, dict[str, int]]:
    if callers == "gevent":
        from gevent import monkey

        monkey.patch_all()
    from concurrent.futures import ThreadPoolExecutor

    from shinken_sync.sharedloop import SharedLoop
    from shinken_sync.sync import connect

    raise_fd_limit()
    SharedLoop.default().loop  # noqa: B018 -- start the loop thread before the baseline
    if callers == "gevent":
        import gevent
        from gevent.pool import Pool

        gevent.get_hub()
        dials = Pool(DIALS_IN_FLIGHT)

        def open_all() -> list:
            return list(dials.map(lambda url: connect(url, token=token), urls))

        def call_all(sandboxes: list) -> None:
            gevent.joinall([gevent.spawn(sb.cursor) for sb in sandboxes], raise_error=True)

        before = sample()
        sandboxes = open_all()
        call_all(sandboxes)
    else:
        before = sample()  # the pool's threads count as the program's own callers below
        with ThreadPoolExecutor(THREAD_POOL) as pool:
            sandboxes = list(pool.map(lambda url: connect(url, token=token), urls))
            list(pool.map(lambda sb: sb.cursor(), sandboxes))
            after = sample()
    if callers == "gevent":
        after = sample()
    for sb in sandboxes:
        sb.close()
    return {"before": before, "after": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--callers", choices=["gevent", "threads"], default="gevent")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(args.callers, spec["urls"], spec["token"])))
        return

    from shinken_sync.providers.local import LocalFleetProvider

    raise_fd_limit()  # inherited by the fleet host and the client
    print(f"one client process, N blocking Sandboxes open at once, callers: {args.callers}")
    print(f"{'N':>6} {'RSS before':>11} {'RSS after':>10} {'per sandbox':>12} {'threads':>12} {'fds':>12}")
    thread_counts = set()
    for n in args.ns:
        with LocalFleetProvider(n, screen=(1024, 768)) as fleet:
            handles = fleet.create_many(n)
            spec = json.dumps({"urls": [h.url for h in handles], "token": handles[0].token})
            out = subprocess.run(
                [sys.executable, __file__, "--child", spec, "--callers", args.callers],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
        r = json.loads(out)
        b, a = r["before"], r["after"]
        per = (a["rss_kb"] - b["rss_kb"]) / n
        thread_counts.add(a["threads"])
        print(
            f"{n:>6} {b['rss_kb'] / 1024:9.1f}MB {a['rss_kb'] / 1024:8.1f}MB {per:9.1f} KB"
            f" {b['threads']:>5} -> {a['threads']:<4} {b['fds']:>5} -> {a['fds']:<5}"
        )
    verdict = "PASS" if len(thread_counts) == 1 else "FAIL"
    print(f"threads independent of N: {verdict} ({sorted(thread_counts)})")


if __name__ == "__main__":
    main()
