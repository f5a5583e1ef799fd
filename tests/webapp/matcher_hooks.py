"""Custom session message matchers selected by import path (``tests.webapp.matcher_hooks:NAME``)
in the matcher tests: in process, and by servers started from the checkout."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def same_content(stored: Message, replayed: Message) -> bool:
    """A trusted custom matcher: only the content counts."""
    return bool(stored.get("content") == replayed.get("content"))


def exploding(stored: Message, replayed: Message) -> bool:
    raise RuntimeError("matcher asked to explode")


def truthy(stored: Message, replayed: Message) -> Any:
    return 1  # truthy, but not a bool: a contract breach, never a match


async def async_matcher(stored: Message, replayed: Message) -> bool:
    return True


NOT_CALLABLE = "strict"
