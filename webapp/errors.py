"""The root of every error the session server raises on purpose, carrying its HTTP status.

Each layer keeps its own branch, in its own module; an adapter (the router, the single-process
app) maps any of them with one rule: answer ``exc.status`` with ``str(exc)``::

    WebappError                         status 500 unless a subclass says otherwise
    ├── SessionError                    500  webapp.session_errors: the session core's tree
    │   └── ...                              (drawn there, webapp.limits' two included)
    ├── BodyError                       400  webapp.http_limits: reading a request body
    │   ├── MalformedBody               400
    │   └── BodyTimeout                 408
    ├── IpcError                        502  webapp.ipc: the router <-> worker channel
    │   ├── IpcChannelClosed            503  the worker is gone
    │   ├── IpcProtocolError            502  the peer broke the wire format
    │   │   └── IpcVersionMismatch      502  ... or speaks another version of it
    │   ├── FrameTooLarge               413
    │   ├── IpcTimeout (TimeoutError)   504
    │   └── IpcRemoteError                   the worker's handler failed: 500, or 503 when refused unrun (busy)
    ├── ShardUnavailable                503  webapp.supervisor: the shard has no serving worker
    │                                        (starting, dead, hung, stopped, or failed to boot)
    ├── WorkerBootError                 500  webapp.worker: a worker could not build its core
    ├── EngineConfigError               500  webapp.engines.base: the engine settings disagree
    ├── EngineCheckFailed               500  webapp.engines.probe: a start-up check of the engine
    │   ├── BackendURLError             500  the URL is no http(s) endpoint
    │   ├── EngineUnreachable           500  nothing answers at the URL
    │   ├── EngineNotAnswering          500  it takes connections but answers nothing in time
    │   ├── EngineKindMismatch          500  another engine than --backend-kind names
    │   └── VocabularyMismatch          500  the tokenizer is not the engine's
    ├── TokenizerLoadError              500  webapp.tokenizers: no tokenizer.json or chat template
    ├── DataDirInUse (RuntimeError)     500  webapp.datadir: another server owns the data directory
    ├── DataDirUnsafe (RuntimeError)    500  webapp.datadir: the directory or a file in it is not ours alone
    ├── SessionServerNotReady           500  webapp.serve: the launched server never became ready
    ├── ViewerQueryError                400  webapp.viewer_shape: a session-list query it cannot answer
    ├── FleetError                      400  webapp.viewer_fleet: the viewer's live fleets
    │   ├── FleetNotFound               404
    │   └── FrameRefused                400  type, size, tile or byte budget
    ├── ApiKeyFileError (ValueError)    500  webapp.serve: --api-key-file unreadable, empty or shared
    ├── SampleHookSelectorError (ValueError)  500  webapp.tree_samples: a samples picker/post-processor
    │                                        selector that names no synchronous function
    ├── UnknownMatcher (ValueError)     500  webapp.matchers: a session message matcher selector that
    │                                        names no synchronous function
    └── InflightRefused                 500  webapp.inflight: over max_inflight_bytes (the subclasses say)
        ├── Overloaded                  503  with Retry-After: others' bodies first
        └── BodyOverBudget              413  larger than the whole budget

The start-up errors (the engine checks, the tokenizer, the data directory, the API key file,
the samples hooks, the message matcher) are reported by the launcher as one line and an exit
code, never as an HTTP answer; they carry the root's 500 only because every class of the tree
has a status. ``tests/test_error_trees.py``
checks this drawing (and session_errors') against the classes.

Imports nothing: the router process may use it without the session core.
"""

from __future__ import annotations

__all__ = ["WebappError"]


class WebappError(Exception):
    """Base of every ``webapp`` error; ``status`` is the HTTP status an adapter answers with."""

    status: int = 500
