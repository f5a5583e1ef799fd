"""The ACI (agent-computer interface) wire protocol, without any I/O.

This module is shared by the SDK (``shinken_sync.client``) and the daemon
(``shinken_sync.daemon``). It turns Python values into WebSocket message
payloads and back, and nothing else: no sockets, no asyncio, no clocks. That
keeps the codec testable with plain byte strings and makes both peers agree
on one definition of every message. ``docs/protocol.md`` documents each
message with an example.

Message kinds
-------------
Text messages carry compact JSON objects with a ``"type"`` field:

* ``hello`` (daemon -> client, first message on every connection)
* ``call`` (client -> daemon): ``call_id``, ``verb``, ``args``
* ``reply`` (daemon -> client): ``call_id``, ``outcome`` and ``result`` or ``error``
* ``stream_end`` (daemon -> client): a screencast stream stopped

Binary messages carry images: ``u32 BE header_len | JSON header | raw bytes``.
The header is a ``reply`` (a screenshot's result) or a ``frame`` (one
screencast frame). The image bytes are never base64-encoded.

Decoding functions raise :class:`ProtocolError` on anything malformed; they
never return half-parsed data.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from . import verbs as _verbs

PROTOCOL_VERSION = 1

#: Largest WebSocket message either side accepts. A bigger message closes the
#: connection with code 1009 (message too big); see docs/protocol.md.
MAX_MESSAGE_SIZE = 16 * 2**20

#: Largest JSON header inside a binary message. Headers are a few hundred bytes;
#: the cap rejects a corrupt length before anything is sliced.
MAX_BINARY_HEADER = 64 * 2**10

_BINARY_HEADER_LEN = struct.Struct(">I")

# Outcome taxonomy, one set everywhere (replies, step rows, classify_exception).
OK = "ok"
ERROR = "error"
TIMEOUT = "timeout"
SKIPPED = "skipped"
SANDBOX_DIED = "sandbox_died"
DENIED = "denied"
CONNECTION_LOST = "connection_lost"
#: Outcomes a daemon may put on the wire. ``skipped`` and ``denied`` are
#: client-side verdicts about calls that never ran; ``connection_lost`` is the
#: client's verdict when the connection dropped and the sandbox may be alive.
WIRE_OUTCOMES = frozenset({OK, ERROR, TIMEOUT, SANDBOX_DIED})
OUTCOMES = frozenset({OK, ERROR, TIMEOUT, SKIPPED, SANDBOX_DIED, DENIED, CONNECTION_LOST})

# Machine-readable error kinds carried in ``reply.error.kind``.
ERR_BAD_REQUEST = "bad_request"  # not JSON, not an object, missing/wrong envelope field
ERR_UNKNOWN_VERB = "unknown_verb"
ERR_BAD_ARGS = "bad_args"  # a verb's argument is missing, of the wrong type or out of range
ERR_FAILED = "failed"  # the action ran and failed (e.g. file not found, xdotool error)
ERR_TIMEOUT = "timeout"  # the action's own deadline passed (exec, wait_stable, ...)
ERR_NOT_FOUND = "not_found"  # unknown screencast stream_id, missing file
ERR_UNSUPPORTED = "unsupported"  # the display backend cannot do this
ERR_INTERNAL = "internal"  # a daemon bug; the connection stays usable
ERROR_KINDS = frozenset(
    {
        ERR_BAD_REQUEST,
        ERR_UNKNOWN_VERB,
        ERR_BAD_ARGS,
        ERR_FAILED,
        ERR_TIMEOUT,
        ERR_NOT_FOUND,
        ERR_UNSUPPORTED,
        ERR_INTERNAL,
    }
)

#: The verb names a call may carry; declared in :mod:`shinken_sync.verbs`.
VERBS = frozenset(_verbs.VERBS)

IMAGE_FORMATS = frozenset({"png", "jpeg"})

CallId = int | str


class ProtocolError(ValueError):
    """A message does not follow this protocol.

    ``kind`` is one of :data:`ERROR_KINDS` (``bad_request`` unless more
    specific), so a daemon can answer with it directly.
    """

    def __init__(self, message: str, kind: str = ERR_BAD_REQUEST, call_id: CallId | None = None):
        super().__init__(message)
        self.kind = kind
        self.call_id = call_id


# ---------------------------------------------------------------------------
# Message values


@dataclass(frozen=True)
class Hello:
    protocol: int
    sandbox_id: str
    width: int
    height: int
    verbs: tuple[str, ...]
    display: str = ""


@dataclass(frozen=True)
class Call:
    call_id: CallId
    verb: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ErrorInfo:
    kind: str
    message: str


@dataclass(frozen=True)
class Reply:
    """A reply to one call. ``image`` is set for screenshot replies (binary)."""

    #: None when the daemon could not address the reply (its call had no valid call_id).
    call_id: CallId | None
    outcome: str
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    image: bytes | memoryview | None = None


@dataclass(frozen=True)
class Frame:
    """One pushed screencast frame; ``seq`` counts from 1 for the stream's life."""

    stream_id: str
    seq: int
    format: str
    width: int
    height: int
    scale: float
    x0: int
    y0: int
    ts: float
    image: bytes | memoryview
    pointer: bool = False


