"""The viewer's data contract, declared once: the session summary's fields, the list's sort keys
and paging, and the viewer's URL space. Imports nothing of the session core, so the router may use it.

A *session summary* is what the session list shows of one session. The session core builds it
(``webapp.viewer_data.session_summary``: every worker for its own shard, the single-process app
for all); the HTTP side (``webapp.viewer_http``) merges the shards' lists with :func:`page_of`
and adds ``instance``. Both take the field names from :data:`SUMMARY_FIELDS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from webapp.errors import WebappError

__all__ = ["DEFAULT_PAGE_SIZE", "MAX_PAGE_SIZE", "SORT_KEYS", "SUMMARY_FIELDS", "UI_PREFIX", "ViewerQueryError",
           "is_viewer_path", "page_of"]

UI_PREFIX = "/ui"
# field -> what it holds. ``instance`` is the router's tag (webapp.scaleout), added by the HTTP side.
SUMMARY_FIELDS: Mapping[str, str] = {
    "session_id": "the session id",
    "turns": "committed turns (records) on the current branch",
    "tokens": "tokens of the final sequence (accumulated_token_ids)",
    "images": "distinct images the session's turns sent (stored once by sha256)",
    "rollbacks": "turns that replaced the previous reply (one-step rollbacks)",
    "created": "creation time, Unix seconds",
    "last_turn": "the last committed turn's time, Unix seconds (null: no turn yet)",
    "status": "'running' while a turn is in flight, else 'idle'",
    "instance": "the server's instance tag (null without --instance)",
}
SORT_KEYS = ("created", "last_turn", "turns", "tokens", "images", "session_id")
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500


class ViewerQueryError(WebappError):
    """A list query the viewer cannot answer (bad sort key, order or paging); HTTP 400."""

    status = 400


def is_viewer_path(path: str) -> bool:
    """Paths the viewer answers itself, with its own auth (``webapp.viewer_http``)."""
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


def _int_arg(args: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ViewerQueryError(f"{name} must be an integer, got {raw[:40]!r}") from None
    if not lo <= value <= hi:
        raise ViewerQueryError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def page_of(summaries: Iterable[Mapping[str, Any]], args: Mapping[str, str]) -> dict[str, Any]:
    """One page of the merged list: ``sort`` (a :data:`SORT_KEYS` entry, default ``created``),
    ``order`` (``desc`` default, or ``asc``), ``offset``, ``limit``, ``prefix`` (of the id).

    Raises :class:`ViewerQueryError` for a bad parameter."""
    sort = args.get("sort") or "created"
    if sort not in SORT_KEYS:
        raise ViewerQueryError(f"sort must be one of {', '.join(SORT_KEYS)}, got {sort[:40]!r}")
    order = args.get("order") or "desc"
    if order not in ("asc", "desc"):
        raise ViewerQueryError(f"order must be 'asc' or 'desc', got {order[:40]!r}")
    offset = _int_arg(args, "offset", 0, 0, 1 << 40)
    limit = _int_arg(args, "limit", DEFAULT_PAGE_SIZE, 1, MAX_PAGE_SIZE)
    prefix = args.get("prefix") or ""
    rows = [s for s in summaries if str(s["session_id"]).startswith(prefix)]
    # None (no turn yet) sorts before every time; the id breaks ties, so pages are stable.
    rows.sort(key=lambda s: (s[sort] is not None, s[sort] if s[sort] is not None else 0, s["session_id"]),
              reverse=order == "desc")
    return {"total": len(rows), "offset": offset, "limit": limit, "sort": sort, "order": order,
            "prefix": prefix, "sessions": rows[offset:offset + limit]}
