"""Sandboxes as Ray actors across a Ray cluster's nodes (optional extra ``shinken[ray]``).

Each sandbox host is one Ray actor, :class:`SandboxHostActor`, that starts one ``shinkend``
(or a ``--fleet K`` host serving K sandboxes) as its child on the node Ray placed it on,
bound to that node's IP (``ray.util.get_node_ip_address()``: the address the node joined the
cluster with, so the driver reaches the daemon where it reaches the node). The daemon gets
a 32-byte random token in a 0600 file (:mod:`.process`); the token travels back to the
driver inside Ray's own object transfer.

Placement: every :meth:`RayProvider.create_many` call reserves one placement group whose
bundles are the hosts' resource requests (``num_cpus``, ``memory`` bytes, and the custom
``sandbox`` resource: one unit per sandbox, so a node started with
``--resources '{"sandbox": 64}'`` holds at most 64) with strategy ``SPREAD`` or ``PACK``.
A request the cluster cannot satisfy in ``start_timeout`` is a :class:`ProviderError` naming
what was asked, never a hang.

Lifetime: the actors are non-detached and ``max_restarts=0``: they belong to the driver
process, so when the driver exits or is killed Ray's GCS kills them, and each actor's daemon
dies with its actor (``PR_SET_PDEATHSIG`` from :mod:`.process`). :meth:`RayProvider.destroy`
and :meth:`RayProvider.close` kill them explicitly and free the placement groups.

Death: :meth:`RayProvider.check_alive` asks the actor for its daemon's liveness; an actor
that is gone (its worker process or its node died) is reported as dead with Ray's cause
(``RayActorError``'s text: "The actor died because its node has died..."), which the SDK
raises as ``SandboxDied``. :func:`probe` is the same check from any process of the cluster
(the demo's driver actors hold borrowed handles).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from .base import Liveness, Provider
from .errors import ProviderError, UnknownHandle
from .local import daemon_argv
from .process import DEFAULT_START_TIMEOUT_S

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _exc:  # the optional extra is missing
    ray = None
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

__all__ = ["RayProvider", "RaySandbox", "SandboxHostActor", "probe"]

Strategy = Literal["spread", "pack"]
#: The custom resource a sandbox consumes (one unit per sandbox served).
SANDBOX_RESOURCE = "sandbox"
#: How long check_alive waits for the actor's answer before looking at its node instead.
PROBE_TIMEOUT_S = 10.0


def _require_ray() -> None:
    if ray is None:
        raise ProviderError(f"RayProvider needs Ray: pip install 'shinken[ray]' ({_IMPORT_ERROR})")


class SandboxHostActor:
    """The body of one sandbox-host actor: a shinkend child on this node, bound to its IP.

    Plain class; :class:`RayProvider` wraps it with ``ray.remote`` so this module imports
    without Ray.
    """

    def __init__(self, name: str, fleet: int, display: str, screen: tuple[int, int], rtt_ms: float,
                 extra_args: list[str], start_timeout: float):
        from .process import start_daemons

        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        extra = [*extra_args, "--fleet", str(fleet)] if fleet > 1 else [*extra_args, "--sandbox-id", name]
        argv = daemon_argv(display, screen, rtt_ms, extra, host=self.node_ip)
        (self.daemon,) = start_daemons([argv], [name], timeout=start_timeout)

    def info(self) -> dict[str, Any]:
        ready = self.daemon.ready
        return {"urls": ready.get("urls") or [ready["url"]], "sandbox_id": ready.get("sandbox_id", self.daemon.name),
                "token": self.daemon.token, "node_ip": self.node_ip, "node_id": self.node_id,
                "pid": self.daemon.pid}

    def liveness(self) -> Liveness:
        return self.daemon.liveness()

    def stop(self) -> None:
        self.daemon.release()


@dataclass(eq=False)
class RaySandbox:
    """Handle of one sandbox served by a shinkend inside a Ray actor on some node."""

    sandbox_id: str
    url: str
    token: str = field(repr=False)
    node_ip: str
    node_id: str
    pid: int  # the daemon's pid on its node
    actor: Any = field(repr=False)  # the host actor (shared by a fleet host's K sandboxes)
    host_key: str = field(default="", repr=False)


def probe(handle: RaySandbox, timeout: float = PROBE_TIMEOUT_S) -> Liveness:
    """The sandbox's liveness from anywhere in the cluster: the daemon's own state while its
    actor lives, else dead with Ray's cause (actor or node death)."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    where = f"sandbox {handle.sandbox_id} on node {handle.node_ip}"
    try:
        liveness: Liveness = ray.get(handle.actor.liveness.remote(), timeout=timeout)  # ray is Any (setup.cfg)
        return liveness
    except ActorUnavailableError as exc:  # unreachable right now: let the node decide
        reason = f"actor unavailable: {exc}"
    except RayActorError as exc:
        return Liveness(alive=False, detail=f"{where}: ray actor died: {_cause(exc)}")
    except GetTimeoutError:
        reason = f"no liveness answer in {timeout:g} s"
    node = next((n for n in ray.nodes() if n.get("NodeID") == handle.node_id), None)
    if node is None or not node.get("Alive", False):
        return Liveness(alive=False, detail=f"{where}: ray node {handle.node_id[:12]} is dead ({reason})")
    return Liveness(alive=True, detail=f"unknown: {reason}")


