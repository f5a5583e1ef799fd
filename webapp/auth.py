"""The API key check of the HTTP surface (the router, in both server modes): one rule.

With a key set (setting ``api_key``, ``SHINKEN_API_KEY``), every route but the route table's
open ones (``/health``, :data:`webapp.routes.OPEN_PATHS`) wants
``Authorization: Bearer <key>`` and answers 401 otherwise; ``/health`` stays open (load
balancers probe it) and so says nothing a client could learn from: no session count.

Imports nothing of the session core, so the router may use it.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from flask import Flask, Response, request

from webapp.routes import OPEN_PATHS

__all__ = ["OPEN_PATHS", "require_api_key"]


def require_api_key(app: Flask, api_key: str | None,
                    error: Callable[[int, str], Response] | None = None,
                    checks_itself: Callable[[str], bool] = lambda path: False) -> None:
    """Refuse (401, ``WWW-Authenticate: Bearer``) every request to ``app`` but the open paths
    without the bearer ``api_key``; None or empty: no check. ``error(status, message)`` builds
    the refusal in the app's error shape (default: ``{"error": message}``). ``checks_itself``:
    the paths whose handler checks the same key its own way (the viewer: bearer or its login
    cookie), passed through here."""
    if not api_key:
        return
    expected = f"Bearer {api_key}".encode()

    @app.before_request
    def _check_api_key() -> Response | None:
        if request.path in OPEN_PATHS or checks_itself(request.path):
            return None
        if hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
            return None
        message = "missing or invalid API key (expected 'Authorization: Bearer <key>')"
        response = (error(401, message) if error is not None
                    else Response(json.dumps({"error": message}), status=401, content_type="application/json"))
        response.headers["WWW-Authenticate"] = "Bearer"
        return response
