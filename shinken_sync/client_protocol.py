"""The client side of one ACI connection, without any I/O (h11-style).

:class:`ClientProtocol` holds the state of one connection and nothing that
touches a socket, a clock or an event loop: messages go in (:meth:`~ClientProtocol.receive`),
events come out (:data:`Event`), and calls to send come out of
:meth:`~ClientProtocol.prepare`. It owns

* call ids and the calls awaiting a reply (each carries an opaque ``waiter``
  the transport puts there, and the time it expires on the transport's clock:
  :meth:`~ClientProtocol.expire_due` finds the calls past it, so a transport
  needs one timer per connection, not one per call);
* reply routing: a reply goes to its call, a late one (its call expired) is
  dropped, and one to a call never sent is a :class:`ProtocolViolation`;
* the streams open on the connection (frame routing, ``stream_end``, the
  stream a late opener's reply brings, which must be stopped);
* the deadline arithmetic: :func:`call_deadline`, :func:`pipelined_deadlines`
  and the per-method rules the blocking face bounds its callers with
  (:data:`SANDBOX_DEADLINES`, :data:`STREAM_DEADLINES`);
* the translation of a reply into the value a method returns
  (:func:`unwrap`, one decoder per result kind of :mod:`shinken_sync.verbs`)
  and the hello check (:func:`check_hello`).

``client.py`` is the asyncio transport around it: it dials, reads, arms one
deadline timer per connection, wakes waiters and probes liveness. ``tests/sdk/test_client_protocol.py``
drives this object against the daemon's own dispatch and a scripted peer
without any socket.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import protocol
from .errors import (
    ActionError,
    ActionTimeout,
    ConnectionLost,
    MessageTooBig,
    ProtocolMismatch,
    ProtocolViolation,
    RPCTimeout,
    SandboxDied,
    ShinkenError,
)
from .liveness import Liveness
from .results import ExecResult, Screenshot
from .verbs import ACTION_VERBS, STREAM_OPENERS, VERBS, WAITING_VERBS, Result


class UseDefault:
    """The type of :data:`DEFAULT` (one instance: compare with ``is``, or ``isinstance``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEFAULT"

    def __reduce__(self) -> str:
        return "DEFAULT"  # pickles and copies as the module's one instance


#: ``timeout=DEFAULT`` (every call's default): the connection's ``rpc_timeout``, plus the time
#: the verb waits in the daemon on purpose. ``timeout=None`` is no client-side limit: the call
#: ends with its reply or the connection's end. A number is that many seconds. The same three
#: meanings hold on every method; :meth:`ScreencastStream.next_frame`, whose default is to wait
#: for the next frame, takes None (its default) or a number.
DEFAULT = UseDefault()

__all__ = [
    "CLOSE_DEADLINE",
    "DEFAULT",
    "READ_FILE_CHUNK",
    "SANDBOX_DEADLINES",
    "STREAM_DEADLINES",
    "WAITING_VERB_SLACK",
    "ClientProtocol",
    "DeadlineRule",
    "Event",
    "FrameReceived",
    "OutgoingCall",
    "PendingCall",
    "Replied",
    "StreamClosed",
    "StreamOpened",
    "UseDefault",
    "call_deadline",
    "check_hello",
    "loss_error",
    "pipelined_deadlines",
    "unwrap",
]

#: Added to the duration of verbs that wait on purpose to form their deadline.
WAITING_VERB_SLACK = 10.0
#: read_file() without max_bytes fetches the file in calls of this size (the
#: daemon's own per-call cap).
READ_FILE_CHUNK = 8 * 2**20
#: Bound on ``close()``: the closing handshake plus the reader winding down.
CLOSE_DEADLINE = 30.0


# ---------------------------------------------------------------------------
# Calls


class OutgoingCall:
    """One encoded call, ready to send; ``deadline`` is seconds from the send."""

    __slots__ = ("call_id", "deadline", "message", "verb")

    def __init__(self, call_id: int, verb: str, message: str, deadline: float | None):
        self.call_id = call_id
        self.verb = verb
        self.message = message
        self.deadline = deadline


class PendingCall:
    """A sent call awaiting its reply. ``waiter`` belongs to the transport (an
    asyncio future); the protocol only hands it back in events. ``expires_at``
    is when the call's deadline passes on the transport's clock (None: never)."""

    __slots__ = ("call_id", "deadline", "expires_at", "verb", "waiter")

    def __init__(self, call: OutgoingCall, waiter: Any, expires_at: float | None):
        self.call_id = call.call_id
        self.verb = call.verb
        self.deadline = call.deadline
        self.waiter = waiter
        self.expires_at = expires_at


# ---------------------------------------------------------------------------
# Events


@dataclass(frozen=True)
class Replied:
    """The reply to a pending call (not a stream opener's OK, see :class:`StreamOpened`)."""

    call: PendingCall
    reply: protocol.Reply


@dataclass(frozen=True)
class StreamOpened:
    """A stream opener's OK reply. The transport registers the stream with
    :meth:`ClientProtocol.open_stream` if its caller still waits, or stops it."""

    call: PendingCall
    reply: protocol.Reply
    stream_id: str
    params: dict[str, Any]
    #: seq of the last frame the daemon sent before (0 for a new stream).
    delivered: int


@dataclass(frozen=True)
class UnclaimedStream:
    """A late opener's reply brought a stream nobody holds: stop it, or the
    daemon pushes its frames for the rest of the connection."""

    stream_id: str


@dataclass(frozen=True)
class FrameReceived:
    stream: Any  # the consumer given to open_stream
    frame: protocol.Frame
    size: int


@dataclass(frozen=True)
class StreamClosed:
    stream: Any  # the consumer given to open_stream
    reason: str


Event = Replied | StreamOpened | UnclaimedStream | FrameReceived | StreamClosed


class ClientProtocol:
    """The state of one connection (see the module docstring).

    Methods never block and never do I/O; each returns what the transport
    must do next. After :meth:`lose`, nothing is pending and nothing is open.
    """

    def __init__(self, hello: protocol.Hello, rpc_timeout: float):
        self.hello = hello
        self.rpc_timeout = rpc_timeout
        self._next_call_id = 1
        self._pending: dict[int, PendingCall] = {}
        self._streams: dict[str, Any] = {}
        # Stream openers whose caller stopped waiting (timed out): their stream,
        # if the reply brings one, is stopped, never left pushing.
        self._unclaimed_openers: set[int] = set()

    @property
    def pending_calls(self) -> int:
        return len(self._pending)

    @property
    def open_streams(self) -> dict[str, Any]:
        """stream id -> the consumer registered for it (a copy)."""
        return dict(self._streams)

    # -- sending -----------------------------------------------------------

    def prepare(
        self,
        verb: str,
        args: Mapping[str, Any],
        timeout: float | None | UseDefault = DEFAULT,
        deadline: float | None | UseDefault = DEFAULT,
    ) -> OutgoingCall:
        """Encode one call without sending it; bad arguments raise here, so a
        batch can be checked whole before any of it goes out. ``deadline``
        overrides the call's own :func:`call_deadline` (a pipelined step's; None: no limit).

        Raises:
            TypeError: an argument is not JSON-serialisable.
            MessageTooBig: the encoded call exceeds the protocol's message limit.
        """
        wire = wire_args(verb, args)
        call_id = self._next_call_id
        self._next_call_id += 1
        message = protocol.encode_call(call_id, verb, wire)
        # len() counts characters; only a long message needs its UTF-8 size.
        if len(message) > protocol.MAX_MESSAGE_SIZE // 4 and len(message.encode()) > protocol.MAX_MESSAGE_SIZE:
            raise MessageTooBig(
                f"{verb}: the encoded call is over the {protocol.MAX_MESSAGE_SIZE}-byte message limit; "
                "nothing was sent",
                verb=verb,
            )
        if isinstance(deadline, UseDefault):
            deadline = call_deadline(self.rpc_timeout, verb, wire, timeout)
        return OutgoingCall(call_id, verb, message, deadline)

    def sent(self, call: OutgoingCall, waiter: Any = None, expires_at: float | None = None) -> PendingCall:
        """Record ``call`` as on the wire; its reply will be routed to ``waiter``.
        ``expires_at``: the send time plus the call's deadline, on the clock the
        transport later passes to :meth:`expire_due` (None: no deadline)."""
        pending = self._pending[call.call_id] = PendingCall(call, waiter, expires_at)
        return pending

    def expire_due(self, now: float) -> tuple[list[tuple[PendingCall, RPCTimeout]], float | None]:
        """Expire every pending call whose ``expires_at`` is at or before ``now``
        (as :meth:`expire`, in send order); return them and the earliest
        ``expires_at`` still pending (None: no pending call has a deadline)."""
        due = [call_id for call_id, p in self._pending.items() if p.expires_at is not None and p.expires_at <= now]
        expired = [expired for expired in map(self.expire, due) if expired is not None]
        remaining = [p.expires_at for p in self._pending.values() if p.expires_at is not None]
        return expired, min(remaining, default=None)

    def expire(self, call_id: int) -> tuple[PendingCall, RPCTimeout] | None:
        """The call's deadline passed: forget it (a late reply is dropped) and
        return it with the error its caller gets; None if it already ended."""
        pending = self._pending.pop(call_id, None)
        if pending is None:
            return None
        if pending.verb in STREAM_OPENERS:
            self._unclaimed_openers.add(call_id)
        assert pending.deadline is not None  # only a call with a deadline expires
        error = RPCTimeout(
            f"{pending.verb}: no reply within {pending.deadline:g} s",
            verb=pending.verb,
            call_id=call_id,
            timeout=pending.deadline,
        )
        return pending, error

    # -- receiving ---------------------------------------------------------

    def receive(self, message: str | bytes | memoryview) -> Event | None:
        """Route one daemon message; None when it needs no action (a late
        reply or frame).

        Raises:
            ProtocolViolation: the message is undecodable, a reply answers a
                call never sent, or a second hello came.
        """
        try:
            msg = protocol.decode_server_message(message)
        except protocol.ProtocolError as exc:
            raise ProtocolViolation(f"undecodable message: {exc}") from exc
        if isinstance(msg, protocol.Frame):
            stream = self._streams.get(msg.stream_id)
            # None: a late frame of a stream already stopped.
            return None if stream is None else FrameReceived(stream, msg, len(message))
        if isinstance(msg, protocol.Reply):
            return self._route_reply(msg)
        if isinstance(msg, protocol.StreamEnd):
            stream = self._streams.pop(msg.stream_id, None)
            return None if stream is None else StreamClosed(stream, msg.reason)
        raise ProtocolViolation(f"unexpected {type(msg).__name__} after the hello")

    def _route_reply(self, reply: protocol.Reply) -> Event | None:
        call_id = reply.call_id
        pending = self._pending.pop(call_id, None) if isinstance(call_id, int) else None
        if pending is None:
            if isinstance(call_id, int) and 0 < call_id < self._next_call_id:
                # The call already timed out; its late reply is dropped.
                if call_id in self._unclaimed_openers:
                    self._unclaimed_openers.discard(call_id)
                    stream_id = self.stream_of(reply)
                    return None if stream_id is None else UnclaimedStream(stream_id)
                return None
            raise ProtocolViolation(f"reply to call {call_id!r}, which was never sent")
        if pending.verb in STREAM_OPENERS:
            stream_id = self.stream_of(reply)
            if stream_id is not None:
                result = reply.result or {}
                params = {k: result.get(k) for k in ("fps", "format", "quality", "max_long_edge")}
                # On resume the daemon reports its seq and the frames it could not send.
                delivered = int(result.get("last_seq", 0)) - int(result.get("missed", 0))
                return StreamOpened(pending, reply, stream_id, params, delivered)
        return Replied(pending, reply)

    @staticmethod
    def stream_of(reply: protocol.Reply) -> str | None:
        """The stream id an opener's OK reply carries, else None."""
        stream_id = (reply.result or {}).get("stream_id") if reply.outcome == protocol.OK else None
        return stream_id if isinstance(stream_id, str) else None

    # -- streams -----------------------------------------------------------

    def open_stream(self, stream_id: str, consumer: Any) -> Any:
        """Route ``stream_id``'s frames to ``consumer`` from now on; return the
        consumer it had (a stream resumed on the connection that had it), or None."""
        previous = self._streams.get(stream_id)
        self._streams[stream_id] = consumer
        return previous

    def close_stream(self, stream_id: str) -> None:
        """The consumer stopped the stream: its late frames are dropped."""
        self._streams.pop(stream_id, None)

    # -- the end -----------------------------------------------------------

    def lose(self) -> tuple[list[PendingCall], list[Any]]:
        """The connection is gone: return every pending call and every open
        stream's consumer, and forget them all."""
        pending, self._pending = list(self._pending.values()), {}
        streams, self._streams = list(self._streams.values()), {}
        self._unclaimed_openers.clear()
        return pending, streams


# ---------------------------------------------------------------------------
# The hello


def check_hello(message: str | bytes | memoryview, url: str) -> protocol.Hello:
    """Decode the daemon's first message.

    Raises:
        ProtocolViolation: it is not a well-formed hello.
        ProtocolMismatch: the daemon speaks another protocol version.
    """
    try:
        hello = protocol.decode_server_message(message)
    except protocol.ProtocolError as exc:
        raise ProtocolViolation(f"{url}: bad hello: {exc}") from exc
    if not isinstance(hello, protocol.Hello):
        raise ProtocolViolation(f"{url}: expected hello, got {type(hello).__name__}")
    if hello.protocol != protocol.PROTOCOL_VERSION:
        raise ProtocolMismatch(url, daemon=hello.protocol, client=protocol.PROTOCOL_VERSION)
    return hello


# ---------------------------------------------------------------------------
# The loss of a connection


def loss_error(
    sandbox_id: str, code: int | None, reason: str, liveness: Liveness | None, *, probed: bool
) -> ConnectionLost:
    """What a dropped connection's pending calls fail with: ``SandboxDied`` when
    the provider's ``liveness`` says the sandbox is gone, else ``ConnectionLost``
    (alive, "unknown", no answer, or no probe: a dropped connection is not a
    death). ``code``/``reason`` are the close frame's (None: no close frame)."""
    if liveness is not None and not liveness.alive:
        return SandboxDied.from_liveness(liveness, code=code, reason=reason)
    detail = f" (close code {code}{': ' + reason if reason else ''})" if code is not None else ""
    said = "no liveness probe" if not probed else (
        "the provider did not answer" if liveness is None else
        f"the provider says alive{': ' + liveness.detail if liveness.detail else ''}"
    )  # fmt: skip
    return ConnectionLost(
        f"connection to sandbox {sandbox_id} lost{detail}; {said}", code=code, reason=reason, liveness=liveness
    )


# ---------------------------------------------------------------------------
# Arguments


def wire_args(verb: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None values (the daemon's defaults apply) and base64 bytes fields."""
    out = {name: value for name, value in args.items() if value is not None}
    spec = VERBS.get(verb)
    binary = spec.binary_arg if spec is not None else None
    if binary is not None and isinstance(out.get(binary), (bytes, bytearray, memoryview)):
        out[binary] = base64.b64encode(out[binary]).decode("ascii")
    return out


def split_action(index: int, action: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(verb, args)`` of one ``step``/``act_batch`` action, or TypeError/ValueError."""
    if not isinstance(action, Mapping):
        raise TypeError(
            f"actions[{index}] must be a dict like {{'verb': 'click', ...}}, not {type(action).__name__}"
        )
    verb = action.get("verb")
    if verb not in ACTION_VERBS:
        raise ValueError(
            f"actions[{index}]: {verb!r} is not an action verb ({', '.join(sorted(ACTION_VERBS))})"
        )
    return verb, {name: value for name, value in action.items() if name != "verb"}


# ---------------------------------------------------------------------------
# Deadlines


def waiting_time(verb: str, args: Mapping[str, Any]) -> float:
    """Seconds a verb may legitimately take in the daemon before replying."""
    if verb not in WAITING_VERBS:  # the hot path: clicks, screenshots
        return 0.0
    spec = VERBS[verb]
    assert spec.waits_on is not None
    ms = args.get(spec.waits_on)
    # The daemon's own default applies when the caller gave none.
    return (ms if ms is not None else spec.default_wait_ms or 0) / 1000


def call_deadline(
    rpc_timeout: float,
    verb: str,
    args: Mapping[str, Any],
    timeout: float | None | UseDefault = DEFAULT,
    *,
    queued: float = 0.0,
) -> float | None:
    """Seconds one call may wait for its reply: ``timeout`` when given (None: no limit),
    else (:data:`DEFAULT`) ``rpc_timeout``, plus the verb's own duration, the ``queued``
    seconds of waiting verbs the daemon runs before it, and :data:`WAITING_VERB_SLACK`
    when either is non-zero. (The sync facade bounds its callers with it.)"""
    if not isinstance(timeout, UseDefault):
        return None if timeout is None else float(timeout)
    waiting = queued + waiting_time(verb, args)
    return rpc_timeout + (waiting + WAITING_VERB_SLACK if waiting else 0.0)


def pipelined_deadlines(
    rpc_timeout: float, calls: Iterable[tuple[str, Mapping[str, Any]]], timeout: float | None | UseDefault = DEFAULT
) -> list[float | None]:
    """:func:`call_deadline` of each of ``calls`` sent at once, as ``AsyncSandbox.step``
    sends them: the daemon runs a connection's calls in order, so each also
    waits out the waiting verbs ahead of it. An explicit ``timeout`` is the
    caller's bound on every reply, measured from the send, so it bounds the whole
    step."""
    deadlines: list[float | None] = []
    queued = 0.0
    for verb, args in calls:
        deadlines.append(call_deadline(rpc_timeout, verb, args, timeout, queued=queued))
        queued += waiting_time(verb, args)
    return deadlines


# A deadline rule maps (the connection's rpc_timeout, a method's bound
# arguments) to the seconds the method may legitimately take, or None for "as
# long as the caller asked". It may normalise arguments in place (an actions
# iterator becomes a list, so the rule and the call both see every action).
DeadlineRule = Callable[[float, dict[str, Any]], "float | None"]


def one_call(verb: str) -> DeadlineRule:
    """The rule of a method that sends one ``verb`` call."""

    def rule(rpc_timeout: float, args: dict[str, Any]) -> float | None:
        return call_deadline(rpc_timeout, verb, args, args.get("timeout", DEFAULT))

    return rule


def _action_calls(args: dict[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    actions = args.get("actions")
    if actions is None:
        return []  # missing: calling the method raises the TypeError
    args["actions"] = actions = list(actions)
    calls: list[tuple[str, Mapping[str, Any]]] = []
    for action in actions:
        # A malformed action gets the plain rpc deadline here; the core rejects it.
        call = {k: v for k, v in action.items() if k != "verb"} if isinstance(action, Mapping) else {}
        verb = action.get("verb", "") if isinstance(action, Mapping) else ""
        calls.append((verb, call))
    if args.get("observe") is not None:
        calls.append(("screenshot", {}))
    return calls


def _act_batch_deadline(rpc_timeout: float, args: dict[str, Any]) -> float | None:
    # One action after another, each with its own deadline from its own send.
    timeout = args.get("timeout", DEFAULT)
    deadlines = [call_deadline(rpc_timeout, verb, call, timeout) for verb, call in _action_calls(args)]
    return None if None in deadlines else sum(d for d in deadlines if d is not None)


def _step_deadline(rpc_timeout: float, args: dict[str, Any]) -> float | None:
    # All in flight at once, run in order: the latest deadline, counting every
    # call as sent (a gateway denial only shortens the step).
    deadlines = pipelined_deadlines(rpc_timeout, _action_calls(args), args.get("timeout", DEFAULT))
    if None in deadlines:
        return None
    return max((d for d in deadlines if d is not None), default=rpc_timeout)


def _read_file_deadline(rpc_timeout: float, args: dict[str, Any]) -> float | None:
    max_bytes = args.get("max_bytes")
    if max_bytes is None:
        return None  # chunk count unknown; each chunk call is bounded on the loop
    chunks = max(1, math.ceil(int(max_bytes) / READ_FILE_CHUNK))
    each = call_deadline(rpc_timeout, "read_file", args, args.get("timeout", DEFAULT))
    return None if each is None else chunks * each


def _caller_timeout(rpc_timeout: float, args: dict[str, Any]) -> float | None:
    timeout = args.get("timeout")
    return None if timeout is None else float(timeout)


def _fixed(seconds: float) -> DeadlineRule:
    return lambda rpc_timeout, args: seconds


def plain_rpc(rpc_timeout: float, args: dict[str, Any]) -> float:
    """The rule of any other method: one call's plain ``rpc_timeout``."""
    return rpc_timeout


#: AsyncSandbox method -> its rule: one per verb method (from the verb table),
#: then the methods that are not one call.
SANDBOX_DEADLINES: dict[str, DeadlineRule] = {
    **{verb.method: one_call(name) for name, verb in VERBS.items() if verb.method != "stop"},
    "read_file": _read_file_deadline,
    "act_batch": _act_batch_deadline,
    "step": _step_deadline,
    "close": _fixed(CLOSE_DEADLINE),
    "__aexit__": _fixed(CLOSE_DEADLINE),
}

#: ScreencastStream method -> its rule.
STREAM_DEADLINES: dict[str, DeadlineRule] = {
    "next_frame": _caller_timeout,
    "__anext__": _caller_timeout,
    "stop": one_call("screencast_stop"),
}


# ---------------------------------------------------------------------------
# Replies


def reply_error(verb: str, reply: protocol.Reply) -> ShinkenError:
    """The exception an error reply raises."""
    error = reply.error or protocol.ErrorInfo(protocol.ERR_INTERNAL, "error reply without an error")
    if reply.outcome == protocol.SANDBOX_DIED:
        return SandboxDied(f"{verb}: {error.message}", detail=error.message)
    cls = ActionTimeout if reply.outcome == protocol.TIMEOUT else ActionError
    return cls(error.message, kind=error.kind, verb=verb, call_id=reply.call_id)


def _decode_exec(reply: protocol.Reply) -> ExecResult:
    r = reply.result or {}
    binary = r.get("encoding") == "base64"
    out, err = r.get("stdout", ""), r.get("stderr", "")
    return ExecResult(
        exit_code=r.get("exit_code"),
        signal=r.get("signal"),
        stdout=base64.b64decode(out) if binary else out,
        stderr=base64.b64decode(err) if binary else err,
        stdout_truncated=bool(r.get("stdout_truncated")),
        stderr_truncated=bool(r.get("stderr_truncated")),
        duration_ms=float(r.get("duration_ms", 0.0)),
    )


def _decode_screenshot(reply: protocol.Reply) -> Screenshot:
    if reply.image is None:
        raise ProtocolViolation("screenshot reply carried no image")
    return Screenshot._from_wire(reply.result or {}, reply.image)


def _no_value(reply: protocol.Reply) -> None:
    return None  # input verbs reply with an empty result


def _point(reply: protocol.Reply) -> tuple[int, int]:
    result = reply.result or {}
    return (result["x"], result["y"])


def _size(reply: protocol.Reply) -> tuple[int, int]:
    result = reply.result or {}
    return (result["width"], result["height"])


#: Result kind (shinken_sync.verbs) -> reply -> the value the method returns.
#: Kinds without a decoder (dict, file, stream) return the result dict.
RESULT_DECODERS: dict[Result, Callable[[protocol.Reply], Any]] = {
    Result.SCREENSHOT: _decode_screenshot,
    Result.EXEC: _decode_exec,
    Result.POINT: _point,
    Result.SIZE: _size,
    Result.NONE: _no_value,
}
#: verb -> its decoder, derived from the verb table.
DECODERS = {name: RESULT_DECODERS[verb.result] for name, verb in VERBS.items() if verb.result in RESULT_DECODERS}


def unwrap(verb: str, reply: protocol.Reply) -> Any:
    """The value a method returns for ``reply``, or raise its error."""
    if reply.outcome != protocol.OK:
        raise reply_error(verb, reply)
    decode = DECODERS.get(verb)
    if decode is None:
        return reply.result or {}
    try:
        return decode(reply)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolViolation(f"{verb}: malformed result {reply.result!r}") from exc
