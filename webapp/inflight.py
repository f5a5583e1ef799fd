"""The bytes of request bodies one process is handling at once, bounded (``max_inflight_bytes``).

The body cap bounds one request; this bounds them together. A worker holds a few copies of a
body while it handles it (the received bytes, the decoded JSON, the payload sent to the engine:
docs/benchmarks.md), so 256 connections of 256 MiB each could take a host's memory. Each HTTP
front (the router: per server; the single-process app) and each session worker admits a body
against its budget before handling it and releases it with the reply: a body that would take
the total past the limit answers 503 with ``Retry-After`` (:class:`Overloaded`), so the client
comes back when others are done; one larger than the whole budget can never fit and answers
413 (:class:`LimitExceeded`). A body without ``Content-Length`` (chunked) reserves the body cap.

Imports nothing of the core; used by the router, the app and the worker.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from webapp.errors import WebappError
from webapp.settings import MAX_BODY_BYTES

__all__ = ["RETRY_AFTER", "BodyOverBudget", "InflightBudget", "InflightRefused", "Overloaded", "refusal_headers"]

RETRY_AFTER = 1  # seconds: turns take about this long; a client polling faster only adds load


class InflightRefused(WebappError):
    """A request body refused by the bytes-in-flight budget ``limit`` (nothing was read)."""

    def __init__(self, message: str, limit: str, allowed: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.allowed = allowed


class Overloaded(InflightRefused):
    """503: the body would take the bytes in flight past the limit; retry after ``retry_after`` s."""

    status = 503

    def __init__(self, limit: str, allowed: int, in_flight: int, wanted: int, retry_after: int = RETRY_AFTER) -> None:
        super().__init__(f"{in_flight} request bytes in flight, this body of {wanted} would pass the limit "
                         f"{limit}={allowed}; retry after {retry_after} s", limit, allowed)
        self.retry_after = retry_after


class BodyOverBudget(InflightRefused):
    """413: the body alone is larger than the whole budget: it can never be admitted."""

    status = 413


def refusal_headers(exc: InflightRefused) -> tuple[tuple[str, str], ...]:
    return (("Retry-After", str(exc.retry_after)),) if isinstance(exc, Overloaded) else ()


class InflightBudget:
    """Admission of request bodies against ``limit`` bytes in flight (threads or greenlets)."""

    def __init__(self, limit: int, name: str = "max_inflight_bytes") -> None:
        if limit < 1:
            raise ValueError(f"{name} must be >= 1, got {limit}")
        self.limit = limit
        self.name = name
        self.used = 0
        self.peak = 0
        self.refused = 0
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, length: int | None) -> Iterator[int]:
        """Reserve ``length`` bytes (None: the body cap) while the body is handled. Raises
        :class:`Overloaded` (503) or :class:`BodyOverBudget` (413) without reserving."""
        wanted = MAX_BODY_BYTES if length is None else max(0, length)
        if wanted > self.limit:
            raise BodyOverBudget(f"the request body of {wanted} bytes is over the limit {self.name}={self.limit}",
                                 self.name, self.limit)
        with self._lock:
            if self.used + wanted > self.limit:
                self.refused += 1
                raise Overloaded(self.name, self.limit, self.used, wanted, RETRY_AFTER)
            self.used += wanted
            self.peak = max(self.peak, self.used)
        try:
            yield wanted
        finally:
            with self._lock:
                self.used -= wanted
