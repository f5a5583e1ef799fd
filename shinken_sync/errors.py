"""The SDK's exceptions, and the two functions that classify them.

Every failure a caller can branch on has its own class; nothing in the SDK
asks anyone to match message strings. The tree::

    ShinkenError
    ├── ConnectError               dialing failed: refused, DNS, TLS, handshake, no hello in time
    │   ├── InvalidURL (ValueError)  the URL is no ws://, wss:// or ws+unix:// endpoint (bad scheme, host, port);
    │   │                          nothing was dialed
    │   ├── AuthRefused            the daemon answered the handshake with HTTP 401
    │   └── ProtocolMismatch       the hello announced another protocol version (daemon, client)
    ├── ConnectionLost             an established connection dropped; pending calls fail with it.
    │   │                          The sandbox may be alive (``liveness`` says what the provider
    │   │                          answered, None when nobody was asked): outcome connection_lost
    │   └── SandboxDied            ... and the provider confirms the sandbox is gone
    │                              (exit_code / signal / oom); also a daemon's sandbox_died reply:
    │                              outcome sandbox_died
    ├── RPCTimeout (TimeoutError)  a call's client-side deadline passed without a reply
    ├── FrameTimeout (TimeoutError)  next_frame(timeout=...) saw no frame in time
    ├── ActionError                the daemon ran the call and replied with an error (kind, verb)
    │   └── ActionTimeout (TimeoutError)  the action's own deadline passed in the daemon
    ├── ActionDenied               a client-side gateway refused the action; it was never sent
    ├── MessageTooBig (ValueError)  a call would exceed the protocol's message limit; not sent
    ├── ProtocolViolation          the peer broke the ACI protocol; the SDK closed the connection
    ├── StreamLost                 a screencast's connection dropped; resume the stream elsewhere
    ├── Skipped                    marker in an act_batch row that never ran (never raised)
    ├── SandboxClosed (RuntimeError)  misuse: a call on a sandbox the caller already closed
    │
    │   defined in shinken_sync.sharedloop (the blocking face's loop thread):
    ├── LoopThreadDied             the SharedLoop's thread is gone; every waiter fails with it
    ├── LoopClosed (RuntimeError)  the SharedLoop was closed before or during the call
    ├── LoopTimeout (TimeoutError)  a blocking wait on the loop ran out; the coroutine was cancelled
    │
    │   defined in shinken_sync.fleet_view (publishing a fleet to the session server's viewer):
    ├── FleetViewError             the viewer refused the fleet (bad key, no viewer there, too many)
    │
    │   defined in shinken_sync.providers.errors (creating and tracking sandboxes):
    └── ProviderError              a provider could not create, reach or destroy a sandbox
        ├── DaemonStartError       shinkend exited, or stayed silent, before its ready line
        ├── ProviderExhausted      every sandbox of a fixed-size provider is handed out
        ├── UnknownHandle          a handle this provider did not create, or already destroyed
        ├── IsolationUnavailable   an isolated sandbox cannot be built on this host (says what is missing)
        │   └── CgroupUnavailable  the sandbox's cgroup (memory, CPU, pids limits) cannot be made or set
        └── ProviderConfigError (ValueError)  a provider config: unknown type or key, wrong-typed value

``tests/test_error_trees.py`` checks this drawing against the classes.

Errors raised where a lower layer failed (websockets, OS sockets) are raised
``from`` the original exception, so ``__cause__`` keeps the detail.

:func:`classify_exception` maps any exception onto the outcome taxonomy used by
step rows (``ok | error | timeout | skipped | denied | connection_lost |
sandbox_died``); a caller that wants "is this infrastructure or the task?"
calls it instead of an isinstance ladder. :func:`is_connection_loss` answers
"should I reconnect (or replace)?"; :func:`is_sandbox_death` answers "replace".

A dropped connection is not a dead sandbox. ``sandbox_died`` is reported only
when someone who can see the sandbox says it is gone: the provider's liveness
probe (``Liveness(alive=False)``, with the exit code, signal and -- where the
provider can know it -- ``oom``), or the daemon's own ``sandbox_died`` reply.
Every other loss (a reset, a closed proxy, a keepalive timeout, a probe that
says "alive", "unknown" or did not answer in time) is ``connection_lost``:
reconnect, the sandbox and its screencasts are probably still there.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from websockets.exceptions import ConnectionClosed

from . import protocol
from .transport import connection_closed_types

if TYPE_CHECKING:
    from .liveness import Liveness


class ShinkenError(Exception):
    """Root of every error the SDK raises on purpose.

    Copyable and picklable with every field (keyword-only fields would
    otherwise be lost: ``copy``/``pickle`` re-call ``__init__`` with ``args``).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type[ShinkenError], args: tuple[Any, ...], state: dict[str, Any]) -> ShinkenError:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class ConnectError(ShinkenError):
    """The connection could not be established (``url`` names the endpoint)."""

    def __init__(self, message: str, url: str = ""):
        super().__init__(message)
        self.url = url


