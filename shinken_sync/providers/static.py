"""Sandboxes that already run elsewhere, given as ``(url, token)`` pairs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from .base import Liveness, Provider
from .errors import ProviderExhausted, UnknownHandle


@dataclass(frozen=True)
class StaticSandbox:
    index: int
    url: str
    token: str = field(repr=False)


class StaticProvider(Provider[StaticSandbox]):
    """Hands out the given endpoints in order; never starts or stops anything.

    ``check_alive`` cannot look inside someone else's sandbox, so it reports
    ``alive=True, detail="unknown"`` (the Liveness convention for providers
    that cannot introspect). ``destroy`` retires a handle; it is not handed
    out again.
    """

    def __init__(self, endpoints: list[tuple[str, str]]):
        self._handles = [StaticSandbox(i, url, token) for i, (url, token) in enumerate(endpoints)]
        self._next = 0
        self._lock = threading.Lock()

    def create(self, **options: Any) -> StaticSandbox:
        if options:
            raise TypeError("a static provider takes no creation options")
        with self._lock:
            if self._next >= len(self._handles):
                raise ProviderExhausted(f"all {len(self._handles)} static endpoints are handed out")
            self._next += 1
            return self._handles[self._next - 1]

    def endpoint(self, handle: StaticSandbox) -> tuple[str, str]:
        self._own(handle)
        return handle.url, handle.token

    def check_alive(self, handle: StaticSandbox) -> Liveness:
        self._own(handle)
        return Liveness(alive=True, detail="unknown")

    def destroy(self, handle: StaticSandbox) -> None:
        self._own(handle)

    def _own(self, handle: StaticSandbox) -> None:
        if not (0 <= handle.index < len(self._handles) and self._handles[handle.index] is handle):
            raise UnknownHandle(f"{handle!r} does not belong to this provider")
