"""Dispatch: one call in, one encoded reply out.

:func:`execute` validates the call's arguments (:mod:`.args`), runs the verb
against the sandbox and encodes the reply. It never raises for anything a
client did: bad arguments, a failing action, an expired deadline or a daemon
bug each become an error reply on the same connection (see :mod:`.errors`).
Every reply fits one message: one that would exceed ``MAX_MESSAGE_SIZE`` once
encoded is replaced by an error reply saying so (the verbs' own caps keep
their replies below it; this is the backstop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shinken_sync.protocol import (
    ERR_FAILED,
    ERR_INTERNAL,
    MAX_MESSAGE_SIZE,
    Call,
    encode_error,
    encode_image_reply,
    encode_reply,
    quote,
)
from shinken_sync.verbs import check_names

from .args import STREAM_PARAMS, Screen, validate
from .deadline import within
from .display.base import Display, DisplayError, EncodedImage
from .errors import VerbError, VerbTimeout
from .outbox import Outbox
from .screencast import StreamRegistry
from .shell import Shell, read_file, write_file

log = logging.getLogger("shinkend.verbs")
T = TypeVar("T")

#: Deadline for one display action (input or capture). A display that hangs
#: longer is reported as a timeout; the connection carries on.
DISPLAY_CALL_TIMEOUT_S = 30.0
TYPE_TIMEOUT_PER_CHAR_S = 0.05
#: How often wait_change / wait_stable look at the screen. Cheap on the virtual
#: display; about one capture + digest per poll on Xvfb.
POLL_INTERVAL_S = 0.05
MIN_POLL_INTERVAL_S = 0.01
#: Characters of an unexpected exception's text put in an ``internal`` reply.
MAX_INTERNAL_MESSAGE = 500

#: The threads file verbs block in. Their own pool: a file that stalls its
#: reader (a network mount) can exhaust it, but never the threads that encode
#: screenshots (imaging.ENCODE_POOL) nor asyncio's default executor.
FILE_THREADS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="shinkend-files")


@dataclass
class SandboxState:
    """Everything one sandbox owns inside the daemon. (Not the SDK's
    ``shinken_sync.Sandbox``, the client's handle on a sandbox.)"""

    sandbox_id: str
    display: Display
    streams: StreamRegistry
    shell: Shell = field(default_factory=Shell)

    @property
    def screen(self) -> Screen:
        return Screen(self.display.width, self.display.height)

    async def close(self) -> None:
        self.streams.close()
        self.shell.close()
        await self.display.close()


Handler = Callable[[SandboxState, Outbox, dict[str, Any]], Awaitable["dict[str, Any] | EncodedImage"]]


async def execute(sandbox: SandboxState, outbox: Outbox, call: Call) -> str | bytes:
    """Run one call and return its encoded reply (text, or binary for an image)."""
    reply = await _execute(sandbox, outbox, call)
    try:
        # str.isascii() is O(1): only non-ASCII text replies pay for an encode.
        size = len(reply) if isinstance(reply, bytes) or reply.isascii() else len(reply.encode())
    except UnicodeEncodeError:  # a lone surrogate slipped into a result: a daemon bug, not a dead socket
        log.error("%s (call %s): the reply is not valid Unicode", call.verb, quote(call.call_id))
        return encode_error(call.call_id, ERR_INTERNAL, "the reply held a lone surrogate and could not be sent")
    if size > MAX_MESSAGE_SIZE:
        log.warning("%s (call %s): a %d-byte reply was replaced by an error", call.verb, quote(call.call_id), size)
        return encode_error(
            call.call_id, ERR_FAILED, f"the reply would be {size} bytes, over the {MAX_MESSAGE_SIZE}-byte message limit"
        )
    return reply


async def _execute(sandbox: SandboxState, outbox: Outbox, call: Call) -> str | bytes:
    try:
        params = validate(call.verb, call.args, sandbox.screen)
        result = await HANDLERS[call.verb](sandbox, outbox, params)
    except VerbError as exc:
        return encode_error(call.call_id, exc.kind, str(exc), exc.outcome)
    except DisplayError as exc:
        return encode_error(call.call_id, exc.kind, str(exc))
    except Exception as exc:
        log.exception("%s (call %s) failed inside the daemon", call.verb, quote(call.call_id))
        text = f"{type(exc).__name__}: {exc}"
        return encode_error(call.call_id, ERR_INTERNAL, ascii(text[:MAX_INTERNAL_MESSAGE])[1:-1])
    if isinstance(result, EncodedImage):
        return encode_image_reply(call.call_id, result.meta(), result.data)
    return encode_reply(call.call_id, result=result)


async def _on_display(action: Awaitable[T], what: str, timeout: float | None = None) -> T:
    timeout = DISPLAY_CALL_TIMEOUT_S if timeout is None else timeout
    try:
        return await within(action, timeout)
    except asyncio.TimeoutError:  # noqa: UP041 (not TimeoutError on 3.10)
        raise VerbTimeout(f"{what} took longer than {timeout:.0f} s") from None


# ---------------------------------------------------------------------------
# Handlers: (sandbox, outbox, validated params) -> result dict or EncodedImage


async def _screenshot(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> EncodedImage:
    return await _on_display(sb.display.screenshot(**p), "screenshot")


async def _click(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    await _on_display(sb.display.click(p["x"], p["y"], p["button"], p["count"]), "click")
    return {}


async def _move(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    await _on_display(sb.display.move(p["x"], p["y"]), "move")
    return {}


async def _drag(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    await _on_display(sb.display.drag(p["x0"], p["y0"], p["x1"], p["y1"], p["button"]), "drag")
    return {}


async def _scroll(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    await _on_display(sb.display.scroll(p["dx"], p["dy"], p["x"], p["y"]), "scroll")
    return {}


async def _type(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    # Real keyboards type a character every ~10 ms; long texts get the time they need.
    timeout = DISPLAY_CALL_TIMEOUT_S + len(p["text"]) * TYPE_TIMEOUT_PER_CHAR_S
    await _on_display(sb.display.type_text(p["text"]), "type", timeout)
    return {}


async def _key(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    await _on_display(sb.display.key(p["combo"]), "key")
    return {}


async def _cursor(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    x, y = await _on_display(sb.display.cursor(), "cursor")
    return {"x": x, "y": y}


async def _screen_size(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    return {"width": sb.display.width, "height": sb.display.height}


async def _wait(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(p["ms"] / 1000)
    return {"waited_ms": p["ms"]}


async def _token(sb: SandboxState) -> Hashable:
    return await _on_display(sb.display.change_token(), "change_token")


async def _wait_change(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + p["timeout_ms"] / 1000
    first = await _token(sb)
    while loop.time() < deadline:
        await asyncio.sleep(min(POLL_INTERVAL_S, max(0.0, deadline - loop.time())))
        if await _token(sb) != first:
            return {"changed": True, "waited_ms": _ms_since(loop, start)}
    raise VerbTimeout(f"the screen did not change within {p['timeout_ms']} ms")


async def _wait_stable(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    stable_s = p["stable_ms"] / 1000
    deadline = start + p["timeout_ms"] / 1000
    interval = max(MIN_POLL_INTERVAL_S, min(POLL_INTERVAL_S, stable_s / 4))
    last, since = await _token(sb), start
    while True:
        now = loop.time()
        if now - since >= stable_s:
            return {"stable": True, "waited_ms": _ms_since(loop, start)}
        if now >= deadline:
            raise VerbTimeout(f"the screen kept changing for {p['timeout_ms']} ms")
        await asyncio.sleep(min(interval, max(0.0, deadline - now), max(0.0, since + stable_s - now)))
        token = await _token(sb)
        if token != last:
            last, since = token, loop.time()


def _ms_since(loop: asyncio.AbstractEventLoop, start: float) -> float:
    return round((loop.time() - start) * 1000, 1)


async def _exec(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    return await sb.shell.exec(p)


async def _launch(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    timeout = p["timeout_ms"] / 1000
    # The display gives up at the timeout with the app's log tail; this bound is the backstop.
    return await _on_display(sb.display.launch(p["app"], p["args"], timeout), "launch", timeout + 5.0)


async def _read_file(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    return await asyncio.get_running_loop().run_in_executor(FILE_THREADS, read_file, p)


async def _write_file(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    return await asyncio.get_running_loop().run_in_executor(FILE_THREADS, write_file, p)


async def _screencast_start(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    return sb.streams.start(outbox, p)


async def _screencast_stop(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    return sb.streams.stop(p["stream_id"])


async def _resume_screencast(sb: SandboxState, outbox: Outbox, p: dict[str, Any]) -> dict[str, Any]:
    return sb.streams.resume(outbox, p["stream_id"], {k: p[k] for k in STREAM_PARAMS})


HANDLERS: dict[str, Handler] = {
    "screenshot": _screenshot,
    "click": _click,
    "move": _move,
    "drag": _drag,
    "scroll": _scroll,
    "type": _type,
    "key": _key,
    "wait": _wait,
    "wait_stable": _wait_stable,
    "wait_change": _wait_change,
    "cursor": _cursor,
    "screen_size": _screen_size,
    "exec": _exec,
    "launch": _launch,
    "read_file": _read_file,
    "write_file": _write_file,
    "screencast_start": _screencast_start,
    "screencast_stop": _screencast_stop,
    "resume_screencast": _resume_screencast,
}
check_names("daemon.verbs.HANDLERS", HANDLERS)
