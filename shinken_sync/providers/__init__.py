"""Providers create, reach, probe and destroy sandboxes (see :mod:`.base`)."""

from .base import Liveness, Provider
from .errors import DaemonStartError, ProviderError, ProviderExhausted, UnknownHandle
from .local import LocalFleetProvider, LocalProvider, LocalSandbox
from .static import StaticProvider, StaticSandbox

__all__ = [
    "DaemonStartError",
    "Liveness",
    "LocalFleetProvider",
    "LocalProvider",
    "LocalSandbox",
    "Provider",
    "ProviderError",
    "ProviderExhausted",
    "StaticProvider",
    "StaticSandbox",
    "UnknownHandle",
]
