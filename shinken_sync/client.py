"""The asyncio core: one :class:`AsyncSandbox` per WebSocket connection to shinkend.

This module is the transport around :class:`~shinken_sync.client_protocol.ClientProtocol`,
which holds the connection's state without any I/O (call ids, pending calls,
deadlines, streams, reply routing, decoding). Here: dialing, the socket, one
deadline timer per connection, waking waiters, and the liveness probe on a loss.

Each connection has exactly one reader task. It feeds every daemon message to
the protocol object and acts on the event it returns: a reply resolves the
future of the call awaiting it, a screencast frame goes into its stream's
bounded queue (:mod:`shinken_sync.framebudget`), ``stream_end`` ends its stream.
Calls never read the socket themselves, so any number of them may be in flight
at once: ``step`` sends all of its calls before awaiting any reply and costs
about one round trip.

Every call has a deadline: by default (``timeout=DEFAULT``) ``rpc_timeout``, and verbs
that wait on purpose -- ``wait``, ``wait_stable``, ``wait_change``, ``exec`` --
get their own duration on top; ``timeout=`` a number replaces it, ``timeout=None`` means no
client-side limit (the call ends with its reply or its connection). ``next_frame``'s default
is to wait for the next frame (None); a number bounds that wait. When the connection dies, every pending call
fails at once with :class:`~shinken_sync.errors.ConnectionLost`, or with
:class:`~shinken_sync.errors.SandboxDied` when the ``liveness_probe`` says the
sandbox is gone; open screencasts end with a stream-lost sentinel.

The frame budget knob
---------------------
Each event loop has one byte budget for the screencast frames queued on it,
across every connection on it (two loops, two budgets). Its limit is set once,
by its owner, and nothing else changes it:

* :data:`GLOBAL_FRAME_BUDGET_BYTES` (default None = off) is the default: it is
  read when a loop's budget is created (the first connection on the loop, or
  :func:`loop_frame_budget`), so set it before connecting;
* ``SharedLoop(frame_budget_bytes=...)`` gives a shared loop its own limit;
* ``aconnect(frame_budget_bytes=...)`` (and ``connect``) sets the limit of the
  loop it runs on, explicitly;
* ``loop_frame_budget().limit = n`` changes it later, from the next push.

``framebudget`` documents the eviction order; :func:`loop_frame_budget` reads
the counters.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

from . import actions as build
from . import fleetgc, protocol
from . import transport as transports
from .client_protocol import (
    DEFAULT,
    READ_FILE_CHUNK,
    WAITING_VERB_SLACK,
    ClientProtocol,
    FrameReceived,
    OutgoingCall,
    Replied,
    StreamClosed,
    StreamOpened,
    UnclaimedStream,
    UseDefault,
    call_deadline,
    check_hello,
    loss_error,
    pipelined_deadlines,
    split_action,
    unwrap,
    wire_args,
)
from .errors import (
    ActionDenied,
    ActionError,
    AuthRefused,
    ConnectError,
    ConnectionLost,
    FrameTimeout,
    InvalidURL,
    ProtocolViolation,
    SandboxClosed,
    ShinkenError,
    Skipped,
    StreamLost,
    classify_exception,
)
from .framebudget import (
    EMPTY,
    USE_GLOBAL,
    BudgetSetting,
    FrameBudget,
    FrameCounters,
    FrameQueue,
    budget_for_loop,
)
from .liveness import Liveness
from .results import ExecResult, Frame, Screenshot, StepResult, StepRow
from .turnbudget import REPLIES, turn_budget_for_loop
from .verbs import DEFAULT_IMAGE_FORMAT, DEFAULT_IMAGE_QUALITY, DEFAULT_SCREENCAST_FPS

__all__ = [
    "GLOBAL_FRAME_BUDGET_BYTES",
    "MAX_CALL_STARTS_PER_TURN",
    "MAX_REPLIES_PER_TURN",
    "READ_FILE_CHUNK",
    "WAITING_VERB_SLACK",
    "AsyncSandbox",
    "ScreencastStream",
    "aconnect",
    "call_deadline",
    "loop_frame_budget",
    "pipelined_deadlines",
]

log = logging.getLogger("shinken_sync.client")


#: Default byte budget for queued screencast frames per event loop; None = off.
#: Read when a loop's budget is created. Recommended for fleets: ``256 << 20``.
#: See the module docstring.
GLOBAL_FRAME_BUDGET_BYTES: int | None = None

#: Calls started per event-loop turn across every connection of the loop; the
#: rest wait for the next turns, in order (:mod:`shinken_sync.turnbudget`). A
#: step counts its actions plus its observation and is never split. Read at
#: every call start; None = no bound. See docs/concurrency.md "Fair scheduling".
MAX_CALL_STARTS_PER_TURN: int | None = 128

#: Received messages dispatched per event-loop turn across every connection of
#: the loop; a reader past the bound waits for the next turn before taking its
#: next message (the replies of a lockstep round arrive as one burst, and each
#: wakes a caller). Read at every message; None = no bound.
MAX_REPLIES_PER_TURN: int | None = 128

#: The websockets keepalive default; ``ping_jitter`` adds to it per connection.
DEFAULT_PING_INTERVAL = 20.0
DEFAULT_OPEN_TIMEOUT = 10.0
DEFAULT_RPC_TIMEOUT = 30.0
DEFAULT_CLOSE_TIMEOUT = 2.0
#: Frames a stream's queue holds before dropping its oldest.
DEFAULT_MAX_QUEUE_FRAMES = 32
#: How long a liveness probe may take on the failure path before the loss is
#: reported as a plain ConnectionLost.
LIVENESS_PROBE_TIMEOUT = 2.0
#: A probe that still says "alive" is asked once more after this delay.
LIVENESS_RECHECK_DELAY = 0.1
#: Bytes one socket read asks for (asyncio's default is 256 KiB). A read
#: allocates this much before shrinking to what arrived: above glibc's 128 KiB
#: mmap threshold, every read of a ~72 KiB observation was an
#: mmap + mremap + munmap. Below it, reads come from the heap.
READ_CHUNK_BYTES = 120 * 1024

Gateway = Callable[[Mapping[str, Any]], bool]
LivenessProbe = Callable[[], Liveness]



class _StreamEnded:
    """Queue sentinel: the daemon ended the stream (stop, expiry, moved)."""

    __slots__ = ()


class _StreamLostMark:
    """Queue sentinel: the connection carrying the stream died."""

    __slots__ = ("cause",)

    def __init__(self, cause: BaseException):
        self.cause = cause


_ENDED = _StreamEnded()


def loop_frame_budget(loop: asyncio.AbstractEventLoop | None = None) -> FrameBudget:
    """The frame budget (and its counters) of ``loop``, default the running loop;
    created with :data:`GLOBAL_FRAME_BUDGET_BYTES` as its limit if it has none yet."""
    return budget_for_loop(loop or asyncio.get_running_loop(), GLOBAL_FRAME_BUDGET_BYTES)


async def aconnect(
    url: str,
    token: str | None = None,
    *,
    ping_jitter: float = 0.0,
    open_timeout: float = DEFAULT_OPEN_TIMEOUT,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
    liveness_probe: LivenessProbe | None = None,
    gateway: Gateway | None = None,
    ssl: Any = None,
    max_queue_frames: int = DEFAULT_MAX_QUEUE_FRAMES,
    frame_budget_bytes: BudgetSetting = USE_GLOBAL,
) -> AsyncSandbox:
    """Dial one sandbox and wait for its ``hello``.

    Args:
        url: ``ws://`` or ``wss://`` endpoint. TLS is dialed by the SDK itself
            (no proxy is consulted); ``ssl`` is an ``ssl.SSLContext`` for
            ``wss://`` (None = the system defaults). ``ws+unix://<percent-encoded
            socket path>/<path>`` dials a unix socket (an isolated sandbox's;
            always with the websockets transport: picows dials TCP only).
        token: the bearer token, sent in the ``Authorization`` header.
        ping_jitter: the keepalive interval is ``20 + uniform(0, ping_jitter)``
            seconds, drawn once here, so a fleet dialed together does not ping
            in lockstep forever. 0 keeps the websockets default of 20 s.
        open_timeout: bound on TCP + TLS + WebSocket handshake + hello.
        rpc_timeout: default deadline of every call; ``timeout=`` overrides it.
        close_timeout: bound on the closing handshake in :meth:`AsyncSandbox.close`.
        liveness_probe: called (in an executor, at most
            :data:`LIVENESS_PROBE_TIMEOUT` s) when the connection drops; a
            ``Liveness(alive=False, ...)`` turns the loss into ``SandboxDied``.
        gateway: called with each ``step``/``act_batch`` action before it is
            sent; a false return marks the action ``denied`` and it is not sent.
        max_queue_frames: per-stream frame queue bound (drop-oldest).
        frame_budget_bytes: the byte budget of queued frames on this event
            loop (shared with the loop's other connections; None = off). Not
            given: the loop keeps its limit, or takes
            :data:`GLOBAL_FRAME_BUDGET_BYTES` if this is its first connection.

    Raises:
        InvalidURL: ``url`` is no ``ws://``/``wss://``/``ws+unix://`` endpoint; nothing was dialed.
        AuthRefused: the daemon answered HTTP 401.
        ConnectError: anything else that kept the connection from opening.
    """
    check_url(url)
    if ping_jitter < 0:
        raise ValueError(f"ping_jitter must be >= 0, not {ping_jitter}")
    if max_queue_frames < 1:
        raise ValueError(f"max_queue_frames must be >= 1, not {max_queue_frames}")
    if frame_budget_bytes is not USE_GLOBAL and frame_budget_bytes is not None and frame_budget_bytes < 0:
        raise ValueError(f"frame_budget_bytes must be >= 0 or None, not {frame_budget_bytes}")
    ping_interval = DEFAULT_PING_INTERVAL + (random.uniform(0.0, ping_jitter) if ping_jitter else 0.0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + open_timeout
    options: dict[str, Any] = {
        "additional_headers": {"Authorization": f"Bearer {token}"} if token else None,
        "compression": None,  # images do not compress; deflate costs ~12x the CPU
        "max_size": protocol.MAX_MESSAGE_SIZE,
        "open_timeout": open_timeout,
        "ping_interval": ping_interval,
        "close_timeout": close_timeout,
    }
    if ssl is not None:
        options["ssl"] = ssl
    unix = protocol.split_unix_url(url)  # an isolated sandbox's socket: ws+unix://
    transport = transports.choose(unix=unix is not None)
    options["user_agent_header"] = f"shinken-sync ({transport.name})"
    # asyncio.TimeoutError is not the builtin TimeoutError before Python 3.11.
    dial_errors: tuple[type[BaseException], ...] = (
        asyncio.TimeoutError,
        OSError,
        *transport.handshake_errors,
    )
    try:
        if unix is None:
            dial = transport.connect(url, proxy=None, **options)
        else:
            assert transport.connect_unix is not None  # choose(unix=True) answers a transport that has it
            dial = transport.connect_unix(unix[0], unix[1], **options)
        # The outer bound covers TCP + TLS too (picows bounds only the handshake itself).
        ws = await asyncio.wait_for(dial, open_timeout)
    except transport.invalid_status as exc:
        status = exc.response.status_code  # type: ignore[attr-defined]
        if status == 401:
            raise AuthRefused(f"{url}: the daemon refused the token (HTTP 401)", url) from exc
        raise ConnectError(f"{url}: handshake refused with HTTP {status}", url) from exc
    except dial_errors as exc:
        raise ConnectError(f"{url}: cannot connect: {exc or type(exc).__name__}", url) from exc
    if frame_budget_bytes is not USE_GLOBAL:  # the caller's own, explicit setting
        loop_frame_budget(loop).limit = frame_budget_bytes
    _tune_transport(ws)
    transport.pace_reading(ws)
    try:
        hello = await _receive_hello(ws, url, max(0.0, deadline - loop.time()), transport)
    except BaseException:
        await ws.close()
        raise
    return AsyncSandbox(
        ws,
        hello,
        transport=transport,
        url=url,
        ping_interval=ping_interval,
        rpc_timeout=rpc_timeout,
        liveness_probe=liveness_probe,
        gateway=gateway,
        max_queue_frames=max_queue_frames,
    )


# Where a newcomer gets a real URL (README, SDK).
_URL_HINT = "a sandbox URL looks like ws://127.0.0.1:PORT/sb/0 (`shinken sandboxes` prints them; a handle has .url, .token)"


def check_url(url: object) -> None:
    """:class:`InvalidURL` unless ``url`` is a ``ws://`` or ``wss://`` URL with a host and, if
    given, a numeric port in range, or a ``ws+unix://`` URL naming an absolute socket path (urllib's own errors here are bare ``ValueError`` s, and the
    WebSocket libraries' are handshake errors: one typed error, before any dial)."""
    if not isinstance(url, str):
        raise InvalidURL(f"{url!r} is not a URL string; {_URL_HINT}", str(url))
    if url.startswith(f"{protocol.UNIX_SCHEME}://"):  # an isolated sandbox's socket
        try:
            socket_path, _ = protocol.split_unix_url(url) or ("", "")
        except ValueError as exc:
            raise InvalidURL(f"{exc}; {_URL_HINT}", url) from None
        if not socket_path.startswith("/") or "\x00" in socket_path:
            raise InvalidURL(f"{url!r} names no absolute socket path; {_URL_HINT}", url)
        return
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (urllib checks the port only when it is read)
    except ValueError as exc:
        raise InvalidURL(f"{url!r} is not a valid URL ({exc}); {_URL_HINT}", url) from exc
    if parts.scheme == protocol.UNIX_SCHEME:  # an isolated sandbox's socket (protocol.unix_url)
        if not parts.netloc or "/" in parts.netloc:
            raise InvalidURL(f"{url!r} names no percent-encoded socket path; {_URL_HINT}", url)
        return
    if parts.scheme not in ("ws", "wss"):
        got = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
        raise InvalidURL(f"{url!r} has {got}, not ws://, wss:// or ws+unix://; {_URL_HINT}", url)
    if not parts.hostname:
        raise InvalidURL(f"{url!r} names no host; {_URL_HINT}", url)
    if any(c.isspace() for c in url):
        raise InvalidURL(f"{url!r} contains whitespace; {_URL_HINT}", url)


def _tune_transport(ws: Any) -> None:
    """Apply :data:`READ_CHUNK_BYTES` where the transport has asyncio's ``max_size``
    read size (plain selector transports; TLS and other loops read their own way)."""
    transport = getattr(ws, "transport", None)
    if transport is not None and isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = READ_CHUNK_BYTES


async def _receive_hello(
    ws: Any, url: str, timeout: float, transport: transports.Transport
) -> protocol.Hello:
    try:
        message = await asyncio.wait_for(ws.recv(), timeout)
    except asyncio.TimeoutError as exc:  # noqa: UP041 - distinct from TimeoutError on 3.10
        raise ConnectError(f"{url}: no hello within the open timeout", url) from exc
    except transport.connection_closed as exc:
        raise ConnectError(f"{url}: closed before the hello", url) from exc
    return check_hello(message, url)


# Kept under their old names for callers of the private helpers.
_wire_args = wire_args
_unwrap = unwrap
_split_action = split_action


class AsyncSandbox:
    """A connection to one sandbox. Create it with :func:`aconnect`.

    Use it as an async context manager, or call :meth:`close`. Methods may be
    called concurrently from many tasks of the loop that created it (and only
    from that loop). After the connection is lost, every call raises the loss
    (``ConnectionLost``/``SandboxDied``); after :meth:`close`, ``SandboxClosed``.
    """

    def __init__(
        self,
        ws: Any,
        hello: protocol.Hello,
        *,
        url: str,
        transport: transports.Transport | None = None,
        ping_interval: float,
        rpc_timeout: float,
        liveness_probe: LivenessProbe | None,
        gateway: Gateway | None,
        max_queue_frames: int,
    ):
        self._ws = ws
        self._transport = transport or transports.choose(transports.WEBSOCKETS)
        self._closed_error = self._transport.connection_closed
        self._hello = hello
        self._url = url
        self._ping_interval = ping_interval
        self._rpc_timeout = rpc_timeout
        self._probe = liveness_probe
        self._gateway = gateway
        self._max_queue_frames = max_queue_frames
        self._loop = asyncio.get_running_loop()
        self._budget = loop_frame_budget(self._loop)
        self._turns = turn_budget_for_loop(self._loop)
        self._reply_turns = turn_budget_for_loop(self._loop, REPLIES)
        self._frame_counters = FrameCounters()
        self._proto = ClientProtocol(hello, rpc_timeout)
        self._stopping_unclaimed: set[asyncio.Task[None]] = set()
        # One timer per connection, armed for the earliest pending deadline (see _send).
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_at: float | None = None
        self._closing = False
        self._loss: ShinkenError | None = None  # set once the connection is gone
        self._reader = self._loop.create_task(self._read_loop(), name=f"shinken-reader {url}")
        fleetgc.host_connection(self, self._loop)  # the automatic fleet GC policy counts open connections (released when gone)

    # -- properties --------------------------------------------------------

    @property
    def url(self) -> str:
        return self._url

    @property
    def sandbox_id(self) -> str:
        return self._hello.sandbox_id

    @property
    def screen(self) -> tuple[int, int]:
        """``(width, height)`` from the hello; :meth:`screen_size` asks again."""
        return (self._hello.width, self._hello.height)

    @property
    def verbs(self) -> tuple[str, ...]:
        return self._hello.verbs

    @property
    def display(self) -> str:
        """The daemon's display backend (``virtual``, ``xvfb``)."""
        return self._hello.display

    @property
    def ping_interval(self) -> float:
        """Keepalive period of this connection, fixed at dial time."""
        return self._ping_interval

    @property
    def rpc_timeout(self) -> float:
        return self._rpc_timeout

    @property
    def transport(self) -> str:
        """The WebSocket client this connection was dialed with: ``websockets`` or ``fast``."""
        return self._transport.name

    @property
    def closed(self) -> bool:
        """True once the connection is gone, closed by us or lost."""
        return self._loss is not None or self._closing

    @property
    def loss(self) -> ShinkenError | None:
        """Why the connection ended (``ConnectionLost``, ``SandboxDied``, ...), or None."""
        return self._loss

    @property
    def frame_counters(self) -> FrameCounters:
        """Frames queued/dropped/evicted on this connection's streams."""
        return self._frame_counters

    @property
    def pending_calls(self) -> int:
        return self._proto.pending_calls

    # -- lifecycle ---------------------------------------------------------

    async def __aenter__(self) -> AsyncSandbox:  # noqa: PYI034 - no typing.Self on 3.10
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; pending calls fail with ``SandboxClosed``. Idempotent."""
        if not self._closing:
            self._closing = True
            fleetgc.release_connection(self, self._loop)
            await self._ws.close()
        # The reader fails what is still pending once the socket is closed.
        await asyncio.shield(self._reader)

    # -- calls -------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closing:
            raise SandboxClosed(f"sandbox {self.sandbox_id} is closed")

    def _loss_error(self) -> ShinkenError:
        """A fresh copy of the loss, so each raiser gets its own traceback."""
        assert self._loss is not None
        exc = copy.copy(self._loss)
        exc.__cause__ = self._loss.__cause__
        return exc

    def _prepare(
        self, verb: str, args: Mapping[str, Any], timeout: float | None | UseDefault, deadline: float | None | UseDefault = DEFAULT
    ) -> OutgoingCall:
        """Encode one call without sending it (``ClientProtocol.prepare``)."""
        return self._proto.prepare(verb, args, timeout, deadline)

    async def _send(self, call: OutgoingCall) -> asyncio.Future[Any]:
        """Send a prepared call; return the future its reply (a protocol.Reply) resolves."""
        self._check_usable()
        future: asyncio.Future[Any] = self._loop.create_future()
        if self._loss is not None:
            future.set_exception(self._loss_error())
            return future
        # No deadline (timeout=None): the call ends with its reply or the connection's end.
        # Not a timer per call: the connection's one timer is armed for the earliest
        # pending deadline, and a reply leaves it be (at 1024 connections x 2 calls a
        # step, timers per call were thousands of handles made, cancelled and
        # kept in the loop's heap every round).
        expires_at = None if call.deadline is None else self._loop.time() + call.deadline
        self._proto.sent(call, future, expires_at)
        if expires_at is not None and (self._deadline_at is None or expires_at < self._deadline_at):
            self._arm_deadline(expires_at)
        try:
            await self._ws.send(call.message)
        except self._closed_error:
            pass  # the reader sees the same close and fails the future with the classified loss
        return future

    async def _submit(self, verb: str, args: Mapping[str, Any], timeout: float | None | UseDefault) -> asyncio.Future[Any]:
        waiter = self._admission(1)
        if waiter is not None:
            await waiter
        return await self._send(self._prepare(verb, args, timeout))

    def _admission(self, calls: int) -> asyncio.Future[None] | None:
        """Room for ``calls`` call starts in a loop turn (see MAX_CALL_STARTS_PER_TURN):
        None when there is room now, else the future to await for it."""
        return self._turns.ticket(calls, MAX_CALL_STARTS_PER_TURN)

    def _arm_deadline(self, when: float) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_at = when
        self._deadline_timer = self._loop.call_at(when, self._expire_due, when)

    def _disarm_deadline(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_timer = self._deadline_at = None

    def _expire_due(self, armed_for: float) -> None:
        """The connection's timer: fail every call past its deadline, re-arm for the next."""
        self._deadline_timer = self._deadline_at = None
        # The loop runs a timer up to its clock resolution early: the time it was armed for counts.
        expired, next_at = self._proto.expire_due(max(self._loop.time(), armed_for))
        for pending, error in expired:
            if not pending.waiter.done():
                pending.waiter.set_exception(error)
        if next_at is not None and self._loss is None:
            self._arm_deadline(next_at)

    async def _call(self, verb: str, args: Mapping[str, Any], timeout: float | None | UseDefault = DEFAULT) -> Any:
        future = await self._submit(verb, args, timeout)
        return unwrap(verb, await future)

    async def _act(self, action: Mapping[str, Any], timeout: float | None | UseDefault) -> Any:
        verb, args = split_action(0, action)
        return await self._call(verb, args, timeout)

    # -- verbs -------------------------------------------------------------

    async def screenshot(
        self,
        format: str = DEFAULT_IMAGE_FORMAT,
        quality: int = DEFAULT_IMAGE_QUALITY,
        max_long_edge: int | None = None,
        region: tuple[int, int, int, int] | None = None,
        *,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> Screenshot:
        """Capture the screen (or ``region`` = x, y, width, height), downscaled so
        the long edge is at most ``max_long_edge``."""
        return cast(Screenshot, await self._act(build.screenshot(format, quality, max_long_edge, region), timeout))

    async def click(
        self, x: int, y: int, button: str = "left", count: int = 1, *, timeout: float | None | UseDefault = DEFAULT
    ) -> None:
        await self._act(build.click(x, y, button, count), timeout)

    async def move(self, x: int, y: int, *, timeout: float | None | UseDefault = DEFAULT) -> None:
        await self._act(build.move(x, y), timeout)

    async def drag(
        self, x0: int, y0: int, x1: int, y1: int, button: str = "left", *, timeout: float | None | UseDefault = DEFAULT
    ) -> None:
        await self._act(build.drag(x0, y0, x1, y1, button), timeout)

    async def scroll(
        self,
        dx: int = 0,
        dy: int = 0,
        x: int | None = None,
        y: int | None = None,
        *,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> None:
        await self._act(build.scroll(dx, dy, x, y), timeout)

    async def type(self, text: str, *, timeout: float | None | UseDefault = DEFAULT) -> None:
        await self._act(build.type(text), timeout)

    async def key(self, combo: str, *, timeout: float | None | UseDefault = DEFAULT) -> None:
        await self._act(build.key(combo), timeout)

    async def wait(self, ms: int, *, timeout: float | None | UseDefault = DEFAULT) -> dict[str, Any]:
        """Sleep ``ms`` in the sandbox (in order with the calls around it)."""
        return cast("dict[str, Any]", await self._act(build.wait(ms), timeout))

    async def wait_stable(
        self, stable_ms: int | None = None, timeout_ms: int | None = None, *, timeout: float | None | UseDefault = DEFAULT
    ) -> dict[str, Any]:
        """Return once the screen has been still for ``stable_ms``; ``ActionTimeout`` at ``timeout_ms``."""
        return cast("dict[str, Any]", await self._act(build.wait_stable(stable_ms, timeout_ms), timeout))

    async def wait_change(
        self, timeout_ms: int | None = None, *, timeout: float | None | UseDefault = DEFAULT
    ) -> dict[str, Any]:
        """Return at the first screen change; ``ActionTimeout`` at ``timeout_ms``."""
        return cast("dict[str, Any]", await self._act(build.wait_change(timeout_ms), timeout))

    async def cursor(self, *, timeout: float | None | UseDefault = DEFAULT) -> tuple[int, int]:
        return cast("tuple[int, int]", await self._act(build.cursor(), timeout))

    async def screen_size(self, *, timeout: float | None | UseDefault = DEFAULT) -> tuple[int, int]:
        return cast("tuple[int, int]", await self._act(build.screen_size(), timeout))

    async def exec(
        self,
        cmd: str,
        timeout_ms: int | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output: int | None = None,
        encoding: str | None = None,
        *,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> ExecResult:
        """Run ``/bin/sh -c cmd``. A command still running at ``timeout_ms`` is
        killed (``ActionTimeout``); a non-zero exit is a result, not an error."""
        return cast(ExecResult, await self._act(build.exec(cmd, timeout_ms, cwd, env, stdin, max_output, encoding), timeout))

    async def launch(
        self, app: str, args: list[str] | None = None, timeout_ms: int | None = None, *,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> dict[str, Any]:
        """Open a desktop app (``browser``, ``terminal``, ``editor``: shinkend ``--desktop``)
        with extra arguments (URLs, files) and wait for its window, which gets the focus.
        Returns ``{"app", "pid", "window"}``; ``ActionError`` (with the app's log tail) if
        it exits first, ``ActionTimeout`` if no window shows within ``timeout_ms``."""
        return cast("dict[str, Any]", await self._act(build.launch(app, args, timeout_ms), timeout))

    async def read_file(
        self, path: str, offset: int = 0, max_bytes: int | None = None, *, timeout: float | None | UseDefault = DEFAULT
    ) -> bytes:
        """The file's bytes from ``offset``: at most ``max_bytes``, or to its end
        (fetched in :data:`READ_FILE_CHUNK` calls) when None."""
        chunks = []
        while True:
            want = READ_FILE_CHUNK if max_bytes is None else min(READ_FILE_CHUNK, max_bytes)
            result = await self._act(build.read_file(path, offset, want), timeout)
            try:
                chunk = base64.b64decode(result["data"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolViolation(f"read_file: malformed result for {path!r}") from exc
            chunks.append(chunk)
            offset += len(chunk)
            if max_bytes is not None:
                max_bytes -= len(chunk)
            if not result.get("truncated") or not chunk or max_bytes == 0:
                return b"".join(chunks)

    async def write_file(
        self,
        path: str,
        data: bytes,
        append: bool = False,
        make_dirs: bool = False,
        mode: int | None = None,
        *,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> dict[str, Any]:
        return cast("dict[str, Any]", await self._act(build.write_file(path, data, append, make_dirs, mode), timeout))

    # -- batches -----------------------------------------------------------

    async def act_batch(
        self,
        actions: Iterable[Mapping[str, Any]],
        *,
        timeout: float | None | UseDefault = DEFAULT,
        gateway: Gateway | None = None,
    ) -> StepResult:
        """Run actions one at a time, each awaiting its reply; stop at the first
        failure (a denial included) and report the rest ``skipped``.

        About one round trip per action; :meth:`step` pipelines instead.
        """
        actions_ = list(actions)
        calls = [split_action(i, action) for i, action in enumerate(actions_)]
        self._check_usable()
        # Encode everything first: a bad argument raises before anything is sent.
        prepared = [self._prepare(verb, args, timeout) for verb, args in calls]
        gate = gateway or self._gateway
        rows: list[StepRow] = []
        failed_at: int | None = None
        for i, (action, call) in enumerate(zip(actions_, prepared)):
            verb = call.verb
            if failed_at is not None:
                error: BaseException = Skipped(f"not run: action {failed_at} failed", cause_index=failed_at)
                rows.append(StepRow(index=i, verb=verb, outcome=protocol.SKIPPED, error=error))
                continue
            if gate is not None and not gate(action):
                error = ActionDenied(f"{verb}: refused by the gateway", action=dict(action))
                rows.append(StepRow(index=i, verb=verb, outcome=protocol.DENIED, error=error))
                failed_at = i
                continue
            try:
                waiter = self._admission(1)
                if waiter is not None:
                    await waiter
                value = unwrap(verb, await (await self._send(call)))
            except ShinkenError as exc:
                rows.append(StepRow(index=i, verb=verb, outcome=classify_exception(exc), error=exc))
                failed_at = i
            else:
                rows.append(StepRow(index=i, verb=verb, outcome=protocol.OK, result=value))
        return StepResult(rows=tuple(rows))

    async def step(
        self,
        actions: Iterable[Mapping[str, Any]],
        observe: Mapping[str, Any] | None = None,
        *,
        timeout: float | None | UseDefault = DEFAULT,
        gateway: Gateway | None = None,
    ) -> StepResult:
        """Send every action, then the observation screenshot, before awaiting
        any reply: about one round trip for the whole step.

        The daemon runs them in order. There is no ``skipped`` here: every
        action is already on the wire when an earlier one fails, so each row
        carries its own real outcome (``ok | error | timeout | connection_lost |
        sandbox_died``),
        or ``denied`` when the gateway refused it (it was never sent).
        ``observe`` holds :meth:`screenshot` arguments (``{}`` for defaults); the
        observation comes back even after an action failed.

        Each call's deadline runs from the send and includes the waiting verbs
        (``wait``, ``exec``, ...) queued ahead of it (:func:`pipelined_deadlines`).
        ``timeout=`` replaces that: every reply must come within ``timeout``
        seconds of the send, so it bounds the whole step.
        """
        actions_ = list(actions)
        self._check_usable()
        # The whole step is admitted in one turn (its calls stay together on the
        # wire), counting every action (a gateway denial only leaves room unused).
        # Admission comes before any other work: in a burst of 1024 steps the
        # ones that must wait cost the turn only this, and the checking,
        # encoding and sending of each is spread over the turns too.
        waiter = self._admission(len(actions_) + (observe is not None))
        if waiter is not None:
            await waiter
        calls = [split_action(i, action) for i, action in enumerate(actions_)]
        observe_args = None if observe is None else split_action(len(calls), build.screenshot(**observe))[1]
        gate = gateway or self._gateway
        # Ask the gateway about every action before sending any, so a gateway
        # that raises leaves nothing half-sent.
        admitted = [gate is None or bool(gate(action)) for action in actions_]
        self._check_usable()
        sent = [call for call, ok in zip(calls, admitted) if ok]
        if observe_args is not None:
            sent.append(("screenshot", observe_args))
        deadlines = iter(pipelined_deadlines(self._rpc_timeout, sent, timeout))
        # Encode everything first: a bad argument raises before anything is sent.
        prepared = [
            self._prepare(verb, args, timeout, next(deadlines)) if ok else None
            for (verb, args), ok in zip(calls, admitted)
        ]
        observe_call = (
            None
            if observe_args is None
            else self._prepare("screenshot", observe_args, timeout, next(deadlines))
        )
        futures = [None if call is None else await self._send(call) for call in prepared]
        observation_future = None if observe_call is None else await self._send(observe_call)
        rows = []
        for i, ((verb, _), action, future) in enumerate(zip(calls, actions_, futures)):
            if future is None:
                error = ActionDenied(f"{verb}: refused by the gateway", action=dict(action))
                rows.append(StepRow(index=i, verb=verb, outcome=protocol.DENIED, error=error))
                continue
            try:
                value = unwrap(verb, await future)
            except ShinkenError as exc:
                rows.append(StepRow(index=i, verb=verb, outcome=classify_exception(exc), error=exc))
            else:
                rows.append(StepRow(index=i, verb=verb, outcome=protocol.OK, result=value))
        observation = observation_error = None
        if observation_future is not None:
            try:
                observation = unwrap("screenshot", await observation_future)
            except ShinkenError as exc:
                observation_error = exc
        return StepResult(rows=tuple(rows), observation=observation, observation_error=observation_error)

    # -- screencast --------------------------------------------------------

    async def screencast(
        self,
        fps: float = DEFAULT_SCREENCAST_FPS,
        max_long_edge: int | None = None,
        quality: int = DEFAULT_IMAGE_QUALITY,
        format: str = DEFAULT_IMAGE_FORMAT,
        *,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> ScreencastStream:
        """Start a pushed stream of frames (unchanged screens are not resent)."""
        params = {"fps": fps, "max_long_edge": max_long_edge, "quality": quality, "format": format}
        return await self._open_stream("screencast_start", params, None, timeout)

    async def resume_screencast(
        self,
        stream_id: str,
        params: Mapping[str, Any] | None = None,
        *,
        last_seq: int | None = None,
        timeout: float | None | UseDefault = DEFAULT,
    ) -> ScreencastStream:
        """Continue a stream started on another (dropped) connection.

        ``params`` may change fps/quality/format/max_long_edge (None keeps the
        stream's). ``last_seq`` is the last frame the consumer got (a
        ``StreamLost`` carries it); the next frame's ``gap`` counts from it.
        Without it, the gap counts the frames the daemon could not send.
        """
        args = {"stream_id": stream_id, **(params or {})}
        return await self._open_stream("resume_screencast", args, last_seq, timeout)

    async def _open_stream(
        self, verb: str, args: dict[str, Any], last_seq: int | None, timeout: float | None | UseDefault
    ) -> ScreencastStream:
        # The reader registers the stream when the reply arrives, before any of
        # its frames can be routed, and resolves the call with the stream itself.
        outcome = await (await self._submit(verb, args, timeout))
        if not isinstance(outcome, ScreencastStream):
            result = unwrap(verb, outcome)  # raises for an error reply
            raise ProtocolViolation(f"{verb} reply without a usable stream_id: {result!r}")
        stream = outcome
        if last_seq is not None:
            stream._last_seq = last_seq
        return stream

    def _register_stream(self, opened: StreamOpened) -> ScreencastStream:
        queue = FrameQueue(self._budget, self._max_queue_frames, self._frame_counters)
        stream = ScreencastStream(self, opened.stream_id, opened.params, queue, opened.delivered)
        previous = self._proto.open_stream(opened.stream_id, stream)
        if previous is not None:  # resumed on the connection that already had it
            previous._finish(_ENDED, "moved", release=True)
        return stream

    def _stop_unclaimed_stream(self, stream_id: str) -> None:
        """Stop a stream nobody holds (its opener's caller stopped waiting):
        the daemon would push its frames for the rest of the connection."""
        if self._closing or self._loss is not None:
            return
        # Fire and forget: a call with its own rpc_timeout deadline, failed by
        # close() or a connection loss like any other, so nothing waits on it.
        task = self._loop.create_task(self._stop_quietly(stream_id), name=f"shinken-stop {stream_id}")
        self._stopping_unclaimed.add(task)
        task.add_done_callback(self._stopping_unclaimed.discard)

    async def _stop_quietly(self, stream_id: str) -> None:
        try:
            await self._call("screencast_stop", {"stream_id": stream_id})
        except ShinkenError as exc:  # ended on its own (not_found), or went with the connection
            log.debug("%s: stopping unclaimed stream %s: %s", self._url, stream_id, exc)

    # -- the reader --------------------------------------------------------

    async def _read_loop(self) -> None:
        cause: BaseException | None = None
        close_with: tuple[int, str] | None = None
        try:
            release = self._transport.release_message
            turns = self._reply_turns
            async for message in self._ws:
                limit = MAX_REPLIES_PER_TURN
                if limit is not None and not turns.try_admit(1, limit):
                    await turns.admit(1, limit)
                self._dispatch(message)
                if len(message) >= transports.RELEASE_FRAME_BYTES:
                    release(self._ws)
                # The loop variable would keep the last message (a ~72 KiB
                # observation) alive until the next one arrives: per idle
                # connection, that is most of its steady-state memory.
                del message
        except self._closed_error as exc:
            cause = exc
        except ProtocolViolation as exc:
            cause, close_with = exc, (1002, "protocol error")
            log.warning("%s: %s; closing the connection", self._url, exc)
        except Exception as exc:  # a bug here must not leave calls hanging
            cause, close_with = exc, (1011, "client error")
            log.exception("%s: reader failed; closing the connection", self._url)
        finally:  # the connection is no longer open, even when cancelled (a SharedLoop shutting down)
            fleetgc.release_connection(self, self._loop)
        # Fail what is pending first: the closing handshake may take close_timeout.
        await self._connection_gone(cause)
        if close_with is not None:
            await self._ws.close(*close_with)

    def _dispatch(self, message: str | bytes) -> None:
        event = self._proto.receive(message)
        if isinstance(event, FrameReceived):
            event.stream._push(event.frame, event.size)
        elif isinstance(event, (Replied, StreamOpened)):
            call = event.call
            if call.waiter.done():  # the caller was cancelled
                if isinstance(event, StreamOpened):
                    self._stop_unclaimed_stream(event.stream_id)
            elif isinstance(event, StreamOpened):
                call.waiter.set_result(self._register_stream(event))
            else:
                call.waiter.set_result(event.reply)
        elif isinstance(event, UnclaimedStream):
            self._stop_unclaimed_stream(event.stream_id)
        elif isinstance(event, StreamClosed):  # frames already queued stay readable before the end
            event.stream._finish(_ENDED, event.reason, release=False)

    async def _connection_gone(self, cause: BaseException | None) -> None:
        if self._closing:
            loss: ShinkenError = SandboxClosed(f"sandbox {self.sandbox_id} was closed")
        else:
            loss = await self._classify_loss(cause)
        loss.__cause__ = cause
        self._loss = loss
        pending, streams = self._proto.lose()
        self._disarm_deadline()
        for call in pending:
            if not call.waiter.done():
                call.waiter.set_exception(self._loss_error())
        for stream in streams:
            if self._closing:
                stream._finish(_ENDED, "closed", release=True)
            else:
                stream._finish(_StreamLostMark(loss), "lost", release=True)

    async def _classify_loss(self, cause: BaseException | None) -> ShinkenError:
        if isinstance(cause, ProtocolViolation):
            return cause
        # close_code is None when the TCP connection broke without a close frame.
        code, reason = self._ws.close_code, self._ws.close_reason or ""
        liveness = await self._probe_liveness()
        return loss_error(self.sandbox_id, code, reason, liveness, probed=self._probe is not None)

    async def _probe_liveness(self) -> Liveness | None:
        """Ask the provider, at most twice: a killed process closes its sockets a
        moment before its exit status becomes visible."""
        if self._probe is None:
            return None
        deadline = self._loop.time() + LIVENESS_PROBE_TIMEOUT
        liveness = None
        for attempt in range(2):
            if attempt:
                await asyncio.sleep(LIVENESS_RECHECK_DELAY)
            try:
                liveness = await asyncio.wait_for(
                    self._loop.run_in_executor(None, self._probe), max(0.0, deadline - self._loop.time())
                )
            except Exception:
                log.warning("%s: liveness probe failed", self._url, exc_info=True)
                return liveness
            if not liveness.alive:
                break
        return liveness


class ScreencastStream:
    """One screencast: ``async for frame in stream`` or :meth:`next_frame`.

    Frames queue up (at most ``max_queue_frames``, oldest dropped first, and
    within the loop's frame budget) until consumed. Iteration ends when the
    stream ends (``stop()``, the daemon ended it, or the sandbox was closed);
    a dropped connection raises :class:`~shinken_sync.errors.StreamLost`,
    which carries what :meth:`AsyncSandbox.resume_screencast` needs.
    """

    def __init__(
        self, sandbox: AsyncSandbox, stream_id: str, params: dict[str, Any], queue: FrameQueue, last_seq: int
    ):
        self._sandbox = sandbox
        self._stream_id = stream_id
        self._params = params
        self._queue = queue
        self._last_seq = last_seq
        self._missed = 0
        self._end_reason: str | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def stream_id(self) -> str:
        return self._stream_id

    @property
    def params(self) -> dict[str, Any]:
        """fps, format, quality, max_long_edge as the daemon confirmed them."""
        return dict(self._params)

    @property
    def last_seq(self) -> int:
        """``seq`` of the last frame handed to the consumer (0 before the first)."""
        return self._last_seq

    @property
    def missed(self) -> int:
        """Sum of the ``gap`` of every frame delivered so far."""
        return self._missed

    @property
    def ended(self) -> bool:
        return self._queue.terminal is not None

    @property
    def end_reason(self) -> str | None:
        """None while open; else ``stopped`` (by us or the daemon), ``closed``
        (sandbox closed, or the daemon's grace period ran out), ``moved``
        (resumed on another connection), ``error`` (the daemon's stream
        failed) or ``lost`` (the connection dropped)."""
        return self._end_reason

    @property
    def counters(self) -> FrameCounters:
        """This stream's queued/dropped/evicted frames."""
        return self._queue.counters

    def __aiter__(self) -> ScreencastStream:
        return self

    async def __anext__(self) -> Frame:
        frame = await self.next_frame()
        if frame is None:
            raise StopAsyncIteration
        return frame

    async def next_frame(self, timeout: float | None = None) -> Frame | None:
        """The next frame in order; None once the stream has ended.

        Raises:
            FrameTimeout: no frame within ``timeout`` seconds (None = wait; the
                connection's keepalive bounds how long a dead peer goes unnoticed).
            StreamLost: the connection dropped; resume on a new connection.
        """
        loop = self._sandbox._loop
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            item = self._queue.pop()
            if item is EMPTY:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    raise FrameTimeout(f"no frame from stream {self._stream_id} within {timeout:g} s")
                if self._waiter is None or self._waiter.done():
                    self._waiter = loop.create_future()
                # asyncio.wait (unlike wait_for) never cancels the shared waiter.
                await asyncio.wait((self._waiter,), timeout=remaining)
                continue
            if item is _ENDED:
                return None
            if isinstance(item, _StreamLostMark):
                raise StreamLost(
                    f"stream {self._stream_id} lost with its connection at seq {self._last_seq}",
                    stream_id=self._stream_id,
                    params=self.params,
                    last_seq=self._last_seq,
                ) from item.cause
            gap = max(0, item.seq - self._last_seq - 1)
            self._last_seq = max(self._last_seq, item.seq)
            self._missed += gap
            return Frame._from_protocol(item, gap)

    async def stop(self, *, timeout: float | None | UseDefault = DEFAULT) -> None:
        """Stop the stream and release its queued frames. Idempotent; only
        releases the frames once the stream ended or its connection is gone."""
        sandbox = self._sandbox
        if not self.ended and sandbox._loss is None and not sandbox._closing:
            try:
                await sandbox._call("screencast_stop", {"stream_id": self._stream_id}, timeout)
            except ActionError as exc:
                if exc.kind != protocol.ERR_NOT_FOUND:  # already ended in the daemon
                    raise
            except ConnectionLost:
                pass
        sandbox._proto.close_stream(self._stream_id)
        self._finish(_ENDED, "stopped", release=True)

    def _push(self, frame: protocol.Frame, size: int) -> None:
        if self._queue.push(frame, size):
            self._wake()

    def _finish(self, sentinel: Any, reason: str, *, release: bool) -> None:
        if release:
            self._queue.clear()
        if self._queue.terminal is None:
            self._end_reason = reason
            self._queue.end(sentinel)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