@dataclass(frozen=True)
class StreamEnd:
    stream_id: str
    reason: str  # "stopped" | "error" | "closed"
    last_seq: int


ServerMessage = Hello | Reply | Frame | StreamEnd


#: Longest piece of a client's input quoted back in an error message: an error
#: reply must never be bigger than what one bad value can fill.
MAX_QUOTE_CHARS = 80


# ---------------------------------------------------------------------------
# Endpoints

#: A daemon on a unix socket: ``ws+unix://<the socket's path, percent-encoded>/sb/0`` (the
#: ``http+unix`` convention of requests-unixsocket: the authority is the socket, the rest the
#: WebSocket path). Isolated sandboxes listen only there: no address on any network.
UNIX_SCHEME = "ws+unix"


def unix_url(socket_path: str, path: str = "/") -> str:
    """The URL of WebSocket ``path`` served on the unix socket ``socket_path``."""
    from urllib.parse import quote as percent

    return f"{UNIX_SCHEME}://{percent(socket_path, safe='')}{path}"


def split_unix_url(url: str) -> tuple[str, str] | None:
    """``(socket_path, ws_uri)`` for a :func:`unix_url`, None for any other URL. The URI
    (``ws://localhost/<path>``) is what the handshake names; the socket is what is dialed."""
    from urllib.parse import unquote

    prefix = f"{UNIX_SCHEME}://"
    if not url.startswith(prefix):
        return None
    authority, slash, path = url[len(prefix):].partition("/")
    socket_path = unquote(authority)
    if not socket_path:
        raise ValueError(f"{url!r} names no socket: write {UNIX_SCHEME}://<percent-encoded path>/<ws path>")
    return socket_path, f"ws://localhost/{path}" if slash else "ws://localhost/"


# ---------------------------------------------------------------------------
# Helpers


def quote(value: Any, limit: int = MAX_QUOTE_CHARS) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters.

    Strings are sliced before ``repr`` (a 10 MB value costs nothing), and the
    result is pure ASCII, so a lone surrogate is quoted as an escape and the
    error reply stays encodable whatever the client sent.
    """
    if isinstance(value, str):
        text = ascii(value[:limit])
        if len(value) <= limit and len(text) <= limit + 2:
            return text
        return f"{text[:limit]}... ({len(value)} characters)"  # escapes count: \x01 is 4
    if value is None or isinstance(value, (bool, int, float)):
        text = ascii(value)
        return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} digits)"
    return f"<{type(value).__name__}>"


def is_utf8(text: str) -> bool:
    """True unless ``text`` holds a lone surrogate (which no UTF-8 message can carry)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _NonFinite(ValueError):
    """A ``NaN``/``Infinity`` literal or a number too big for a double."""