def _cause(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:600]


@dataclass
class _Host:
    actor: Any
    group: str
    handles: set[int] = field(default_factory=set)  # ids of handles not yet destroyed


class RayProvider(Provider[RaySandbox]):
    """Sandbox hosts as Ray actors, placed by Ray over the cluster's nodes.

    ``sandboxes_per_host`` 1 runs one shinkend per sandbox; K > 1 runs ``--fleet K`` hosts
    and hands their sandboxes out one by one (a fleet host is freed when none of its
    sandboxes handed out is left; the ones never handed out go with it). Resource requests are per host: ``num_cpus`` and
    ``memory`` (bytes) as given, ``sandbox`` resource K units when ``use_sandbox_resource``.
    Connect to the cluster with ``ray.init(...)`` first, or pass ``address`` (then this
    provider connects, and disconnects on :meth:`close`).
    """

    def __init__(
        self,
        *,
        address: str | None = None,
        strategy: Strategy = "spread",
        sandboxes_per_host: int = 1,
        num_cpus: float = 0.0,
        memory: int | None = None,
        use_sandbox_resource: bool = True,
        display: str = "virtual",
        screen: tuple[int, int] = (1920, 1080),
        rtt_ms: float = 0.0,
        extra_args: list[str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ):
        _require_ray()
        if strategy not in ("spread", "pack"):
            raise ValueError(f"strategy must be 'spread' or 'pack', got {strategy!r}")
        if sandboxes_per_host < 1:
            raise ValueError("sandboxes_per_host must be >= 1")
        if display != "virtual" and sandboxes_per_host > 1:
            raise ValueError("fleet hosts serve virtual displays only")
        self._owns_ray = False
        if address is not None and not ray.is_initialized():
            ray.init(address=address, logging_level="warning", log_to_driver=False)
            self._owns_ray = True
        elif not ray.is_initialized():
            raise ProviderError("Ray is not initialised: call ray.init(address=...) or pass address=")
        self.strategy: Strategy = strategy
        self.per_host = sandboxes_per_host
        bundle: dict[str, float] = {"CPU": float(num_cpus)} if num_cpus else {}
        if memory:
            bundle["memory"] = float(memory)
        if use_sandbox_resource:
            bundle[SANDBOX_RESOURCE] = float(sandboxes_per_host)
        self._bundle = bundle or {"CPU": 0.001}  # a placement group bundle may not be empty
        self._opts = {"display": display, "screen": tuple(screen), "rtt_ms": rtt_ms,
                      "extra_args": list(extra_args or ()), "start_timeout": start_timeout}
        self._start_timeout = start_timeout
        self._actor_class = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(SandboxHostActor)
        self._lock = threading.Lock()
        self._hosts: dict[str, _Host] = {}
        self._groups: dict[str, Any] = {}  # placement group per create_many call, until its hosts are gone
        self._handles: dict[int, RaySandbox] = {}
        self._free: list[RaySandbox] = []  # fleet sandboxes not handed out yet
        self._prefix = f"ray-{secrets.token_hex(3)}"
        self._count = 0

    # -- creating --------------------------------------------------------------

    def create(self, **options: Any) -> RaySandbox:
        return self.create_many(1, **options)[0]

    def create_many(self, n: int, parallelism: int = 8, **options: Any) -> list[RaySandbox]:
        """``n`` sandboxes, placed together (one placement group). All or nothing.
        ``parallelism`` is Ray's to choose: every host actor starts at once."""
        if options:
            raise TypeError("RayProvider sandboxes are configured in the constructor")
        if n < 1:
            raise ValueError("n must be >= 1")
        with self._lock:
            taken = [self._free.pop() for _ in range(min(n, len(self._free)))]
        try:
            hosts_needed = -(-(n - len(taken)) // self.per_host)
            fresh = self._start_hosts(hosts_needed) if hosts_needed else []
        except BaseException:
            with self._lock:
                self._free.extend(taken)
            raise
        with self._lock:
            self._free.extend(fresh[n - len(taken):])
            handed = taken + fresh[: n - len(taken)]
            for handle in handed:
                self._handles[id(handle)] = handle
                self._hosts[handle.host_key].handles.add(id(handle))
        return handed

    def _start_hosts(self, count: int) -> list[RaySandbox]:
        from ray.exceptions import GetTimeoutError, RayActorError

        group_name = f"{self._prefix}-pg{secrets.token_hex(3)}"
        pg = placement_group([dict(self._bundle)] * count, strategy=self.strategy.upper(), name=group_name)
        try:
            ray.get(pg.ready(), timeout=self._start_timeout)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise ProviderError(
                f"Ray could not place {count} sandbox host(s) of {self._bundle} each ({self.strategy}) within "
                f"{self._start_timeout:g} s; available now: {ray.available_resources()}") from None
        actors, names = [], []
        for i in range(count):
            with self._lock:
                name = f"{self._prefix}-{self._count}"
                self._count += 1
            names.append(name)
            actors.append(self._actor_class.options(
                num_cpus=0, resources={},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(name, self.per_host, **self._opts))
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=self._start_timeout + 30)
        except (GetTimeoutError, RayActorError) as exc:
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(pg)
            raise ProviderError(f"sandbox hosts did not start: {_cause(exc)}") from None
        with self._lock:
            self._groups[group_name] = pg
        handles: list[RaySandbox] = []
        for actor, name, info in zip(actors, names, infos):
            with self._lock:
                self._hosts[name] = _Host(actor, group_name)
            base = info["sandbox_id"].rsplit("-", 1)[0] if self.per_host > 1 else info["sandbox_id"]
            for j, url in enumerate(info["urls"]):
                sid = f"{base}-{j}" if self.per_host > 1 else base
                handles.append(RaySandbox(sid, url, info["token"], info["node_ip"], info["node_id"], info["pid"],
                                          actor, name))
        return handles

    # -- using -------------------------------------------------------------------

    def endpoint(self, handle: RaySandbox) -> tuple[str, str]:
        return handle.url, handle.token

    def check_alive(self, handle: RaySandbox) -> Liveness:
        self._own(handle)
        return probe(handle)

    def nodes_of(self, handles: list[RaySandbox]) -> dict[str, int]:
        """How many of ``handles`` run on each node IP (what placement did)."""
        counts: dict[str, int] = {}
        for handle in handles:
            counts[handle.node_ip] = counts.get(handle.node_ip, 0) + 1
        return counts

    # -- freeing -----------------------------------------------------------------

    def _own(self, handle: RaySandbox) -> None:
        if id(handle) not in self._handles:
            raise UnknownHandle(f"{handle!r} was not created by this provider (or is destroyed)")

    def destroy(self, handle: RaySandbox) -> None:
        with self._lock:
            if self._handles.pop(id(handle), None) is None:
                return
            host = self._hosts.get(handle.host_key)
            if host is None:
                return
            host.handles.discard(id(handle))
            if host.handles:
                return  # a fleet host still serves others
            # Nothing of this host is in use: free it now (its sandboxes never handed out go
            # with it; a later create() starts a fresh host where Ray places it).
            self._free = [h for h in self._free if h.host_key != handle.host_key]
            del self._hosts[handle.host_key]
            group = host.group
            last_of_group = not any(h.group == group for h in self._hosts.values())
            pg = self._groups.pop(group) if last_of_group else None
        self._kill(host.actor)
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    def close(self) -> None:
        with self._lock:
            hosts, groups = list(self._hosts.values()), list(self._groups.values())
            self._hosts.clear()
            self._groups.clear()
            self._handles.clear()
            self._free.clear()
        if ray is None or not ray.is_initialized():
            return
        for host in hosts:
            self._kill(host.actor)
        for pg in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    @staticmethod
    def _kill(actor: Any) -> None:
        # A graceful stop first (the daemon's Xvfb, if any, is stopped in order); ray.kill
        # anyway, which also covers an actor whose node is already gone.
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(), timeout=15)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
