"""Display backends of shinkend: ``virtual`` (in-process framebuffer desktop) and
``xvfb`` (a real X server). :func:`make_display` picks one by name.

Errors::

    DisplayError (base)          an action failed; ``kind`` is a protocol error kind
    └── DisplayUnavailable       the backend cannot run here (missing Xvfb, xdotool, mss);
                                 the message names what to install
    ValueError                   an unknown kind or an impossible screen size
"""

from __future__ import annotations

from typing import Any

from .base import Display, DisplayError, EncodedImage
from .errors import DisplayUnavailable

KINDS = ("virtual", "xvfb")


def make_display(kind: str, width: int, height: int, **options: Any) -> Display:
    """A display of ``kind`` ("virtual" | "xvfb"); ``options`` go to its constructor.

    Raises ValueError for an unknown kind, :class:`DisplayUnavailable` when the
    backend's programs or packages are missing.
    """
    if kind == "virtual":
        from .virtual import VirtualDisplay

        return VirtualDisplay(width, height, **options)
    if kind == "xvfb":
        from .xvfb import XvfbDisplay

        return XvfbDisplay(width, height, **options)
    raise ValueError(f"unknown display kind {kind!r}; expected one of {', '.join(KINDS)}")


__all__ = ["KINDS", "Display", "DisplayError", "DisplayUnavailable", "EncodedImage", "make_display"]
