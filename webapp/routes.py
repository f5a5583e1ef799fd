"""The parts of the HTTP contract both adapters share (the single-process app and the router),
declared once; imports nothing, so the router may use it.

- The catch-all proxy ``/sessions/<id>/<path>`` (miles' ``session_proxy``): its methods and
  the client headers forwarded to the backend (the API key and hop-by-hop headers stay here).
- The error shapes: OpenAI's ``{"error": {"message", "type", "code"}}`` under
  ``/sessions/<id>/v1/`` (the OpenAI routes), miles' ``{"error": "<text>"}`` elsewhere.
"""

from __future__ import annotations

__all__ = ["PROXY_HEADERS", "PROXY_METHODS", "is_openai_path", "openai_error_body"]

PROXY_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")
PROXY_HEADERS = frozenset({"content-type", "accept"})


def is_openai_path(path: str) -> bool:
    """``/sessions/<id>/v1/...``: the routes whose errors take OpenAI's shape."""
    parts = path.split("/", 4)
    return len(parts) >= 4 and parts[1] == "sessions" and parts[3] == "v1"


def openai_error_body(message: str, type_: str, code: str) -> dict[str, dict[str, str]]:
    """OpenAI's error object, ``{"error": {"message", "type", "code"}}``."""
    return {"error": {"message": message, "type": type_, "code": code}}
