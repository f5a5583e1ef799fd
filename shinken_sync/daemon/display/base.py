"""The interface every display backend of shinkend implements.

A display owns a screen (an Xvfb server, or an in-process framebuffer) and
turns ACI verbs into input events and encoded screenshots. The daemon
(``shinken_sync.daemon.server``) validates arguments and serialises calls per
connection; a display only has to do the work.

Coordinates are screen pixels, origin top-left. Methods are coroutines so a
backend may hand blocking work (capture, encode, xdotool) to a thread; a
backend must never block the event loop for longer than one encode.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from shinken_sync.protocol import ERR_FAILED, ERR_UNSUPPORTED
from shinken_sync.verbs import DEFAULT_IMAGE_FORMAT, DEFAULT_IMAGE_QUALITY, IMAGE_FIELDS


class DisplayError(Exception):
    """An action could not be carried out; ``kind`` is a protocol error kind."""

    def __init__(self, message: str, kind: str = ERR_FAILED):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class EncodedImage:
    """An encoded screenshot and how its pixels map back to the screen:
    ``screen_x = x0 + image_x * scale`` (likewise y). ``pointer``: the pixels show the
    mouse pointer where it lies (False: they never show it)."""

    data: bytes
    format: str  # "png" | "jpeg"
    width: int
    height: int
    scale: float
    x0: int = 0
    y0: int = 0
    pointer: bool = False

    def meta(self) -> dict[str, Any]:
        """The reply's ``result`` (a screencast frame's header fields): shinken_sync.verbs.IMAGE_FIELDS."""
        return {name: getattr(self, name) for name in IMAGE_FIELDS}


class Display(abc.ABC):
    #: "virtual" or "xvfb"; reported in the hello message.
    kind: str = ""
    width: int
    height: int

    async def start(self) -> None:
        """Bring the screen up (start Xvfb, draw the desktop). Idempotent."""

    async def close(self) -> None:
        """Stop everything this display started. Idempotent."""

    @abc.abstractmethod
    async def screenshot(
        self,
        format: str = DEFAULT_IMAGE_FORMAT,
        quality: int = DEFAULT_IMAGE_QUALITY,
        max_long_edge: int | None = None,
        region: tuple[int, int, int, int] | None = None,
    ) -> EncodedImage:
        """Capture the screen (or ``region`` = x, y, w, h) and encode it.

        ``max_long_edge`` downscales so the longer side is at most that many
        pixels, keeping the aspect ratio; it never upscales.
        """

    @abc.abstractmethod
    async def change_token(self) -> Hashable:
        """A value that differs whenever the pixels differ. Used for screencast
        idle suppression and ``wait_stable`` / ``wait_change``; cheap for the
        virtual display, a capture digest for Xvfb."""

    @abc.abstractmethod
    async def click(self, x: int, y: int, button: str = "left", count: int = 1) -> None: ...

    @abc.abstractmethod
    async def move(self, x: int, y: int) -> None: ...

    @abc.abstractmethod
    async def drag(self, x0: int, y0: int, x1: int, y1: int, button: str = "left") -> None: ...

    @abc.abstractmethod
    async def scroll(self, dx: int, dy: int, x: int | None = None, y: int | None = None) -> None:
        """Scroll by wheel clicks: ``dy > 0`` scrolls down, ``dx > 0`` right;
        at the pointer, or at (x, y) when given."""

    @abc.abstractmethod
    async def type_text(self, text: str) -> None:
        """Type any Unicode text into the focused widget."""

    @abc.abstractmethod
    async def key(self, combo: str) -> None:
        """Press a key combination such as ``ctrl+shift+t``, ``Return``, ``a``."""

    @abc.abstractmethod
    async def cursor(self) -> tuple[int, int]: ...

    async def launch(self, app: str, args: list[str], timeout: float) -> dict[str, Any]:
        """Open ``app`` (a name of ``display.desktop.APPS``) with extra ``args`` and wait up to
        ``timeout`` seconds for its window, which gets the focus. Only a real desktop can."""
        raise DisplayError(f"the {self.kind} display has no apps to launch (start shinkend with --desktop)",
                           ERR_UNSUPPORTED)
