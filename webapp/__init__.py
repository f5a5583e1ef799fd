"""webapp: the Shinken session server.

``webapp.router.create_app`` builds the HTTP surface of both server modes (the
route table of ``webapp.routes``) over the processes that own the sessions:
worker subprocesses by default, or, from ``webapp.app.create_app`` (the
single-process server), one shard in its own process. This package root
imports neither, so the multi-process router never loads the session core or
a tokenizer.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # ``webapp.create_app`` is the single-process server; imported on first use
    # so ``import webapp.router`` never pulls in the session core.
    if name == "create_app":
        from webapp.app import create_app

        return create_app
    raise AttributeError(f"module 'webapp' has no attribute {name!r}")
