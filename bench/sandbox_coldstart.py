"""Isolated sandboxes: cold start (create -> first screenshot) and idle memory, beside local ones.

    sudo python bench/sandbox_coldstart.py [--reps 10] [--many 16] [--displays virtual,xvfb]
                                           [--xvfb-args "--desktop wm"]

For each display and each provider (``local``: a shinkend process on loopback; ``isolated``:
the same daemon under bubblewrap in its own namespaces and cgroup, dialed over its unix
socket), in one run so the figures read against each other:

* one at a time: ``create()`` then ``connect`` then the first ``screenshot()`` (JPEG q80),
  ``--reps`` times, p50/p95 of the whole span;
* ``--many`` at once: ``create_many(N)``, then each sandbox connected and screenshotted from
  its own thread; each sandbox's span runs from the call's start to its own first
  screenshot, p50/p95 over the N;
* idle memory per sandbox, after the first screenshot: the PSS (and RSS) of every process
  the sandbox holds (the isolated one's from its cgroup: bwrap, its init, shinkend, Xvfb).

Needs root and bubblewrap (the isolated provider's prerequisites). The machine is shared:
read ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
from typing import Any

from shinken_sync.providers.config import IsolatedConfig, LocalConfig, make_provider
from shinken_sync.stats import percentile

SCREEN = (1280, 800)


def _pss_rss_kib(pids: set[int]) -> tuple[int, int]:
    pss = rss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key == "Pss":
                        pss += int(value.split()[0])
                    elif key == "Rss":
                        rss += int(value.split()[0])
        except OSError:
            continue
    return pss, rss


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _pids(handle: Any) -> set[int]:
    cgroup = getattr(handle.daemon, "cgroup", None)
    return cgroup.pids() if cgroup is not None else _descendants(handle.pid)


#: More shinkend flags for the xvfb runs (a desktop's options), from --xvfb-args.
XVFB_ARGS: tuple[str, ...] = ()


def _config(kind: str, display: str) -> Any:
    extra = XVFB_ARGS if display == "xvfb" else ()
    if kind == "local":
        return LocalConfig(display=display, screen=SCREEN, extra_args=extra)
    return IsolatedConfig(display=display, screen=SCREEN, extra_args=extra)


def one_at_a_time(kind: str, display: str, reps: int) -> tuple[list[float], list[tuple[int, int]]]:
    spans, memory = [], []
    with make_provider(_config(kind, display)) as provider:
        for _ in range(reps):
            t0 = time.perf_counter()
            handle = provider.create()
            with provider.connect(handle) as sb:
                sb.screenshot(format="jpeg", quality=80)
                spans.append(time.perf_counter() - t0)
                time.sleep(0.5)  # idle: what it holds between turns
                memory.append(_pss_rss_kib(_pids(handle)))
            provider.destroy(handle)
    return spans, memory


def many_at_once(kind: str, display: str, n: int) -> list[float]:
    with make_provider(_config(kind, display)) as provider:
        t0 = time.perf_counter()
        handles = provider.create_many(n, parallelism=n)
        spans: list[float] = []
        lock = threading.Lock()

        def first_screenshot(handle: Any) -> None:
            with provider.connect(handle) as sb:
                sb.screenshot(format="jpeg", quality=80)
                with lock:
                    spans.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=first_screenshot, args=(h,)) for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return spans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--many", type=int, default=16)
    parser.add_argument("--displays", default="virtual,xvfb")
    parser.add_argument("--xvfb-args", default="", help="more shinkend flags for the xvfb runs, e.g. a desktop's")
    args = parser.parse_args()
    global XVFB_ARGS
    XVFB_ARGS = tuple(shlex.split(args.xvfb_args))
    if os.geteuid() != 0:
        print("needs root (the isolated provider maps users and creates cgroups)", file=sys.stderr)
        return 2
    print(f"{'display':<8} {'provider':<9} {'one: p50':>9} {'p95':>8}   {f'{args.many} at once: p50':>18} {'p95':>8}"
          f"   {'idle PSS':>9} {'RSS':>8}")
    for display in args.displays.split(","):
        for kind in ("local", "isolated"):
            spans, memory = one_at_a_time(kind, display, args.reps)
            many = many_at_once(kind, display, args.many)
            ms = [s * 1e3 for s in spans]
            mm = [s * 1e3 for s in many]
            pss = percentile([m[0] / 1024 for m in memory], 50)
            rss = percentile([m[1] / 1024 for m in memory], 50)
            print(f"{display:<8} {kind:<9} {percentile(ms, 50):7.0f} ms {percentile(ms, 95):5.0f} ms   "
                  f"{percentile(mm, 50):15.0f} ms {percentile(mm, 95):5.0f} ms   {pss:6.1f} MiB {rss:5.1f} MiB",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
