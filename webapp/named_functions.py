"""A configured function by name: a built-in's name, or an import path of the user's own.

The server's replaceable functions (tree sessions' sample pickers and post-processors, the
session message matcher) are chosen by a setting whose value is a name in the caller's table
(its built-ins, and miles' own import paths of them) or an import path ``package.module.function``
/ ``package.module:function`` of a trusted function. Each is called synchronously (under a
session's lock, or in the samples path), so a coroutine function is refused with the rest.

Imports nothing of ``webapp``: the launcher checks a selector before anything starts.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["resolve_function"]


def resolve_function(selector: str, table: Mapping[str, Callable[..., Any]], error: type[Exception],
                     label: str, unknown: str) -> Callable[..., Any]:
    """The synchronous callable ``selector`` names: ``table[selector]``, else the import path.

    Raises ``error(message)``: ``unknown`` when it is neither a name of the table nor an import
    path; else a message starting ``"{label} {selector!r}: "`` for a module that does not import
    (any import-time failure is the selector's), a missing attribute, something not callable,
    or a coroutine function."""
    fn: Any = table.get(selector)
    if fn is None:
        module_name, sep, attr = selector.partition(":") if ":" in selector else selector.rpartition(".")
        if not sep or not module_name or not attr:
            raise error(unknown)
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # any import-time failure of the named module is the selector's
            raise error(f"{label} {selector!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
        fn = module
        for part in attr.split("."):
            fn = getattr(fn, part, None)
            if fn is None:
                raise error(f"{label} {selector!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise error(f"{label} {selector!r}: {type(fn).__name__} is not callable")
    if inspect.iscoroutinefunction(fn):
        raise error(f"{label} {selector!r}: an async function; a synchronous one is required")
    resolved: Callable[..., Any] = fn
    return resolved
