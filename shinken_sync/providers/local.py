"""Sandboxes as shinkend processes on loopback: the embedded default.

:class:`LocalProvider` starts one daemon per sandbox (``virtual`` or ``xvfb``
display). :class:`LocalFleetProvider` starts one ``--fleet N`` host serving N
virtual sandboxes on distinct URL paths and hands them out one by one; it is
the substrate for scale tests, where N separate processes would not fit.
Process handling (tokens, ready lines, dying with the parent) lives in
:mod:`.process`.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import Liveness, Provider
from .errors import ProviderExhausted, UnknownHandle
from .process import DEFAULT_START_TIMEOUT_S, DaemonProcess, start_daemons


@dataclass(eq=False)
class LocalSandbox:
    """Handle of one sandbox served by a local shinkend process."""

    sandbox_id: str
    url: str
    token: str = field(repr=False)
    #: The daemon process (for a fleet: the host shared by every sandbox).
    daemon: DaemonProcess = field(repr=False)

    @property
    def pid(self) -> int:
        return self.daemon.pid


def daemon_argv(display: str, screen: Sequence[int], rtt_ms: float, extra: list[str],
                host: str = "127.0.0.1") -> list[str]:
    """shinkend's flags for one sandbox (or fleet host) on ``host``, any free port."""
    width, height = screen
    return [
        "--host", host, "--port", "0",
        "--display", display,
        "--screen", f"{width}x{height}",
        "--rtt-ms", str(rtt_ms),
        *extra,
    ]  # fmt: skip


class LocalProvider(Provider[LocalSandbox]):
    """One shinkend subprocess per sandbox.

    Options given to the constructor are the defaults for :meth:`create`, which
    may override any of them per sandbox: ``display`` ("virtual" | "xvfb"),
    ``screen`` ((width, height)), ``rtt_ms`` (emulated round trip),
    ``stream_grace`` (seconds a detached screencast waits) and ``extra_args``
    (more shinkend flags).
    """

    def __init__(
        self,
        display: str = "virtual",
        screen: tuple[int, int] = (1920, 1080),
        rtt_ms: float = 0.0,
        *,
        stream_grace: float | None = None,
        extra_args: list[str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ):
        self._defaults: dict[str, Any] = {
            "display": display,
            "screen": tuple(screen),
            "rtt_ms": rtt_ms,
            "stream_grace": stream_grace,
            "extra_args": list(extra_args or ()),
        }
        self._start_timeout = start_timeout
        self._lock = threading.Lock()
        self._sandboxes: dict[int, LocalSandbox] = {}
        self._count = 0
        # Sandbox ids stay unique across providers (and in the daemons' logs).
        self.prefix = f"{self._id_word}-{secrets.token_hex(3)}"

    # What a substrate built on this one changes (IsolatedProvider): the sandbox ids' first
    # word, how one daemon is started, and the handle it gets.
    _id_word = "local"

    def _spawn(self, argv: list[str], name: str) -> DaemonProcess:
        return DaemonProcess(argv, name)

    def _handle(self, daemon: DaemonProcess) -> LocalSandbox:
        return LocalSandbox(daemon.ready.get("sandbox_id", daemon.name), daemon.url, daemon.token, daemon)

    def create(self, **options: Any) -> LocalSandbox:
        return self.create_many(1, **options)[0]

    def create_many(self, n: int, parallelism: int = 8, **options: Any) -> list[LocalSandbox]:
        """Start ``n`` sandboxes, at most ``parallelism`` booting at once. All or
        nothing: on a failure the ones already started are stopped again."""
        unknown = set(options) - set(self._defaults)
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(self._defaults)}")
        opts = {**self._defaults, **options}
        extra = list(opts["extra_args"])
        if opts["stream_grace"] is not None:
            extra += ["--stream-grace", str(opts["stream_grace"])]
        with self._lock:
            first = self._count
            self._count += n
        names = [f"{self.prefix}-{first + i}" for i in range(n)]
        argvs = [
            daemon_argv(opts["display"], opts["screen"], opts["rtt_ms"], [*extra, "--sandbox-id", name])
            for name in names
        ]
        daemons = start_daemons(argvs, names, parallelism=parallelism, timeout=self._start_timeout, spawn=self._spawn)
        handles = [self._handle(d) for d in daemons]
        with self._lock:
            for handle in handles:
                self._sandboxes[id(handle)] = handle
        return handles

    def endpoint(self, handle: LocalSandbox) -> tuple[str, str]:
        return handle.url, handle.token

    def check_alive(self, handle: LocalSandbox) -> Liveness:
        return handle.daemon.liveness()

    def destroy(self, handle: LocalSandbox) -> None:
        with self._lock:
            self._sandboxes.pop(id(handle), None)
        handle.daemon.release()

    def close(self) -> None:
        with self._lock:
            handles = list(self._sandboxes.values())
            self._sandboxes.clear()
        for handle in handles:
            handle.daemon.release()


class LocalFleetProvider(Provider[LocalSandbox]):
    """N virtual sandboxes served by ONE shinkend ``--fleet N`` process.

    The host starts in the constructor; :meth:`create` hands out its sandboxes
    in order and raises :class:`ProviderExhausted` after the N-th. A fleet
    sandbox cannot be stopped on its own: :meth:`destroy` retires the handle
    (never handed out again), :meth:`close` stops the host. ``check_alive``
    reports the host process, shared fate by construction.
    """

    def __init__(
        self,
        n: int,
        screen: tuple[int, int] = (1920, 1080),
        rtt_ms: float = 0.0,
        *,
        extra_args: list[str] | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ):
        if n < 1:
            raise ValueError("a fleet needs at least one sandbox")
        argv = daemon_argv("virtual", tuple(screen), rtt_ms, ["--fleet", str(n), *(extra_args or ())])
        (self._host,) = start_daemons([argv], ["fleet"], timeout=start_timeout)
        urls = self._host.ready["urls"]
        base = self._host.ready.get("sandbox_id", "fleet").rsplit("-", 1)[0]
        self._free = [LocalSandbox(f"{base}-{i}", url, self._host.token, self._host) for i, url in enumerate(urls)]
        self._free.reverse()
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return len(self._host.ready["urls"])

    @property
    def pid(self) -> int:
        """The fleet host's process id (for a liveness probe in another process)."""
        return self._host.pid

    def create(self, **options: Any) -> LocalSandbox:
        if options:
            raise TypeError("fleet sandboxes are configured when the fleet starts")
        with self._lock:
            if not self._free:
                raise ProviderExhausted(f"all {self.size} fleet sandboxes are handed out")
            return self._free.pop()

    def create_many(self, n: int, parallelism: int = 8, **options: Any) -> list[LocalSandbox]:
        if options:
            raise TypeError("fleet sandboxes are configured when the fleet starts")
        with self._lock:
            if len(self._free) < n:
                raise ProviderExhausted(f"{n} sandboxes asked, {len(self._free)} left of {self.size}")
            return [self._free.pop() for _ in range(n)]

    def endpoint(self, handle: LocalSandbox) -> tuple[str, str]:
        return handle.url, handle.token

    def check_alive(self, handle: LocalSandbox) -> Liveness:
        self._own(handle)
        return self._host.liveness()

    def destroy(self, handle: LocalSandbox) -> None:
        self._own(handle)  # retired: create() never hands a sandbox out twice

    def _own(self, handle: LocalSandbox) -> None:
        if handle.daemon is not self._host:
            raise UnknownHandle(f"{handle!r} does not belong to this fleet")

    def close(self) -> None:
        self._host.release()
