"""A Ray driver the scale-out tests run on the head's host (``ip netns exec``): it uses
RayProvider and reports on stdout, one JSON object a line. Modes:

* ``spread N``: N sandboxes spread; prints ``placed``; connects and observes each, prints
  ``connected``; waits for a line on stdin (the test removes a node meanwhile); then every
  sandbox steps for RUN_S seconds; prints ``result`` (per sandbox: steps done, or the error's
  class and detail); closes the provider and prints ``closed``.
* ``pack N``: N sandboxes packed; prints ``placed``; closes.
* ``unplaceable``: asks for more ``sandbox`` resource than any node has; prints the error.
* ``fleet N``: N sandboxes from ``--fleet 4`` hosts asking 64 MiB each; prints ``placed``;
  steps each once, prints ``stepped``; destroys them one by one, prints ``destroyed``; then
  one more sandbox starts a fresh host (prints ``placed``, steps it, prints ``refilled``).
* ``hold N``: N sandboxes spread; prints ``placed`` with the daemons' pids; sleeps (the test kills it).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import ray

from shinken_sync.errors import ShinkenError
from shinken_sync.providers import ProviderError
from shinken_sync.providers.ray_cluster import RayProvider

RUN_S = 8.0  # every sandbox steps this long; the test removes a node meanwhile


def say(**obj: object) -> None:
    print(json.dumps(obj), flush=True)


def placed(provider: RayProvider, handles: list) -> None:
    say(event="placed", nodes=provider.nodes_of(handles),
        sandboxes=[{"id": h.sandbox_id, "node_ip": h.node_ip, "pid": h.pid, "url": h.url} for h in handles])


def spread(n: int) -> None:
    with RayProvider(strategy="spread") as provider:
        handles = provider.create_many(n)
        placed(provider, handles)
        boxes = [provider.connect(h) for h in handles]
        for box in boxes:
            box.screenshot(format="png")
        say(event="connected")
        sys.stdin.readline()
        results: dict[str, dict] = {}

        def drive(handle, box) -> None:
            done, end = 0, time.monotonic() + RUN_S
            try:
                while time.monotonic() < end:
                    row = box.step([{"verb": "click", "x": 10 + done % 100, "y": 20}], observe={"format": "png"}).rows[0]
                    if row.error is not None:
                        raise row.error
                    done += 1
                    time.sleep(0.05)
                results[handle.sandbox_id] = {"steps": done, "node_ip": handle.node_ip}
            except ShinkenError as exc:
                results[handle.sandbox_id] = {"steps": done, "node_ip": handle.node_ip, "error": type(exc).__name__,
                                              "detail": getattr(exc, "detail", ""), "message": str(exc)}

        threads = [threading.Thread(target=drive, args=pair) for pair in zip(handles, boxes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        say(event="result", results=results)
        for box in boxes:
            try:
                box.close()
            except ShinkenError:
                pass
    say(event="closed")


def pack(n: int) -> None:
    with RayProvider(strategy="pack") as provider:
        placed(provider, provider.create_many(n))


def unplaceable() -> None:
    with RayProvider(sandboxes_per_host=1000, start_timeout=5) as provider:
        try:
            provider.create()
        except ProviderError as exc:
            say(event="error", type=type(exc).__name__, message=str(exc))


def fleet(n: int) -> None:
    with RayProvider(strategy="spread", sandboxes_per_host=4, memory=64 * 2**20) as provider:
        handles = provider.create_many(n)
        placed(provider, handles)
        for handle in handles:
            box = provider.connect(handle)
            row = box.step([{"verb": "click", "x": 5, "y": 5}]).rows[0]
            box.close()
            if row.error is not None:
                raise row.error
        say(event="stepped", liveness=[provider.check_alive(h).alive for h in handles])
        for handle in handles:
            provider.destroy(handle)
        say(event="destroyed")
        fresh = provider.create()
        placed(provider, [fresh])
        box = provider.connect(fresh)
        say(event="refilled", outcome=box.step([{"verb": "click", "x": 6, "y": 6}]).rows[0].outcome)
        box.close()


def hold(n: int) -> None:
    provider = RayProvider(strategy="spread")
    placed(provider, provider.create_many(n))
    time.sleep(600)


def main() -> None:
    ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ["SHINKEN_RAY_NODE_IP"],
             logging_level="warning", log_to_driver=False)
    mode, *rest = sys.argv[1:]
    {"spread": spread, "pack": pack, "unplaceable": unplaceable, "fleet": fleet, "hold": hold}[mode](*map(int, rest))


if __name__ == "__main__":
    main()
