"""Errors of the display backends beyond :class:`~.base.DisplayError` (tree in the package docstring)."""

from __future__ import annotations

from shinken_sync.protocol import ERR_UNSUPPORTED

from .base import DisplayError


class DisplayUnavailable(DisplayError):
    """A backend cannot run on this machine; the message says what to install."""

    def __init__(self, message: str):
        super().__init__(message, ERR_UNSUPPORTED)
