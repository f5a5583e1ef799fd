"""``shinken demo --ray auto|ADDRESS``: the demo's rollout spread over a Ray cluster.

The process that runs this is the Ray driver. It places the sandboxes with
:class:`~shinken_sync.providers.ray_cluster.RayProvider` (spread over the nodes), starts K
:class:`EpisodeDriver` actors (spread too), gives each its share of the episodes and gathers
what they return into the same outputs as the single-process demo (:func:`demo.write_outputs`).
Each driver actor is its own process with its own :class:`~shinken_sync.sync.SharedLoop` and
blocking :class:`~shinken_sync.sync.Sandbox` es, one thread per episode, running the very
same :func:`demo.run_episode` against the session server(s) at ``--session-server`` (the
front proxy: nginx in front of several instances, docs/scale-out.md) or, without it, a
session server this process starts on its own node's cluster address.

Failure costs only what failed: a sandbox whose node died ends its episode with
``SandboxDied`` and Ray's cause; a driver actor that died (its node, or its process) marks
its episodes ``DriverLost`` with Ray's cause; every other episode finishes and is written.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from shinken_sync import demo
from shinken_sync.errors import ShinkenError

__all__ = ["EpisodeDriver", "run"]


class DriverLost(Exception):
    """A driver actor died before returning its episodes (Ray's cause in the message)."""


_GATHER_POLL = 0.2  # s: how soon the gather loop sees a Ctrl-C


class EpisodeDriver:
    """One driver actor's body (wrapped with ``ray.remote`` on use, so this imports without Ray)."""

    def __init__(self) -> None:
        from shinken_sync.sharedloop import SharedLoop

        self.loop = SharedLoop()  # this driver's own loop thread for all its sandboxes
        self.node_ip = _own_node_ip()
        self.stopping = threading.Event()

    def connect(self, jobs: list[tuple[int, Any]]) -> str:
        """Dial one sandbox per ``(index, RaySandbox)`` (before the rollout clock starts, as the
        single-process demo does); a sandbox that cannot be dialled fails only its episode."""
        from shinken_sync.providers.ray_cluster import probe
        from shinken_sync.sync import connect

        self.episodes = [demo.Episode(index=i, sandbox_id=f"{h.sandbox_id}@{h.node_ip}") for i, h in jobs]
        self.sandboxes: list[Any] = []
        for ep, (_, handle) in zip(self.episodes, jobs):
            try:
                self.sandboxes.append(connect(handle.url, token=handle.token, loop=self.loop,
                                              liveness_probe=lambda h=handle: probe(h)))
            except ShinkenError as exc:
                ep.error = f"{type(exc).__name__}: {exc}"
                self.sandboxes.append(None)
        return self.node_ip

    def run(self, server: str, turns: int) -> dict[str, Any]:
        """Run the connected episodes; return them and the timings."""
        progress = demo.Progress(len(self.episodes) * turns, stream=io.StringIO())
        http = requests.Session()
        http.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=max(10, len(self.episodes))))

        def worker(ep: demo.Episode, sandbox: Any) -> None:
            if sandbox is None:
                return
            try:
                demo.run_episode(ep, sandbox, server, turns, http, self.stopping, progress)
            except Exception as exc:  # noqa: BLE001 (one failing episode never stops the others)
                ep.error = f"{type(exc).__name__}: {exc}"
            finally:
                with contextlib.suppress(ShinkenError):
                    sandbox.close()

        with ThreadPoolExecutor(max_workers=max(1, len(self.episodes)), thread_name_prefix="episode") as pool:
            list(pool.map(worker, self.episodes, self.sandboxes))
        return {"episodes": self.episodes, "node_ip": self.node_ip, "done": progress.done,
                "latencies": progress.latencies, "chats": progress.chats, "observes": progress.observes,
                "outcomes": progress.outcomes}

    def stop(self) -> None:
        """Ctrl-C on the driver: finish the turns in flight, keep every episode's records so far."""
        self.stopping.set()


