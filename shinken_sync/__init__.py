"""shinken_sync: a sync-first SDK for driving many computer-use sandboxes.

The blocking :class:`Sandbox` (``connect``) is the default API; it is a facade
over the asyncio core :class:`AsyncSandbox` (``aconnect``), and every
``Sandbox`` of a process shares one background :class:`SharedLoop` thread.

The frame budget knob is deliberately not re-exported: set
``shinken_sync.client.GLOBAL_FRAME_BUDGET_BYTES`` (a package-level copy would
silently do nothing).

Names are imported lazily so ``import shinken_sync`` stays cheap (the daemon
and the providers do not pay for the client stack, and vice versa).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "connect": "shinken_sync.sync",
    "DEFAULT": "shinken_sync.client_protocol",
    "Sandbox": "shinken_sync.sync",
    "aconnect": "shinken_sync.client",
    "AsyncSandbox": "shinken_sync.client",
    "SharedLoop": "shinken_sync.sharedloop",
    "LoopThreadDied": "shinken_sync.sharedloop",
    "LoopClosed": "shinken_sync.sharedloop",
    "LoopTimeout": "shinken_sync.sharedloop",
    "Screenshot": "shinken_sync.results",
    "ExecResult": "shinken_sync.results",
    "StepResult": "shinken_sync.results",
    "StepRow": "shinken_sync.results",
    "Frame": "shinken_sync.results",
    "ScreencastStream": "shinken_sync.client",
    "loop_frame_budget": "shinken_sync.client",
    "ShinkenError": "shinken_sync.errors",
    "ConnectError": "shinken_sync.errors",
    "InvalidURL": "shinken_sync.errors",
    "AuthRefused": "shinken_sync.errors",
    "ProtocolMismatch": "shinken_sync.errors",
    "ConnectionLost": "shinken_sync.errors",
    "SandboxDied": "shinken_sync.errors",
    "RPCTimeout": "shinken_sync.errors",
    "ActionError": "shinken_sync.errors",
    "ActionTimeout": "shinken_sync.errors",
    "ActionDenied": "shinken_sync.errors",
    "FrameTimeout": "shinken_sync.errors",
    "MessageTooBig": "shinken_sync.errors",
    "Skipped": "shinken_sync.errors",
    "ProtocolViolation": "shinken_sync.errors",
    "StreamLost": "shinken_sync.errors",
    "SandboxClosed": "shinken_sync.errors",
    "classify_exception": "shinken_sync.errors",
    "is_connection_loss": "shinken_sync.errors",
    "is_sandbox_death": "shinken_sync.errors",
    "tune_gc_for_fleet": "shinken_sync.fleetgc",
    "Provider": "shinken_sync.providers.base",
    "Liveness": "shinken_sync.liveness",
    "LocalProvider": "shinken_sync.providers.local",
    "StaticProvider": "shinken_sync.providers.static",
}

__all__ = [*sorted(_EXPORTS), "__version__"]  # noqa: PLE0604 (built from the lazy table above)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shinken_sync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return __all__
