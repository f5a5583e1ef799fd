"""The provider interface: how sandboxes are created, reached, probed and destroyed.

A provider owns the substrate lifecycle; the SDK core only talks the ACI
protocol to an endpoint. On the failure path the core asks the provider
(``check_alive``) whether a lost connection means the sandbox itself died,
and with what exit code or signal.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from shinken_sync.liveness import Liveness

__all__ = ["Handle", "Liveness", "Provider"]  # Liveness: re-exported, defined apart (no import circle)

if TYPE_CHECKING:  # imported on use: the SDK modules need not load with the interface
    from shinken_sync.client import AsyncSandbox
    from shinken_sync.sync import Sandbox

Handle = TypeVar("Handle")
# What __enter__ returns: the provider's own class (typing.Self is 3.11+).
_ProviderT = TypeVar("_ProviderT", bound="Provider[Any]")


class Provider(abc.ABC, Generic[Handle]):
    @abc.abstractmethod
    def create(self, **options: Any) -> Handle:
        """Start one sandbox and return its handle once it accepts connections."""

    def create_many(self, n: int, parallelism: int = 8, **options: Any) -> list[Handle]:
        """Start ``n`` sandboxes (at most ``parallelism`` booting at once, where the
        provider starts anything) and return their handles. All or nothing: on a
        failure the ones already created are destroyed and the error raised.
        This default creates them one by one; providers that boot sandboxes
        override it to start them in parallel."""
        if n < 0 or parallelism < 1:
            raise ValueError(f"create_many needs n >= 0 and parallelism >= 1, not n={n}, parallelism={parallelism}")
        handles: list[Handle] = []
        try:
            for _ in range(n):
                handles.append(self.create(**options))
        except BaseException:
            for handle in handles:
                self.destroy(handle)
            raise
        return handles

    @abc.abstractmethod
    def endpoint(self, handle: Handle) -> tuple[str, str]:
        """The ``(url, token)`` to dial this sandbox with."""

    @abc.abstractmethod
    def check_alive(self, handle: Handle) -> Liveness:
        """Probe one sandbox. Cheap; call it on the failure path, not in a hot loop."""

    @abc.abstractmethod
    def destroy(self, handle: Handle) -> None:
        """Stop one sandbox and release what it holds. Idempotent."""

    def close(self) -> None:
        """Destroy every sandbox this provider created. Idempotent."""

    def connect(self, handle: Handle, **kwargs: Any) -> Sandbox:
        """Dial ``handle`` with the blocking SDK: ``shinken_sync.sync.connect(url,
        token=..., liveness_probe=..., **kwargs)``. The probe lets a lost
        connection be upgraded to ``SandboxDied`` with this provider's detail."""
        from shinken_sync.sync import connect

        url, token = self.endpoint(handle)
        return connect(url, token=token, liveness_probe=lambda: self.check_alive(handle), **kwargs)

    async def aconnect(self, handle: Handle, **kwargs: Any) -> AsyncSandbox:
        """Like :meth:`connect`, with the asyncio SDK (``shinken_sync.client.aconnect``)."""
        from shinken_sync.client import aconnect

        url, token = self.endpoint(handle)
        return await aconnect(url, token=token, liveness_probe=lambda: self.check_alive(handle), **kwargs)

    def __enter__(self: _ProviderT) -> _ProviderT:  # noqa: PYI019 - no typing.Self on 3.10
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