def _refuse_constant(literal: str) -> float:
    raise _NonFinite(f"{literal} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NonFinite(f"the number {quote(literal, 24)} overflows a double")
    return value


# Python's json accepts NaN, Infinity and -Infinity (and turns 1e400 into inf);
# RFC 8259 has none of them, and one NaN deadline breaks asyncio's timer heap.
# Both peers decode with this strict decoder.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


class _Marker:
    """Stands for a non-finite literal when a refused message is re-read (error path only)."""


_LENIENT = json.JSONDecoder(parse_constant=lambda _: _Marker(), parse_float=lambda _: _Marker())


# One encoder for every message: ``json.dumps`` with non-default options builds
# a new JSONEncoder per call, measurable at thousands of calls per second.
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _loads_object(data: str | bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        obj = _DECODER.decode(text)
    except _NonFinite as exc:
        raise _non_finite_error(text, what, exc) from None
    except RecursionError:
        # The C scanner recurses once per level; ~1,000 levels exhaust the stack
        # budget. A bad request like any other, not a crashed connection.
        raise ProtocolError(f"{what} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be a JSON object, not {type(obj).__name__}")
    return obj


def _non_finite_error(text: str, what: str, exc: _NonFinite) -> ProtocolError:
    """The error for a message holding a non-finite number: addressed to its
    call_id when it has a valid one, and ``bad_args`` naming the argument when
    the number is an argument's value (or inside one)."""
    try:
        obj = _LENIENT.decode(text)
    except (ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        return ProtocolError(f"{what} holds a non-finite number: {exc}")
    call_id = obj.get("call_id")
    call_id = call_id if _valid_call_id(call_id) and _addressable(call_id) else None
    args = obj.get("args")
    if isinstance(args, dict):
        for name, value in args.items():
            inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
            if isinstance(value, _Marker) or any(isinstance(v, _Marker) for v in inner):
                return ProtocolError(f"{quote(name)} must be a finite number: {exc}", ERR_BAD_ARGS, call_id)
    return ProtocolError(f"{what} holds a non-finite number: {exc}", call_id=call_id)


def _addressable(call_id: CallId) -> bool:
    # A reply must be encodable: a lone surrogate in a call_id would make the
    # daemon's reply unsendable, so such a call is refused unaddressed.
    return not isinstance(call_id, str) or is_utf8(call_id)


def _valid_call_id(value: Any) -> TypeGuard[CallId]:
    # bool is an int subclass; a call id of true/false is almost surely a bug.
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and 0 < len(value) <= 128
    )


def _require(obj: dict[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(key)
    # bool is an int subclass; no field of this protocol is a boolean number.
    if isinstance(value, bool) or not isinstance(value, types):
        raise ProtocolError(f"{what}: field {key!r} missing or of the wrong type")
    return value


# ---------------------------------------------------------------------------
# Binary envelope


def pack_binary(header: dict[str, Any], payload: bytes | memoryview) -> bytes:
    """Build a binary message: ``u32 BE header_len | JSON header | payload``."""
    head = _dumps(header).encode()
    if len(head) > MAX_BINARY_HEADER:
        raise ProtocolError(f"binary header of {len(head)} bytes exceeds {MAX_BINARY_HEADER}")
    return b"".join((_BINARY_HEADER_LEN.pack(len(head)), head, payload))


def unpack_binary(data: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """Split a binary message into its JSON header and a zero-copy payload view."""
    view = memoryview(data)
    if len(view) < _BINARY_HEADER_LEN.size:
        raise ProtocolError("binary message shorter than its length prefix")
    (head_len,) = _BINARY_HEADER_LEN.unpack_from(view)
    if head_len > MAX_BINARY_HEADER or _BINARY_HEADER_LEN.size + head_len > len(view):
        raise ProtocolError(f"binary header length {head_len} is out of bounds")
    start = _BINARY_HEADER_LEN.size
    header = _loads_object(view[start : start + head_len], "binary header")
    return header, view[start + head_len :]


# ---------------------------------------------------------------------------
# Client -> daemon


def encode_call(call_id: CallId, verb: str, args: dict[str, Any] | None = None) -> str:
    if not _valid_call_id(call_id):
        raise ProtocolError(f"invalid call_id {call_id!r}")
    return _dumps({"type": "call", "call_id": call_id, "verb": verb, "args": args or {}})


def decode_call(data: str | bytes) -> Call:
    """Parse a call. Raises :class:`ProtocolError` carrying ``call_id`` when known,
    so the daemon can still address its error reply."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("calls are JSON text messages, not binary")
    obj = _loads_object(data, "call")
    call_id = obj.get("call_id")
    if not _valid_call_id(call_id):
        raise ProtocolError("call: field 'call_id' missing or of the wrong type")
    if not _addressable(call_id):
        raise ProtocolError("call: field 'call_id' is not valid Unicode (a lone surrogate)")
    if obj.get("type", "call") != "call":
        raise ProtocolError(f"unexpected message type {quote(obj.get('type'))}", call_id=call_id)
    verb = obj.get("verb")
    if not isinstance(verb, str):
        raise ProtocolError("call: field 'verb' missing or not a string", call_id=call_id)
    if verb not in VERBS:
        raise ProtocolError(f"unknown verb {quote(verb)}", kind=ERR_UNKNOWN_VERB, call_id=call_id)
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError("call: field 'args' must be an object", kind=ERR_BAD_ARGS, call_id=call_id)
    return Call(call_id, verb, args)


# ---------------------------------------------------------------------------
# Daemon -> client


def encode_hello(hello: Hello) -> str:
    return _dumps(
        {
            "type": "hello",
            "protocol": hello.protocol,
            "sandbox_id": hello.sandbox_id,
            "screen": {"width": hello.width, "height": hello.height},
            "verbs": sorted(hello.verbs),
            "display": hello.display,
        }
    )


def encode_reply(
    call_id: CallId,
    outcome: str = OK,
    result: dict[str, Any] | None = None,
    error: ErrorInfo | None = None,
) -> str:
    if outcome not in WIRE_OUTCOMES:
        raise ValueError(f"outcome {outcome!r} cannot be sent by a daemon")
    msg: dict[str, Any] = {"type": "reply", "call_id": call_id, "outcome": outcome}
    if error is not None:
        msg["error"] = {"kind": error.kind, "message": error.message}
    else:
        msg["result"] = result if result is not None else {}
    return _dumps(msg)


def encode_error(call_id: CallId | None, kind: str, message: str, outcome: str = ERROR) -> str:
    """An error reply. ``call_id`` may be None when the call was unparseable."""
    msg = {
        "type": "reply",
        "call_id": call_id,
        "outcome": outcome,
        "error": {"kind": kind, "message": message},
    }
    return _dumps(msg)


def encode_image_reply(call_id: CallId, result: dict[str, Any], image: bytes | memoryview) -> bytes:
    """A screenshot reply: ``result`` holds shinken_sync.verbs.IMAGE_FIELDS."""
    return pack_binary({"type": "reply", "call_id": call_id, "outcome": OK, "result": result}, image)


def encode_frame(
    stream_id: str,
    seq: int,
    meta: dict[str, Any],
    image: bytes | memoryview,
) -> bytes:
    """One screencast frame; ``meta`` holds shinken_sync.verbs.IMAGE_FIELDS and ts."""
    return pack_binary({"type": "frame", "stream_id": stream_id, "seq": seq, **meta}, image)


def encode_stream_end(stream_id: str, reason: str, last_seq: int) -> str:
    return _dumps({"type": "stream_end", "stream_id": stream_id, "reason": reason, "last_seq": last_seq})


def _decode_error(obj: dict[str, Any]) -> ErrorInfo:
    err = obj.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("kind"), str):
        raise ProtocolError("reply: field 'error' must be an object with a 'kind'")
    return ErrorInfo(err["kind"], str(err.get("message", "")))


def _decode_reply(obj: dict[str, Any], image: memoryview | None) -> Reply:
    call_id = obj.get("call_id")
    if call_id is not None and not _valid_call_id(call_id):
        raise ProtocolError("reply: field 'call_id' of the wrong type")
    outcome = obj.get("outcome")
    if outcome not in WIRE_OUTCOMES:
        raise ProtocolError(f"reply: unknown outcome {quote(outcome)}")
    if "error" in obj:
        return Reply(call_id, outcome, error=_decode_error(obj))
    result = obj.get("result", {})
    if not isinstance(result, dict):
        raise ProtocolError("reply: field 'result' must be an object")
    return Reply(call_id, outcome, result=result, image=image)


def _image_meta(obj: dict[str, Any], what: str) -> dict[str, Any]:
    fmt = obj.get("format")
    if fmt not in IMAGE_FORMATS:
        raise ProtocolError(f"{what}: unknown image format {quote(fmt)}")
    width = _require(obj, "width", int, what)
    height = _require(obj, "height", int, what)
    scale = _require(obj, "scale", (int, float), what)
    return {
        "format": fmt,
        "width": width,
        "height": height,
        "scale": float(scale),
        "x0": int(obj.get("x0", 0)),
        "y0": int(obj.get("y0", 0)),
        "pointer": obj.get("pointer") is True,
    }


def decode_server_message(data: str | bytes | memoryview) -> ServerMessage:
    """Parse any daemon -> client message (text or binary)."""
    if isinstance(data, str):
        obj = _loads_object(data, "message")
        kind = obj.get("type")
        if kind == "reply":
            return _decode_reply(obj, None)
        if kind == "hello":
            screen = obj.get("screen")
            if not isinstance(screen, dict):
                raise ProtocolError("hello: field 'screen' must be an object")
            verbs = obj.get("verbs", [])
            if not isinstance(verbs, list):
                raise ProtocolError("hello: field 'verbs' must be a list")
            return Hello(
                protocol=_require(obj, "protocol", int, "hello"),
                sandbox_id=str(obj.get("sandbox_id", "")),
                width=_require(screen, "width", int, "hello.screen"),
                height=_require(screen, "height", int, "hello.screen"),
                verbs=tuple(str(v) for v in verbs),
                display=str(obj.get("display", "")),
            )
        if kind == "stream_end":
            return StreamEnd(
                stream_id=_require(obj, "stream_id", str, "stream_end"),
                reason=str(obj.get("reason", "stopped")),
                last_seq=int(obj.get("last_seq", 0)),
            )
        raise ProtocolError(f"unknown message type {quote(kind)}")

    header, payload = unpack_binary(data)
    kind = header.get("type")
    if kind == "reply":
        reply = _decode_reply(header, payload)
        if reply.error is None:
            _image_meta(reply.result or {}, "image reply")
        return reply
    if kind == "frame":
        meta = _image_meta(header, "frame")
        return Frame(
            stream_id=_require(header, "stream_id", str, "frame"),
            seq=_require(header, "seq", int, "frame"),
            ts=float(header.get("ts", 0.0)),
            image=payload,
            **meta,
        )
    raise ProtocolError(f"unknown binary message type {quote(kind)}")