class InvalidURL(ConnectError, ValueError):
    """The URL given to ``connect``/``aconnect`` is no ``ws://HOST:PORT/PATH`` or ``wss://``
    endpoint (another scheme, no host, a port that is no number or out of range); nothing was
    dialed. A ``ValueError`` too: the URL is the caller's bad argument, not a network failure."""


class AuthRefused(ConnectError):
    """The daemon refused the bearer token at the handshake (HTTP 401)."""


class ProtocolMismatch(ConnectError):
    """The daemon's hello announced a protocol version this SDK does not speak.

    ``daemon`` and ``client`` are the two versions; upgrade the older side.
    """

    def __init__(self, url: str, *, daemon: int, client: int):
        super().__init__(
            f"{url}: the daemon speaks ACI protocol version {daemon}, this SDK speaks {client}; "
            "upgrade the older of the two",
            url,
        )
        self.daemon = daemon
        self.client = client


class ConnectionLost(ShinkenError):
    """An established connection dropped.

    The sandbox may still be alive (a network blip, a restarted proxy):
    reconnecting can work. ``code``/``reason`` are the WebSocket close code and
    reason when a close frame was seen, else None/"". ``liveness`` is what the
    provider's probe answered on the failure path (``alive=True``, possibly
    with ``detail="unknown"``), or None when there was no probe or it failed
    or timed out: the SDK could not tell.
    """

    def __init__(
        self,
        message: str = "connection lost",
        *,
        code: int | None = None,
        reason: str = "",
        liveness: Liveness | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.liveness = liveness


class SandboxDied(ConnectionLost):
    """The sandbox is gone: reconnecting is pointless, replace it.

    ``exit_code`` is set when it exited on its own, ``signal`` when a signal
    killed it, ``oom`` when the kernel's OOM killer did; each is None/False when
    the provider cannot tell. ``detail`` is the provider's (or daemon's) note.
    """

    def __init__(
        self,
        message: str = "sandbox died",
        *,
        exit_code: int | None = None,
        signal: int | None = None,
        oom: bool = False,
        detail: str = "",
        code: int | None = None,
        reason: str = "",
    ):
        super().__init__(message, code=code, reason=reason)
        self.exit_code = exit_code
        self.signal = signal
        self.oom = oom
        self.detail = detail

    @classmethod
    def from_liveness(cls, liveness: Liveness, *, code: int | None = None, reason: str = "") -> SandboxDied:
        parts = []
        if liveness.exit_code is not None:
            parts.append(f"exit code {liveness.exit_code}")
        if liveness.signal is not None:
            parts.append(f"signal {liveness.signal}")
        if liveness.oom:
            parts.append("OOM-killed")
        if liveness.detail:
            parts.append(liveness.detail)
        died = cls(
            "sandbox died" + (f" ({', '.join(parts)})" if parts else ""),
            exit_code=liveness.exit_code,
            signal=liveness.signal,
            oom=liveness.oom,
            detail=liveness.detail,
            code=code,
            reason=reason,
        )
        died.liveness = liveness
        return died


class RPCTimeout(ShinkenError, TimeoutError):
    """No reply within the call's deadline. The connection stays usable; a late
    reply is discarded. ``verb``, ``call_id`` and ``timeout`` (seconds) say which."""

    def __init__(
        self, message: str, *, verb: str = "", call_id: protocol.CallId | None = None, timeout: float = 0.0
    ):
        super().__init__(message)
        self.verb = verb
        self.call_id = call_id
        self.timeout = timeout


class FrameTimeout(ShinkenError, TimeoutError):
    """``next_frame(timeout=...)`` waited that long and no frame arrived."""


class ActionError(ShinkenError):
    """The daemon replied with an error for one call.

    ``kind`` is one of :data:`shinken_sync.protocol.ERROR_KINDS` (``bad_args``,
    ``failed``, ``not_found``, ...), the branch point for callers.
    """

    def __init__(self, message: str, *, kind: str, verb: str = "", call_id: protocol.CallId | None = None):
        super().__init__(message)
        self.kind = kind
        self.verb = verb
        self.call_id = call_id

    def __str__(self) -> str:
        return f"{self.verb or 'call'} failed ({self.kind}): {self.args[0]}"


class ActionTimeout(ActionError, TimeoutError):
    """The daemon gave up on the action at its own deadline (reply outcome ``timeout``)."""


class ActionDenied(ShinkenError):
    """A client-side gateway refused the action before it was sent."""

    def __init__(self, message: str, *, action: dict[str, Any] | None = None):
        super().__init__(message)
        self.action = action


class MessageTooBig(ShinkenError, ValueError):
    """A call's encoded message exceeds ``protocol.MAX_MESSAGE_SIZE``.

    Raised before sending: the daemon would close the whole connection (code
    1009) on such a message, failing every other call in flight with it.
    """

    def __init__(self, message: str, *, verb: str = ""):
        super().__init__(message)
        self.verb = verb


class ProtocolViolation(ShinkenError):
    """The daemon sent something the ACI protocol does not allow.

    The SDK closes the connection (code 1002) when it sees one: it can no
    longer trust which reply belongs to which call.
    """


class StreamLost(ShinkenError):
    """A screencast stream's connection dropped before the stream ended.

    Carries what a resume needs: ``stream_id``, the stream's ``params`` and the
    ``last_seq`` the consumer received, for
    ``resume_screencast(e.stream_id, e.params, last_seq=e.last_seq)``.
    """

    def __init__(self, message: str, *, stream_id: str, params: dict[str, Any], last_seq: int):
        super().__init__(message)
        self.stream_id = stream_id
        self.params = params
        self.last_seq = last_seq


class SandboxClosed(ShinkenError, RuntimeError):
    """Misuse: the caller already closed this sandbox."""


class Skipped(ShinkenError):
    """Marker for an ``act_batch`` action not run because an earlier one failed.

    Never raised by the SDK; it sits in a skipped row's ``error`` so the row
    says which action stopped the batch (``cause_index``).
    """

    def __init__(self, message: str, *, cause_index: int):
        super().__init__(message)
        self.cause_index = cause_index


def is_connection_loss(exc: BaseException | None) -> bool:
    """True when ``exc`` means the transport to a sandbox is gone.

    Covers the SDK's :class:`ConnectionLost` family (including
    :class:`SandboxDied`), :class:`StreamLost`, the ``ConnectionClosed``
    family of either transport (websockets, picows), and OS-level
    resets/broken pipes/EOFs.
    """
    return isinstance(
        exc,
        (
            ConnectionLost,
            StreamLost,
            ConnectionClosed,
            ConnectionResetError,
            ConnectionAbortedError,
            BrokenPipeError,
            EOFError,
            asyncio.IncompleteReadError,
            *connection_closed_types(),  # the [fast] transport's too, when loaded
        ),
    )


def is_sandbox_death(exc: BaseException | None) -> bool:
    """True when ``exc`` says the sandbox itself is gone (replace it, do not
    reconnect): a :class:`SandboxDied`, from the provider's probe or the
    daemon's ``sandbox_died`` reply. Any other connection loss is False."""
    return isinstance(exc, SandboxDied)


def classify_exception(exc: BaseException | None) -> str:
    """Map an exception (or None for success) onto the outcome taxonomy.

    ``None`` -> ``ok``; :class:`SandboxDied` -> ``sandbox_died`` (the
    provider or the daemon says the sandbox is gone); any other connection
    loss (see :func:`is_connection_loss`: a bare :class:`ConnectionLost`,
    :class:`StreamLost`, websockets' ``ConnectionClosed``, OS resets) ->
    ``connection_lost`` (the sandbox may be alive: reconnect); any timeout ->
    ``timeout``; everything else -> ``error``. ``skipped`` and ``denied`` are
    verdicts about calls that never ran, so only :class:`Skipped` /
    :class:`ActionDenied` markers produce them.
    """
    if exc is None:
        return protocol.OK
    if isinstance(exc, Skipped):
        return protocol.SKIPPED
    if isinstance(exc, ActionDenied):
        return protocol.DENIED
    if is_sandbox_death(exc):
        return protocol.SANDBOX_DIED
    if is_connection_loss(exc):
        return protocol.CONNECTION_LOST
    # asyncio.TimeoutError is a distinct class before Python 3.11.
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return protocol.TIMEOUT
    return protocol.ERROR
