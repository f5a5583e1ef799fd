"""The root of every error the session server raises on purpose, carrying its HTTP status.

Each layer keeps its own branch, in its own module; an adapter (the router, the single-process
app) maps any of them with one rule: answer ``exc.status`` with ``str(exc)``::

    WebappError                         status 500 unless a subclass says otherwise
    ├── SessionError                    webapp.session_errors: the session core's tree
    │   └── ...                         (LimitExceeded 413, TooManySessions 429: webapp.limits)
    ├── BodyError                       webapp.http_limits: reading a request body
    │   ├── MalformedBody               400
    │   └── BodyTimeout                 408
    ├── IpcError                        webapp.ipc: the router <-> worker channel
    │   ├── IpcChannelClosed            503  the worker is gone
    │   ├── IpcProtocolError            502  the peer broke the wire format
    │   │   └── IpcVersionMismatch      502  ... or speaks another version of it
    │   ├── FrameTooLarge               413
    │   ├── IpcTimeout                  504
    │   └── IpcRemoteError              500  the worker's handler failed (503: worker busy)
    ├── ShardUnavailable                503  webapp.supervisor: the shard has no serving worker
    │                                        (starting, dead, hung, stopped, or failed to boot)
    └── InflightRefused                 webapp.inflight: over max_inflight_bytes
        ├── Overloaded                  503  with Retry-After: others' bodies first
        └── BodyOverBudget              413  larger than the whole budget

Imports nothing: the router process may use it without the session core.
"""

from __future__ import annotations

__all__ = ["WebappError"]


class WebappError(Exception):
    """Base of every ``webapp`` error; ``status`` is the HTTP status an adapter answers with."""

    status: int = 500
