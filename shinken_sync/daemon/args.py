"""Validation of every verb's arguments, without any I/O.

:func:`validate` checks a call's ``args`` object against the verb's table in
:data:`SPECS` and returns a plain dict with defaults filled in, or raises
:class:`~shinken_sync.daemon.errors.BadArgs` naming the offending argument.
Unknown argument names are refused too, so a typo (``timout_ms``) is an error
instead of a silently ignored option. Coordinates are checked against the
screen, so a display backend only ever sees on-screen points.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from shinken_sync.protocol import IMAGE_FORMATS, is_utf8, quote
from shinken_sync.verbs import (
    DEFAULT_EXEC_TIMEOUT_MS,
    DEFAULT_IMAGE_FORMAT,
    DEFAULT_IMAGE_QUALITY,
    DEFAULT_LAUNCH_TIMEOUT_MS,
    DEFAULT_SCREENCAST_FPS,
    DEFAULT_WAIT_TIMEOUT_MS,
    VERBS,
    check_names,
)

from .errors import BadArgs

# Limits, each checked before the work (or the allocation) it bounds.
MAX_WAIT_MS = 60_000  # wait
MAX_WAIT_TIMEOUT_MS = 120_000  # wait_stable / wait_change
MAX_EXEC_TIMEOUT_MS = 600_000
#: Per stream (stdout, stderr). Two base64-encoded 4 MiB captures still fit one
#: 16 MiB message.
MAX_EXEC_OUTPUT = 4 * 2**20
DEFAULT_EXEC_OUTPUT = 1 * 2**20
MAX_EXEC_STDIN = 4 * 2**20
#: read_file / write_file payload; base64 of 8 MiB (10.7 MB) fits one message.
MAX_FILE_BYTES = 8 * 2**20
MAX_PATH_CHARS = 4096
MAX_TYPE_CHARS = 65_536
MAX_KEY_CHARS = 128
MAX_CLICK_COUNT = 10
MAX_SCROLL_CLICKS = 100
MAX_FPS = 30.0
MAX_LONG_EDGE = 16_384
MIN_LONG_EDGE = 16
MAX_ENV_VARS = 256
MAX_LAUNCH_ARGS = 64
MAX_LAUNCH_ARG_CHARS = 8192
MAX_LAUNCH_TIMEOUT_MS = 120_000
BUTTONS = ("left", "middle", "right")
OUTPUT_ENCODINGS = ("utf-8", "base64")

_REQUIRED = object()


@dataclass(frozen=True)
class Screen:
    width: int
    height: int


_T = TypeVar("_T")

# A checker gets (name, value, screen) and returns the normalised value (of type _T).
CheckerOf = Callable[[str, Any, Screen], _T]
Checker = CheckerOf[Any]


@dataclass(frozen=True)
class Arg:
    check: Checker
    default: Any = _REQUIRED


def _int(lo: int, hi: int) -> CheckerOf[int]:
    def check(name: str, value: Any, screen: Screen) -> int:
        # JSON has one number type; 3.0 is an integer, 3.5 and true are not.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadArgs(f"{name} must be an integer, not {type(value).__name__}")
        if not lo <= value <= hi:
            raise BadArgs(f"{name}={quote(value)} is out of range [{lo}, {hi}]")
        return value

    return check


def _number(lo: float, hi: float, *, exclusive_lo: bool = False) -> CheckerOf[float]:
    def check(name: str, value: Any, screen: Screen) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadArgs(f"{name} must be a number, not {type(value).__name__}")
        # NaN passes every range check (all comparisons are false) and, as a
        # deadline, breaks asyncio's timer heap for the whole daemon.
        if isinstance(value, float) and not math.isfinite(value):
            raise BadArgs(f"{name} must be a finite number, not {value}")
        if value > hi or value < lo or (exclusive_lo and value == lo):
            raise BadArgs(f"{name}={value} is out of range {'(' if exclusive_lo else '['}{lo}, {hi}]")
        return float(value)

    return check


def _coord(axis: str) -> CheckerOf[int]:
    def check(name: str, value: Any, screen: Screen) -> int:
        limit = screen.width if axis == "x" else screen.height
        return _int(0, limit - 1)(name, value, screen)

    return check


def _str(max_len: int, *, nonempty: bool = True) -> CheckerOf[str]:
    def check(name: str, value: Any, screen: Screen) -> str:
        if not isinstance(value, str):
            raise BadArgs(f"{name} must be a string, not {type(value).__name__}")
        if nonempty and not value:
            raise BadArgs(f"{name} must not be empty")
        if len(value) > max_len:
            raise BadArgs(f"{name} is {len(value)} characters long; the limit is {max_len}")
        # Every string reaches a syscall, a subprocess or a reply: NUL cannot pass
        # through any of them, a lone surrogate cannot be encoded by any.
        if "\x00" in value:
            raise BadArgs(f"{name} must not contain NUL")
        if not is_utf8(value):
            raise BadArgs(f"{name} is not valid Unicode (it holds a lone surrogate)")
        return value

    return check


_path = _str(MAX_PATH_CHARS)


def _choice(options: tuple[str, ...] | frozenset[str]) -> CheckerOf[str]:
    def check(name: str, value: Any, screen: Screen) -> str:
        if not isinstance(value, str) or value not in options:
            raise BadArgs(f"{name} must be one of {sorted(options)}, not {quote(value)}")
        return value

    return check


def _bool(name: str, value: Any, screen: Screen) -> bool:
    if not isinstance(value, bool):
        raise BadArgs(f"{name} must be true or false, not {type(value).__name__}")
    return value


def _optional(inner: Checker) -> Checker:
    def check(name: str, value: Any, screen: Screen) -> Any:
        return None if value is None else inner(name, value, screen)

    return check


def _region(name: str, value: Any, screen: Screen) -> tuple[int, int, int, int]:
    if not isinstance(value, list) or len(value) != 4:
        raise BadArgs(f"{name} must be a list [x, y, width, height]")
    x = _coord("x")(f"{name}[0]", value[0], screen)
    y = _coord("y")(f"{name}[1]", value[1], screen)
    w = _int(1, screen.width - x)(f"{name}[2]", value[2], screen)
    h = _int(1, screen.height - y)(f"{name}[3]", value[3], screen)
    return (x, y, w, h)


def _key_combo(name: str, value: Any, screen: Screen) -> str:
    combo = _str(MAX_KEY_CHARS)(name, value, screen)
    # "+" alone is the plus key; otherwise every part of a combo names a key.
    if combo != "+" and any(not part.strip() for part in combo.split("+")):
        raise BadArgs(f"{name}={quote(combo)} has an empty key name (write combos like 'ctrl+shift+t')")
    return combo


def _base64(max_bytes: int) -> CheckerOf[bytes]:
    max_chars = (max_bytes + 2) // 3 * 4

    def check(name: str, value: Any, screen: Screen) -> bytes:
        if not isinstance(value, str):
            raise BadArgs(f"{name} must be a base64 string, not {type(value).__name__}")
        if len(value) > max_chars:
            raise BadArgs(f"{name} decodes to more than {max_bytes} bytes")
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadArgs(f"{name} is not valid base64: {exc}") from None

    return check


def _env(name: str, value: Any, screen: Screen) -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > MAX_ENV_VARS:
        raise BadArgs(f"{name} must be an object of at most {MAX_ENV_VARS} string values")
    for key, item in value.items():
        if (not key or "=" in key or "\x00" in key or not is_utf8(key) or not isinstance(item, str)
                or "\x00" in item or not is_utf8(item)):  # fmt: skip
            raise BadArgs(f"{name}[{quote(key)}] must be a string without NUL, keyed by a valid name")
    return dict(value)


def _str_list(max_items: int, max_len: int) -> CheckerOf[list[str]]:
    item = _str(max_len, nonempty=False)

    def check(name: str, value: Any, screen: Screen) -> list[str]:
        if not isinstance(value, list) or len(value) > max_items:
            raise BadArgs(f"{name} must be a list of at most {max_items} strings")
        return [item(f"{name}[{i}]", v, screen) for i, v in enumerate(value)]

    return check


_X, _Y = Arg(_coord("x")), Arg(_coord("y"))
_BUTTON = Arg(_choice(BUTTONS), "left")
_IMAGE = {
    "format": Arg(_choice(IMAGE_FORMATS), DEFAULT_IMAGE_FORMAT),
    "quality": Arg(_int(1, 100), DEFAULT_IMAGE_QUALITY),
    "max_long_edge": Arg(_optional(_int(MIN_LONG_EDGE, MAX_LONG_EDGE)), None),
}
_STREAM = {**_IMAGE, "fps": Arg(_number(0.0, MAX_FPS, exclusive_lo=True), DEFAULT_SCREENCAST_FPS)}

#: verb -> {argument name -> Arg}: exactly the verbs and argument names of
#: shinken_sync.verbs (checked below), with their checks and defaults.
SPECS: dict[str, dict[str, Arg]] = {
    "screenshot": {**_IMAGE, "region": Arg(_optional(_region), None)},
    "click": {"x": _X, "y": _Y, "button": _BUTTON, "count": Arg(_int(1, MAX_CLICK_COUNT), 1)},
    "move": {"x": _X, "y": _Y},
    "drag": {"x0": _X, "y0": _Y, "x1": _X, "y1": _Y, "button": _BUTTON},
    "scroll": {
        "dx": Arg(_int(-MAX_SCROLL_CLICKS, MAX_SCROLL_CLICKS), 0),
        "dy": Arg(_int(-MAX_SCROLL_CLICKS, MAX_SCROLL_CLICKS), 0),
        "x": Arg(_optional(_coord("x")), None),
        "y": Arg(_optional(_coord("y")), None),
    },
    "type": {"text": Arg(_str(MAX_TYPE_CHARS, nonempty=False))},
    "key": {"combo": Arg(_key_combo)},
    "wait": {"ms": Arg(_int(0, MAX_WAIT_MS))},
    "wait_stable": {
        "stable_ms": Arg(_int(1, MAX_WAIT_TIMEOUT_MS), 500),
        "timeout_ms": Arg(_int(1, MAX_WAIT_TIMEOUT_MS), DEFAULT_WAIT_TIMEOUT_MS),
    },
    "wait_change": {"timeout_ms": Arg(_int(1, MAX_WAIT_TIMEOUT_MS), DEFAULT_WAIT_TIMEOUT_MS)},
    "cursor": {},
    "screen_size": {},
    "exec": {
        "cmd": Arg(_str(256 * 2**10)),
        "timeout_ms": Arg(_int(1, MAX_EXEC_TIMEOUT_MS), DEFAULT_EXEC_TIMEOUT_MS),
        "cwd": Arg(_optional(_path), None),
        "env": Arg(_optional(_env), None),
        "stdin": Arg(_optional(_base64(MAX_EXEC_STDIN)), None),
        "max_output": Arg(_int(0, MAX_EXEC_OUTPUT), DEFAULT_EXEC_OUTPUT),
        "encoding": Arg(_choice(OUTPUT_ENCODINGS), "utf-8"),
    },
    "launch": {
        # Which names exist is the display's business (a desktop's app table): an
        # unknown one is a bad_args reply from there.
        "app": Arg(_str(64)),
        "args": Arg(_str_list(MAX_LAUNCH_ARGS, MAX_LAUNCH_ARG_CHARS), []),
        "timeout_ms": Arg(_int(1, MAX_LAUNCH_TIMEOUT_MS), DEFAULT_LAUNCH_TIMEOUT_MS),
    },
    "read_file": {
        "path": Arg(_path),
        "offset": Arg(_int(0, 2**62), 0),
        "max_bytes": Arg(_int(0, MAX_FILE_BYTES), MAX_FILE_BYTES),
    },
    "write_file": {
        "path": Arg(_path),
        "data": Arg(_base64(MAX_FILE_BYTES)),
        "append": Arg(_bool, False),
        "make_dirs": Arg(_bool, False),
        "mode": Arg(_optional(_int(0, 0o7777)), None),
    },
    "screencast_start": _STREAM,
    "screencast_stop": {"stream_id": Arg(_str(128))},
    # Stream parameters may be given flat or nested under "params"; omitted
    # ones keep the stream's current value (hence no defaults here).
    "resume_screencast": {
        "stream_id": Arg(_str(128)),
        **{name: Arg(_optional(arg.check), None) for name, arg in _STREAM.items()},
    },
}

check_names("daemon.args.SPECS", SPECS)
for _name, _spec in SPECS.items():
    if set(_spec) != set(VERBS[_name].args):
        raise AssertionError(f"daemon.args.SPECS[{_name!r}] arguments differ from shinken_sync.verbs")

#: Stream parameters resume_screencast accepts (flat or under "params").
STREAM_PARAMS = tuple(_STREAM)


def validate(verb: str, args: dict[str, Any], screen: Screen) -> dict[str, Any]:
    """Return ``args`` checked and completed with defaults, or raise BadArgs."""
    spec = SPECS[verb]
    if verb == "resume_screencast" and "params" in args:
        args = _flatten_params(args)
    unknown = sorted(set(args) - set(spec))
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise BadArgs(f"{verb}: unknown argument(s) {', '.join(map(quote, unknown[:3]))}{more}")
    out: dict[str, Any] = {}
    for name, arg in spec.items():
        if name in args:
            out[name] = arg.check(name, args[name], screen)
        elif arg.default is _REQUIRED:
            raise BadArgs(f"{verb}: missing required argument {name!r}")
        else:
            out[name] = arg.default
    return out


def _flatten_params(args: dict[str, Any]) -> dict[str, Any]:
    params = args["params"]
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadArgs("resume_screencast: params must be an object")
    clash = set(params) & (set(args) - {"params"})
    if clash:
        raise BadArgs(f"resume_screencast: {sorted(clash)} given both flat and under params")
    return {**{k: v for k, v in args.items() if k != "params"}, **params}
