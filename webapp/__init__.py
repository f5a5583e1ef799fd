"""webapp: the Shinken session server.

``webapp.app.create_app`` builds the single-process server (session core in
process); ``webapp.router.create_app`` builds the thin multi-process router.
This package root imports neither, so the router process never loads the
session core or a tokenizer.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # ``webapp.create_app`` is the single-process server; imported on first use
    # so ``import webapp.router`` never pulls in the session core.
    if name == "create_app":
        from webapp.app import create_app

        return create_app
    raise AttributeError(f"module 'webapp' has no attribute {name!r}")
