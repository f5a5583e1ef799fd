"""Constructors for the plain action dicts that ``step`` and ``act_batch`` take.

An action is a JSON-ready dict: ``{"verb": "click", "x": 10, "y": 20}``. The
keys are the verb's argument names exactly as the verb table declares them
(``shinken_sync.verbs``; ``daemon.args`` validates them), so hand-written
dicts and these helpers are interchangeable; ``AsyncSandbox``'s per-verb methods build their calls here
too. Arguments left at None are omitted and the daemon applies its default.
``bytes`` values (``write_file`` data, ``exec`` stdin) may stay bytes: the
client base64-encodes them when it sends the call.

Durations follow the wire: milliseconds, in ``*_ms`` arguments.
"""

from __future__ import annotations

from typing import Any

from .verbs import DEFAULT_IMAGE_FORMAT, DEFAULT_IMAGE_QUALITY

Action = dict[str, Any]


def _action(verb: str, **args: Any) -> Action:
    return {"verb": verb, **{name: value for name, value in args.items() if value is not None}}


def screenshot(
    format: str = DEFAULT_IMAGE_FORMAT,
    quality: int = DEFAULT_IMAGE_QUALITY,
    max_long_edge: int | None = None,
    region: tuple[int, int, int, int] | None = None,
) -> Action:
    """``region`` is ``(x, y, width, height)`` in screen pixels."""
    return _action(
        "screenshot",
        format=format,
        quality=quality,
        max_long_edge=max_long_edge,
        region=list(region) if region is not None else None,
    )


def click(x: int, y: int, button: str = "left", count: int = 1) -> Action:
    return _action("click", x=x, y=y, button=button, count=count)


def move(x: int, y: int) -> Action:
    return _action("move", x=x, y=y)


def drag(x0: int, y0: int, x1: int, y1: int, button: str = "left") -> Action:
    return _action("drag", x0=x0, y0=y0, x1=x1, y1=y1, button=button)


def scroll(dx: int = 0, dy: int = 0, x: int | None = None, y: int | None = None) -> Action:
    """Wheel clicks: ``dy > 0`` scrolls down, ``dx > 0`` right; at (x, y) when given."""
    return _action("scroll", dx=dx, dy=dy, x=x, y=y)


def type(text: str) -> Action:
    return _action("type", text=text)


def key(combo: str) -> Action:
    """A key or combination: ``"Return"``, ``"ctrl+shift+t"``."""
    return _action("key", combo=combo)


def wait(ms: int) -> Action:
    return _action("wait", ms=ms)


def wait_stable(stable_ms: int | None = None, timeout_ms: int | None = None) -> Action:
    """Return once the screen has not changed for ``stable_ms`` (or fail at ``timeout_ms``)."""
    return _action("wait_stable", stable_ms=stable_ms, timeout_ms=timeout_ms)


def wait_change(timeout_ms: int | None = None) -> Action:
    """Return at the first screen change (or fail at ``timeout_ms``)."""
    return _action("wait_change", timeout_ms=timeout_ms)


def cursor() -> Action:
    return _action("cursor")


def screen_size() -> Action:
    return _action("screen_size")


def exec(
    cmd: str,
    timeout_ms: int | None = None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    max_output: int | None = None,
    encoding: str | None = None,
) -> Action:
    """A shell command. ``encoding="base64"`` returns stdout/stderr as bytes."""
    return _action(
        "exec",
        cmd=cmd,
        timeout_ms=timeout_ms,
        cwd=cwd,
        env=env,
        stdin=stdin,
        max_output=max_output,
        encoding=encoding,
    )


def launch(app: str, args: list[str] | None = None, timeout_ms: int | None = None) -> Action:
    """Open a desktop app (``browser``, ``terminal``, ``editor``) with extra arguments (URLs,
    files); the reply comes once its window is up and focused: ``{app, pid, window}``."""
    return _action("launch", app=app, args=args, timeout_ms=timeout_ms)


def read_file(path: str, offset: int | None = None, max_bytes: int | None = None) -> Action:
    return _action("read_file", path=path, offset=offset, max_bytes=max_bytes)


def write_file(
    path: str,
    data: bytes,
    append: bool | None = None,
    make_dirs: bool | None = None,
    mode: int | None = None,
) -> Action:
    return _action("write_file", path=path, data=data, append=append, make_dirs=make_dirs, mode=mode)
