"""Which WebSocket client the async core dials with, and which loop a SharedLoop runs.

Two transports with one contract (connect options, ``send``/``recv``/``close``,
``close_code``/``close_reason``, keepalive, exceptions mapped onto the same
SDK errors):

* ``websockets`` -- the ``websockets`` library (a hard dependency), pure
  Python framing on asyncio's selector loop.
* ``fast`` -- the ``[fast]`` extra: ``picows``' websockets-compatible client
  (Cython framing; the payload is parsed straight out of the receive buffer),
  and ``uvloop`` for a SharedLoop's own loop. Measured in bench/fleet.py
  (docs/fleet-gates.md).

The choice is :data:`TRANSPORT`, read at every ``connect``/``aconnect``
(default from the ``SHINKEN_TRANSPORT`` environment variable, else
``auto``): ``auto`` takes ``fast`` when picows is importable, ``websockets``
otherwise; ``fast`` insists (ImportError naming the extra when it is not
installed); ``websockets`` never uses the extra. A connection keeps the
transport it was dialed with.

uvloop is used for a SharedLoop's loop only when ``fast`` is chosen and the
process is not gevent-patched: under patching, the loop thread's executor
(liveness probes, DNS) runs on gevent's threadpool machinery through the
hub-bound selector, which a libuv loop never drives. There the SharedLoop
keeps gevent's selector loop, and picows runs on it (picows needs only an
asyncio loop). The async face runs on whatever loop the caller made.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TRANSPORT", "Transport", "abort", "choose", "connection_closed_types", "fast_available"]

AUTO, WEBSOCKETS, FAST = "auto", "websockets", "fast"

TRANSPORT_ENV = "SHINKEN_TRANSPORT"
#: ``auto`` | ``websockets`` | ``fast``; read at every connect.
TRANSPORT: str = os.environ.get(TRANSPORT_ENV, AUTO)


#: A received data frame at least this large is released as soon as its message
#: was handed over (see :func:`_release_websockets_frame`).
RELEASE_FRAME_BYTES = 16 * 1024


def _no_release(ws: Any) -> None:
    return None


def _release_websockets_frame(ws: Any) -> None:
    """Free the payload of the last frame websockets parsed, once its message is out.

    websockets' frame parser is a generator whose local ``frame`` keeps the
    last parsed frame until the next one arrives: on a connection that just
    carried a ~72 KiB observation and then sits idle, that is ~72 KiB per
    sandbox held for nothing (its message was already copied out). When the
    assembler holds no frame (so the parser's last frame was consumed), the
    frame's payload bytearray is emptied in place. Reaches into websockets'
    internals read-only (the generator's locals) and does nothing when they
    are not as expected; ``tests/sdk/test_transport.py`` fails if a
    websockets upgrade makes this stop releasing.
    """
    try:
        if len(ws.recv_messages.frames):  # a parsed frame still waits to be read: not ours to touch
            return
        gen = ws.protocol.parser
        while gen is not None:
            frame_locals = gen.gi_frame.f_locals if gen.gi_frame is not None else {}
            frame = frame_locals.get("frame")
            if frame is not None:
                data = frame.data
                if isinstance(data, bytearray) and len(data) >= RELEASE_FRAME_BYTES:
                    del data[:]
                return
            gen = gen.gi_yieldfrom
    except AttributeError:  # another websockets version's layout: keep its default behaviour
        return


@dataclass(frozen=True)
class Transport:
    """One WebSocket client library, as the async core uses it."""

    name: str
    connect: Callable[..., Any]
    #: raised by ``send``/``recv``/iteration once the connection is closed
    connection_closed: tuple[type[BaseException], ...]
    #: a handshake answered with an HTTP status; ``exc.response.status_code``
    invalid_status: type[BaseException]
    #: everything else the handshake can raise that means "could not connect"
    handshake_errors: tuple[type[BaseException], ...]
    #: called after a large message was dispatched: drop what the library still holds of it
    release_message: Callable[[Any], None] = _no_release
    #: called once a connection is open, on its loop: bound the parsing per loop turn
    #: (:mod:`shinken_sync.readpacing`; picows parses in C and is left as it is)
    pace_reading: Callable[[Any], None] = _no_release
    #: ``(socket_path, uri, **options)``: dial a ``ws+unix://`` endpoint; None when the
    #: library dials TCP only (then ``choose`` answers websockets for such URLs)
    connect_unix: Callable[..., Any] | None = None


def fast_available() -> bool:
    return importlib.util.find_spec("picows") is not None


def _websockets() -> Transport:
    from websockets.asyncio.client import connect, unix_connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

    from .readpacing import pace

    dial: Callable[..., Any] = connect
    if "proxy" not in inspect.signature(connect.__init__).parameters:
        # websockets 14 (setup.py allows it) has no proxy support, so nothing to turn off, and
        # it hands options it does not know to loop.create_connection: ``proxy=None`` there
        # was a TypeError on every TCP dial.
        dial = functools.partial(_without_proxy, connect)
    return Transport(
        WEBSOCKETS, dial, (ConnectionClosed,), InvalidStatus, (InvalidHandshake, InvalidURI),
        _release_websockets_frame, pace, unix_connect,
    )  # fmt: skip


def _without_proxy(connect: Callable[..., Any], uri: str, **options: Any) -> Any:
    options.pop("proxy", None)
    return connect(uri, **options)


def _fast() -> Transport:
    try:
        from picows.websockets import connect
        from picows.websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
    except ImportError as exc:
        raise ImportError(
            "SHINKEN_TRANSPORT=fast needs the [fast] extra: pip install 'shinken[fast]' (picows, uvloop)"
        ) from exc
    return Transport(FAST, connect, (ConnectionClosed,), InvalidStatus, (InvalidHandshake, InvalidURI))


_cache: dict[str, Transport] = {}


def choose(setting: str | None = None, *, unix: bool = False) -> Transport:
    """The transport ``setting`` (default :data:`TRANSPORT`) names. ``unix``: for a
    ``ws+unix://`` endpoint, which picows does not dial: websockets then, whatever the
    setting (an isolated sandbox's socket carries no WAN latency for picows to save)."""
    setting = TRANSPORT if setting is None else setting
    if unix:
        setting = WEBSOCKETS
    if setting == AUTO:
        setting = FAST if fast_available() else WEBSOCKETS
    if setting not in (WEBSOCKETS, FAST):
        raise ValueError(f"SHINKEN_TRANSPORT must be auto, websockets or fast, not {setting!r}")
    transport = _cache.get(setting)
    if transport is None:
        transport = _cache[setting] = _websockets() if setting == WEBSOCKETS else _fast()
    return transport


def connection_closed_types() -> tuple[type[BaseException], ...]:
    """The ConnectionClosed classes of every transport loaded in this process."""
    types: list[type[BaseException]] = []
    for module, name in (("websockets.exceptions", "ConnectionClosed"),
                         ("picows.websockets.exceptions", "ConnectionClosed")):  # fmt: skip
        loaded = sys.modules.get(module)
        if loaded is not None:
            types.append(getattr(loaded, name))
    return tuple(types)


def uses_uvloop() -> bool:
    """Whether a SharedLoop started now runs on uvloop (see the module docstring)."""
    setting = TRANSPORT if TRANSPORT != AUTO else (FAST if fast_available() else WEBSOCKETS)
    if setting != FAST or importlib.util.find_spec("uvloop") is None:
        return False
    monkey = sys.modules.get("gevent.monkey")
    return not (monkey is not None and monkey.is_module_patched("threading"))


def abort(ws: Any) -> None:
    """Drop a connection without a closing handshake (a TCP reset), whatever its
    transport: the stand-in for a network failure in drills and tests."""
    transport = getattr(ws, "transport", None)
    if transport is None:  # picows keeps its WSTransport in a C field, reachable only this way
        transport = next(r for r in gc.get_referents(ws) if hasattr(r, "underlying_transport"))
    getattr(transport, "underlying_transport", transport).abort()
