"""The parts of the HTTP contract both adapters share (the single-process app and the router),
declared once; imports nothing, so the router may use it.

- The catch-all proxy ``/sessions/<id>/<path>`` (miles' ``session_proxy``): its methods and
  the client headers forwarded to the backend (the API key and hop-by-hop headers stay here).
- ``GET /sessions/<id>?images=1`` (and ``/samples?images=1``): the session's images as well.
- The error shapes: OpenAI's ``{"error": {"message", "type", "code"}}`` under
  ``/sessions/<id>/v1/`` (the OpenAI routes) and ``/v1/`` (an OpenAI client whose base URL
  lacks the session), miles' ``{"error": "<text>"}`` elsewhere.
- The 404 of a path no route serves (:func:`no_route_message`): it names the routes.
"""

from __future__ import annotations

__all__ = ["IMAGES_QUERY", "PROXY_HEADERS", "PROXY_METHODS", "is_openai_path", "no_route_message",
           "openai_error_body", "wants_images"]

PROXY_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")
PROXY_HEADERS = frozenset({"content-type", "accept"})
IMAGES_QUERY = "images"  # the query parameter asking for the session's images (pixels) too
_TRUE = frozenset({"1", "true", "yes", "on"})


def wants_images(value: str | None) -> bool:
    """The ``images`` query parameter's value (None: absent) -> include the images?"""
    return value is not None and value.strip().lower() in _TRUE


def is_openai_path(path: str) -> bool:
    """``/sessions/<id>/v1/...`` (and ``/v1/...``, an OpenAI client without the session in its
    base URL): the paths whose errors take OpenAI's shape."""
    parts = path.split("/", 4)
    return (len(parts) >= 4 and parts[1] == "sessions" and parts[3] == "v1") or (len(parts) >= 2 and parts[1] == "v1")


def no_route_message(method: str, path: str, base_url: str) -> str:
    """The 404 text of a path no route serves (``base_url``: the server's, ``http://HOST:PORT/``)."""
    base = base_url.rstrip("/")
    if path == "/v1" or path.startswith("/v1/"):
        return (f"{method} {path} is not a route: the OpenAI endpoints are per session. POST /sessions creates "
                f"one (it answers {{\"session_id\": ...}}), then {method} /sessions/<session_id>{path}; an OpenAI "
                f"client takes base_url={base}/sessions/<session_id>/v1 (docs/session-server.md)")
    return (f"{method} {path} is not a route; the routes: POST /sessions, GET or DELETE /sessions/<session_id>, "
            f"POST /sessions/<session_id>/v1/chat/completions, POST /sessions/<session_id>/samples, "
            f"/sessions/<session_id>/<path> (proxied to the backend), GET /health (docs/session-server.md)")


def openai_error_body(message: str, type_: str, code: str) -> dict[str, dict[str, str]]:
    """OpenAI's error object, ``{"error": {"message", "type", "code"}}``."""
    return {"error": {"message": message, "type": type_, "code": code}}
