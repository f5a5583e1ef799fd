"""The verb table: every ACI verb declared once, for both peers.

One :class:`Verb` row per verb says what both sides must agree on: its wire
arguments (in the order the SDK's methods and action helpers take them), what
its reply decodes to, whether it waits in the daemon on purpose (and which
argument says for how long), whether an argument carries bytes, and whether it
opens a screencast. Everything else is derived from :data:`VERBS`, and checked
against it where a hand-written piece (a function with a typed signature)
stands beside it:

* ``protocol.VERBS`` (the names a call may carry, the hello's list);
* ``daemon/args.py`` ``SPECS`` (validation; its keys and argument names must
  match this table exactly, checked at import) and the daemon's defaults of
  the waiting verbs' timeouts (read from here);
* ``daemon/verbs.py`` ``HANDLERS`` (checked at import);
* ``actions.py`` (one helper per action verb) and the ``AsyncSandbox``
  methods (``method``), whose parameters ``tests/sdk/test_verb_table.py``
  compares with ``args``;
* the client protocol's reply decoders (``result``) and deadline rules
  (``waits_on``/``default_wait_ms``), which ``sync.py`` asks for.

This module imports nothing from the SDK or the daemon, so both can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Result(str, Enum):
    """What an OK reply's result becomes for the caller."""

    NONE = "none"  # input verbs: None
    DICT = "dict"  # the result object as is
    SCREENSHOT = "screenshot"  # a binary reply: results.Screenshot
    EXEC = "exec"  # results.ExecResult
    POINT = "point"  # (x, y)
    SIZE = "size"  # (width, height)
    FILE = "file"  # read_file: base64 data, chunked by the client
    STREAM = "stream"  # a ScreencastStream


#: The fields of a screenshot reply's ``result``, which a screencast frame's header
#: carries too, in this order: how the image maps to the screen (``screen_x = x0 +
#: image_x * scale``) and ``pointer``, whether the pixels show the mouse pointer where
#: it lies (false: never; a daemon that predates the field sends none, read as false).
IMAGE_FIELDS = ("format", "width", "height", "scale", "x0", "y0", "pointer")


@dataclass(frozen=True)
class Verb:
    """One verb of the protocol.

    ``args`` are the wire argument names in the SDK's parameter order.
    ``method`` is the ``AsyncSandbox`` method that sends it. ``action`` is
    True for verbs ``step``/``act_batch`` accept (and ``actions.py`` builds).
    ``waits_on`` names the argument giving the time (ms) the verb may take in
    the daemon on purpose, ``default_wait_ms`` its value when omitted (None:
    required). ``binary_arg`` is base64 on the wire, bytes for the caller.
    """

    name: str
    args: tuple[str, ...]
    result: Result
    method: str = ""
    action: bool = True
    waits_on: str | None = None
    default_wait_ms: int | None = None
    binary_arg: str | None = None
    opens_stream: bool = False

    def __post_init__(self) -> None:
        if not self.method:
            object.__setattr__(self, "method", self.name)


#: wait_stable / wait_change give up after this long unless told otherwise.
DEFAULT_WAIT_TIMEOUT_MS = 10_000
#: exec kills a command still running after this long unless told otherwise.
DEFAULT_EXEC_TIMEOUT_MS = 30_000
#: launch gives up on an app's window after this long unless told otherwise
#: (Chromium's first window takes 1-2 s here idle, several under load).
DEFAULT_LAUNCH_TIMEOUT_MS = 20_000

#: What a screenshot or a screencast frame is unless told otherwise: the SDK's signatures
#: (``actions.py``, ``AsyncSandbox``), the daemon's argument defaults (``daemon/args.py``), its
#: displays and its encoder all take these (``tests/sdk/test_verb_table.py`` checks every one).
DEFAULT_IMAGE_FORMAT = "jpeg"
DEFAULT_IMAGE_QUALITY = 80
#: Screencast frames per second unless told otherwise.
DEFAULT_SCREENCAST_FPS = 5.0

_IMAGE = ("format", "quality", "max_long_edge")
_STREAM = ("fps", "max_long_edge", "quality", "format")

_TABLE = (
    Verb("screenshot", (*_IMAGE, "region"), Result.SCREENSHOT),
    Verb("click", ("x", "y", "button", "count"), Result.NONE),
    Verb("move", ("x", "y"), Result.NONE),
    Verb("drag", ("x0", "y0", "x1", "y1", "button"), Result.NONE),
    Verb("scroll", ("dx", "dy", "x", "y"), Result.NONE),
    Verb("type", ("text",), Result.NONE),
    Verb("key", ("combo",), Result.NONE),
    Verb("wait", ("ms",), Result.DICT, waits_on="ms"),
    Verb(
        "wait_stable",
        ("stable_ms", "timeout_ms"),
        Result.DICT,
        waits_on="timeout_ms",
        default_wait_ms=DEFAULT_WAIT_TIMEOUT_MS,
    ),
    Verb("wait_change", ("timeout_ms",), Result.DICT, waits_on="timeout_ms", default_wait_ms=DEFAULT_WAIT_TIMEOUT_MS),
    Verb("cursor", (), Result.POINT),
    Verb("screen_size", (), Result.SIZE),
    Verb(
        "exec",
        ("cmd", "timeout_ms", "cwd", "env", "stdin", "max_output", "encoding"),
        Result.EXEC,
        waits_on="timeout_ms",
        default_wait_ms=DEFAULT_EXEC_TIMEOUT_MS,
        binary_arg="stdin",
    ),
    Verb("launch", ("app", "args", "timeout_ms"), Result.DICT, waits_on="timeout_ms",
         default_wait_ms=DEFAULT_LAUNCH_TIMEOUT_MS),
    Verb("read_file", ("path", "offset", "max_bytes"), Result.FILE),
    Verb("write_file", ("path", "data", "append", "make_dirs", "mode"), Result.DICT, binary_arg="data"),
    Verb("screencast_start", _STREAM, Result.STREAM, method="screencast", action=False, opens_stream=True),
    Verb("screencast_stop", ("stream_id",), Result.DICT, method="stop", action=False),
    # Stream parameters may also come nested under "params" (the SDK sends them flat).
    Verb("resume_screencast", ("stream_id", *_STREAM), Result.STREAM, action=False, opens_stream=True),
)

#: name -> Verb, in the table's order.
VERBS: dict[str, Verb] = {verb.name: verb for verb in _TABLE}
if len(VERBS) != len(_TABLE):
    raise AssertionError("a verb is declared twice in shinken_sync.verbs")

#: Verbs ``step`` and ``act_batch`` accept; screencasts have their own methods.
ACTION_VERBS = frozenset(name for name, verb in VERBS.items() if verb.action)
#: Verbs whose OK reply starts (or moves here) a stream the daemon then pushes.
STREAM_OPENERS = frozenset(name for name, verb in VERBS.items() if verb.opens_stream)
#: Verbs that wait in the daemon on purpose (their deadline includes the wait).
WAITING_VERBS = frozenset(name for name, verb in VERBS.items() if verb.waits_on)


def check_names(what: str, names: object) -> None:
    """Raise if ``names`` (a mapping's keys or a set) is not exactly the table's verbs.

    Hand-written registries beside the table (the daemon's handlers) call it
    at import, so a verb added on one side only fails loudly at once.
    """
    got = set(names)  # type: ignore[call-overload]
    if got != set(VERBS):
        missing, extra = sorted(set(VERBS) - got), sorted(got - set(VERBS))
        raise AssertionError(f"{what} does not match shinken_sync.verbs: missing {missing}, extra {extra}")
