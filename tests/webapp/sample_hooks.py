"""Sample hooks selected by import path (``tests.webapp.sample_hooks:NAME``) in the tree-samples
tests: in process, and by servers started from the checkout (their workers import them)."""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from webapp.samples import Sample


def keep_all(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    """A tree-RL picker: every leaf is a sample, in commit order."""
    return list(leaf_samples)


def reverse(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    return list(reversed(leaf_samples))


def duplicate(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    return [leaf_samples[0], leaf_samples[0]]


def exploding(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    raise RuntimeError("policy bug")


def impure(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    return [deepcopy(leaf_samples[0])]


def not_a_list(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> Any:
    return {"samples": leaf_samples}


def drop_everything(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    return []


async def async_picker(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    return leaf_samples


NOT_CALLABLE = 42


def keep_all_or_explode(leaf_samples: list[Sample], session_metadata: dict[str, Any]) -> list[Sample]:
    """:func:`keep_all`, unless the agent's metadata asks it to fail (one server, both cases)."""
    if (session_metadata.get("agent") or {}).get("explode"):
        raise RuntimeError("picker asked to explode")
    return list(leaf_samples)