def _own_node_ip() -> str:
    """This process's node address as the cluster knows it (never a guess of our own)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    address: str = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)  # ray is Any
    return address


def _connect(address: str, node_ip: str | None) -> None:
    import ray

    kwargs: dict[str, Any] = {"_node_ip_address": node_ip} if node_ip else {}
    # Workers import shinken_sync from the driver's PYTHONPATH when it is set (an editable
    # checkout); an installed package is importable anyway.
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    ray.init(address=address, logging_level="warning", log_to_driver=False,
             runtime_env={"env_vars": env} if env else None, **kwargs)


def _merge(progress: demo.Progress, part: dict[str, Any]) -> None:
    progress.done += part["done"]
    progress.latencies += part["latencies"]
    progress.chats += part["chats"]
    progress.observes += part["observes"]
    for outcome, count in part["outcomes"].items():
        progress.outcomes[outcome] = progress.outcomes.get(outcome, 0) + count


def run(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray.exceptions import RayActorError
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise demo.DemoError("--ray needs Ray: pip install 'shinken[ray]'") from None
    from shinken_sync.providers.ray_cluster import SANDBOX_RESOURCE, RayProvider

    demo.check_display(args.display)
    overrides = demo.environment_overrides(starts_server=args.session_server is None)
    out = demo.prepare_out(args.out)
    try:
        _connect(args.ray, args.node_ip)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise demo.DemoError(f"--ray {args.ray}: cannot connect to the Ray cluster: {exc}") from None
    server = None
    provider = None
    group = None
    interrupted = False
    drivers: list[Any] = []
    episodes: list[demo.Episode] = []
    progress = demo.Progress(args.sandboxes * args.turns)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        k = args.drivers or len(nodes)
        if args.session_server:
            server_url = args.session_server.rstrip("/")
        else:
            host = _own_node_ip()
            # Bound by the server itself on this node's cluster address (port 0: it reports the port).
            server = demo.start_session_server(args.workers, args.port, out / demo.SERVER_LOG, host=host)
            server_url = f"{host} (starting)"
        print(f"shinken demo (ray {args.ray}): {demo.plural(args.sandboxes, args.display + ' sandbox', args.display + ' sandboxes')} "
              f"x {demo.plural(args.turns, 'turn')} on {demo.plural(len(nodes), 'node')}, "
              f"{demo.plural(k, 'driver actor')}, session server {server_url} -> {out}/", file=sys.stderr)
        demo.report_environment(overrides)
        provider = RayProvider(strategy="spread", use_sandbox_resource=SANDBOX_RESOURCE in ray.cluster_resources(),
                               display=args.display, screen=demo.SCREEN,
                               extra_args=demo.display_args(args.display))
        handles = provider.create_many(args.sandboxes)
        if server is not None:
            server_url = demo.wait_ready(server)
        # max_concurrency 2: stop() must run while run() does.
        driver_class = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=2)(EpisodeDriver)
        # One bundle per driver, spread: the drivers land on distinct nodes while there are
        # enough, so a lost node costs at most its own share of episodes.
        group = placement_group([{"CPU": 0.001}] * k, strategy="SPREAD")
        ray.get(group.ready(), timeout=120)
        drivers = [driver_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=i)).remote() for i in range(k)]
        shares: list[list[tuple[int, Any]]] = [list(enumerate(handles))[d::k] for d in range(k)]
        episodes = [demo.Episode(index=i, sandbox_id=f"{h.sandbox_id}@{h.node_ip}") for i, h in enumerate(handles)]
        # Drivers start and dial their sandboxes before the clock starts (as the single-process
        # demo connects before it); a driver lost here loses its episodes like one lost later.
        connected = [d.connect.remote(share) for d, share in zip(drivers, shares)]
        ray.wait(connected, num_returns=len(connected))
        progress.start()
        futures = [d.run.remote(server_url, args.turns) for d in drivers]
        gathered = 0
        with demo.CtrlC(raise_from=2) as ctrl_c:  # the second Ctrl-C aborts at once
            while gathered < len(futures):
                if ctrl_c.count and not interrupted:
                    interrupted = True
                    print("\nshinken demo: interrupted; the drivers finish the turns in flight and keep every "
                          "episode's records so far", file=sys.stderr)
                    for actor in drivers:
                        actor.stop.remote()
                share, future = shares[gathered], futures[gathered]
                if not ray.wait([future], timeout=_GATHER_POLL)[0]:
                    continue
                try:
                    part = ray.get(future)
                except RayActorError as exc:
                    cause = " ".join(str(exc).split())[:600]
                    for index, _ in share:
                        episodes[index].error = f"{DriverLost.__name__}: {cause}"
                else:
                    for ep in part["episodes"]:
                        episodes[ep.index] = ep
                    _merge(progress, part)
                gathered += 1
        progress.finish()
    finally:
        for actor in drivers:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        if group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        if provider is not None:
            provider.close()
        if server is not None:
            server.close(timeout=15)
        ray.shutdown()
    return demo.write_outputs(out, episodes, progress, interrupted=interrupted)
