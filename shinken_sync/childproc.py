"""A child's ready line: the one way every process we start says it is up.

Each of our long-running programs (``shinkend``, ``shinken-session-server``, the reference
backend) prints one JSON object on a line of its own on stdout once it serves, saying where
(``url``) and what it is; the parent waits for that line instead of polling a port, so port 0
has no race. The parents differ in how they wait (the providers read many children at once
through a selector, the session server's launcher keeps forwarding the rest of the output to a
log, the reference backend's starter blocks), so this module holds the two parts they share:

* :class:`ReadyLineBuffer` collects stdout chunks up to the first newline (bounded: a child
  that writes a line's worth of bytes without one is not printing a ready line) and
  :func:`parse_ready_line` turns that line into the JSON object, or None when it is not one;
* :func:`read_ready_line` is the blocking wait over both, with a deadline, for a parent that
  waits on one child.

The callers turn :class:`ReadyLineError` into their own typed errors (``DaemonStartError``,
``SessionServerNotReady``...). Stdlib only: the shared layer of docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import selectors
import time
from typing import Any

__all__ = [
    "MAX_READY_LINE",
    "ReadyLineBuffer",
    "ReadyLineError",
    "ReadyLineTimeout",
    "ReadyLineTooLong",
    "StdoutClosed",
    "parse_ready_line",
    "read_ready_line",
]

#: A ready line longer than this is not a ready line (shinkend's fleet line lists N URLs).
MAX_READY_LINE = 4 << 20


class ReadyLineError(Exception):
    """The child did not print a ready line; the subclass says how it failed."""


class ReadyLineTooLong(ReadyLineError):
    """More than ``MAX_READY_LINE`` bytes arrived without a newline."""


class StdoutClosed(ReadyLineError):
    """The child closed its stdout (it exited) before a complete first line."""


class ReadyLineTimeout(ReadyLineError, TimeoutError):
    """No complete first line within the wait."""


def parse_ready_line(line: bytes | str) -> dict[str, Any] | None:
    """The JSON object ``line`` holds, or None when it holds anything else."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ReadyLineBuffer:
    """Stdout chunks in, the first complete line (without its newline) out."""

    def __init__(self, max_bytes: int = MAX_READY_LINE) -> None:
        self._buffer = bytearray()
        self._max = max_bytes

    def feed(self, chunk: bytes) -> bytes | None:
        """The first line once it is complete, else None; ``b""`` (EOF) raises :class:`StdoutClosed`."""
        if not chunk:
            raise StdoutClosed("the child closed its stdout before its ready line")
        self._buffer += chunk
        end = self._buffer.find(b"\n")
        if end >= 0:
            return bytes(self._buffer[:end])
        if len(self._buffer) > self._max:
            raise ReadyLineTooLong(f"more than {self._max} bytes without a newline: not a ready line")
        return None


def read_ready_line(fd: int, timeout: float, max_bytes: int = MAX_READY_LINE) -> bytes:
    """Block until the child behind pipe ``fd`` printed its first line (returned without the
    newline); :class:`ReadyLineTimeout` after ``timeout`` seconds."""
    buffer = ReadyLineBuffer(max_bytes)
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                raise ReadyLineTimeout(f"no ready line after {timeout:g} s")
            line = buffer.feed(os.read(fd, 65536))
            if line is not None:
                return line
