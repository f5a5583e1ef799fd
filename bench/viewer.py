"""The viewer's costs, measured in Debian's headless Chromium against a real session server.

1. ``open``: a 200-turn session with one 1280x720 screenshot per turn (and one rollback) opened
   in the viewer: first contentful paint and interactive (the page's ``viewer-interactive``
   mark: timeline and token view rendered), from navigation start; the first open builds the
   timeline in the worker (cold), the others read its cache (warm). Also the timeline's size.
2. ``chat``: tiny-chat latency p50/p99 on the same server (router, 2 workers) with no viewer,
   then with 4 Chromium tabs showing the viewer (2 on the 200-turn session page, which polls
   its summary, 2 on the session list, which polls the list), alternating rounds.
3. ``grid``: 64 virtual sandboxes (one ``shinkend --fleet 64`` host), rounds paced at 1 Hz, each
   round every sandbox one ``step([click], observe=JPEG q80 @1280)`` from its own thread (the
   shared click spots of bench/fleet.py); step p50/p99 without a viewer, then with
   ``FleetPublisher`` forwarding every screen (1 fps @320 px) and a Chromium tab on the live
   grid with one tile opened at full rate, alternating blocks of 15 rounds.

``python bench/viewer.py [open|chat|grid|all] [--quick]``; figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.cdp, tests.viewer_rollout
from scratch import scratch_state_home

from shinken_sync.stats import percentile
from tests.cdp import Browser
from tests.viewer_rollout import drive
from webapp.serve import start_session_server


def _server(workers: int) -> Any:
    return start_session_server(workers, None, "127.0.0.1:0")


def _ms(values: list[float]) -> str:
    return f"p50 {percentile(values, 50) * 1000:.1f} ms, p99 {percentile(values, 99) * 1000:.1f} ms"


def bench_open(turns: int, runs: int) -> None:
    server = _server(2)
    try:
        t0 = time.perf_counter()
        rollout = drive(server.url, turns, image_size=(1280, 720), rollback_at=turns // 2, hostile=False)
        print(f"open: drove {turns} turns (+{rollout.rollbacks} rolled back) in {time.perf_counter() - t0:.1f} s")
        summary = requests.get(f"{server.url}/ui/api/sessions/{rollout.session_id}", timeout=30).json()
        print(f"open: session of {summary['turns']} turns, {summary['tokens']} tokens, {summary['images']} images")
        browser = Browser()
        try:
            paints, ready = [], []
            for run in range(runs):
                page = browser.new_page(1440, 900)
                page.navigate(f"{server.url}/ui/sessions/{rollout.session_id}", timeout=60)
                fcp, interactive = page.evaluate(
                    "[performance.getEntriesByName('first-contentful-paint')[0].startTime,"
                    " performance.getEntriesByName('viewer-interactive')[0].startTime]")
                rows = page.evaluate("document.querySelectorAll('.tokens .row').length")
                page.close()
                kind = "cold" if run == 0 else "warm"
                print(f"open run {run} ({kind}): first paint {fcp:.0f} ms, interactive {interactive:.0f} ms, "
                      f"token rows in the DOM {rows}")
                if run:
                    paints.append(fcp)
                    ready.append(interactive)
            print(f"open warm median: first paint {statistics.median(paints):.0f} ms, "
                  f"interactive {statistics.median(ready):.0f} ms")
        finally:
            browser.close()
        t0 = time.perf_counter()
        body = requests.get(f"{server.url}/ui/api/sessions/{rollout.session_id}/timeline", timeout=60).content
        print(f"open: timeline {len(body) / 1e6:.2f} MB (cached GET {1000 * (time.perf_counter() - t0):.0f} ms); "
              f"records GET for comparison: {len(requests.get(f'{server.url}/sessions/{rollout.session_id}', timeout=120).content) / 1e6:.1f} MB")
    finally:
        server.close(timeout=15)


def _chat_round(url: str, session_id: str, n: int, http: requests.Session) -> list[float]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "bench"}]
    out = []
    chat = f"{url}/sessions/{session_id}/v1/chat/completions"
    for i in range(n):
        messages.append({"role": "user", "content": f"step {i}"})
        t0 = time.perf_counter()
        reply = http.post(chat, json={"messages": messages, "max_tokens": 16}, timeout=60)
        out.append(time.perf_counter() - t0)
        reply.raise_for_status()
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
    return out


def bench_chat(chats: int, rounds: int, viewers: int) -> None:
    server = _server(2)
    try:
        long = drive(server.url, 200, image_size=(1280, 720), rollback_at=None, hostile=False)
        for _ in range(20):
            drive(server.url, 1, rollback_at=None, hostile=False)
        browser = Browser()
        http = requests.Session()
        none: list[float] = []
        watched: list[float] = []
        try:
            for r in range(rounds):
                for with_viewers in (False, True):
                    pages = []
                    if with_viewers:
                        for v in range(viewers):
                            page = browser.new_page(1280, 800)
                            path = f"/ui/sessions/{long.session_id}" if v % 2 == 0 else "/ui/"
                            page.navigate(server.url + path, timeout=60)
                            pages.append(page)
                        time.sleep(2.0)  # past the pages' first render: measure their polling
                    sid = http.post(f"{server.url}/sessions", timeout=10).json()["session_id"]
                    got = _chat_round(server.url, sid, chats, http)
                    (watched if with_viewers else none).extend(got)
                    print(f"chat round {r} {'with' if with_viewers else 'without'} {viewers} viewers: {_ms(got)}")
                    for page in pages:
                        page.close()
        finally:
            browser.close()
        ratio50 = percentile(watched, 50) / percentile(none, 50)
        ratio99 = percentile(watched, 99) / percentile(none, 99)
        print(f"chat without viewers: {_ms(none)}; with {viewers}: {_ms(watched)}; "
              f"ratio p50 x{ratio50:.2f}, p99 x{ratio99:.2f} (target <= 1.1)")
    finally:
        server.close(timeout=15)


GRID_VARIANTS = ("publish", "page", "focus")  # publisher only; + the grid page; + one tile opened


def bench_grid(n: int, rounds: int, blocks: int, variant: str = "focus") -> None:
    from fleet_measure import OBSERVE, ROUND_PERIOD_S, SHARED_CLICK_SPOTS

    from shinken_sync.fleet_view import FleetPublisher, Tile
    from shinken_sync.providers.local import LocalFleetProvider

    server = _server(0)
    provider = LocalFleetProvider(n, screen=(1920, 1080))
    sandboxes = [provider.connect(provider.create()) for _ in range(n)]
    counter = [0]

    def one_round() -> list[float]:
        # Every sandbox clicks the same spot (moving each round), as bench/fleet.py's shared
        # clicks: the host renders each round's screen once, so the client side is measured.
        x, y = SHARED_CLICK_SPOTS[counter[0] % len(SHARED_CLICK_SPOTS)]
        counter[0] += 1
        out: list[float] = []

        def step(sb: Any) -> None:
            t0 = time.perf_counter()
            sb.step([{"verb": "click", "x": x, "y": y}], observe=OBSERVE)
            out.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=step, args=(sb,)) for sb in sandboxes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def paced(k: int) -> list[float]:
        out: list[float] = []
        tick = time.monotonic()
        for _ in range(k):
            out += one_round()
            tick += ROUND_PERIOD_S
            time.sleep(max(0.0, tick - time.monotonic()))
        return out

    browser = Browser()
    off: list[float] = []
    on: list[float] = []
    try:
        paced(2)  # warm-up
        for b in range(blocks):
            for with_grid in (False, True):
                publisher = page = None
                if with_grid:
                    publisher = FleetPublisher(server.url, [Tile(f"sb{i}", f"sandbox {i}", sb)
                                                            for i, sb in enumerate(sandboxes)], name="bench")
                    fleet_url = publisher.start()
                    if variant != "publish":
                        page = browser.new_page(1600, 1000)
                        page.navigate(fleet_url, timeout=60)
                    if variant == "focus":
                        page.evaluate("document.querySelector('.tile[data-tile=\"sb3\"]').click()")
                    time.sleep(2.0)
                got = paced(rounds)
                (on if with_grid else off).extend(got)
                sent = f", {publisher.frames_sent} frames forwarded" if publisher else ""
                print(f"grid block {b} {f'with the live grid ({variant})' if with_grid else 'without'}: {_ms(got)}{sent}")
                if page is not None:
                    page.close()
                if publisher is not None:
                    publisher.close()
        print(f"grid step without the viewer: {_ms(off)}; with: {_ms(on)}; "
              f"ratio p50 x{percentile(on, 50) / percentile(off, 50):.2f}, "
              f"p99 x{percentile(on, 99) / percentile(off, 99):.2f}")
    finally:
        browser.close()
        for sb in sandboxes:
            sb.close()
        provider.close()
        server.close(timeout=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", default="all", choices=("open", "chat", "grid", "all"))
    parser.add_argument("--quick", action="store_true", help="fewer turns, chats and rounds (a smoke run)")
    parser.add_argument("--grid-variant", choices=GRID_VARIANTS, default="focus",
                        help="grid: what runs beside the agents (default: publisher, grid page, one tile open)")
    parser.add_argument("--blocks", type=int, default=None, help="grid: blocks of rounds per side (default 3)")
    args = parser.parse_args()
    scratch_state_home()
    quick = args.quick
    if args.which in ("open", "all"):
        bench_open(turns=40 if quick else 200, runs=3 if quick else 6)
    if args.which in ("chat", "all"):
        bench_chat(chats=50 if quick else 200, rounds=1 if quick else 3, viewers=4)
    if args.which in ("grid", "all"):
        bench_grid(n=16 if quick else 64, rounds=5 if quick else 15,
                   blocks=args.blocks or (1 if quick else 3), variant=args.grid_variant)


if __name__ == "__main__":
    main()
