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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from webapp.errors import WebappError

__all__ = ["RETRY_AFTER", "BodyOverBudget", "Grant", "InflightBudget", "InflightRefused", "Overloaded", "refusal_headers"]

_Piece = TypeVar("_Piece", bound=bytes | bytearray)  # a body piece as its reader made it

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
    def hold(self, length: int | None) -> Iterator[Grant]:
        """Reserve ``length`` bytes while a received body is handled (the worker). Raises
        :class:`Overloaded` (503) or :class:`BodyOverBudget` (413) without reserving."""
        grant = self.grant(length)
        try:
            grant.take(length or 0)
            yield grant
        finally:
            grant.release()

    @contextmanager
    def admit(self, length: int | None) -> Iterator[Grant]:
        """The reservation of one request body, released at the end: its ``Content-Length``
        at once (an admitted body always completes: metering it would let concurrent big
        bodies each take a part and all fail), or, chunked, as its pieces arrive
        (:meth:`Grant.metered`). A length larger than the whole budget raises
        :class:`BodyOverBudget`; one that does not fit now, :class:`Overloaded`."""
        grant = self.grant(length)
        try:
            grant.take(length or 0)
            grant.prepaid = length or 0
            yield grant
        finally:
            grant.release()

    def grant(self, length: int | None) -> Grant:
        if length is not None and length > self.limit:
            raise BodyOverBudget(f"the request body of {length} bytes is over the limit {self.name}={self.limit}",
                                 self.name, self.limit)
        return Grant(self)

    def _take(self, n: int) -> None:
        with self._lock:
            if self.used + n > self.limit:
                self.refused += 1
                raise Overloaded(self.name, self.limit, self.used, n, RETRY_AFTER)
            self.used += n
            self.peak = max(self.peak, self.used)

    def _give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class Grant:
    """Bytes of one request's body held against an :class:`InflightBudget`."""

    def __init__(self, budget: InflightBudget) -> None:
        self._budget = budget
        self.held = 0
        self.prepaid = 0  # taken up front (the Content-Length): metered pieces come out of it first
        self._seen = 0

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes; raises :class:`Overloaded` (holding nothing more)."""
        if n > 0:
            self._budget._take(n)
            self.held += n

    def metered(self, pieces: Iterable[_Piece]) -> Iterator[_Piece]:
        """``pieces`` (a body as it arrives), each held before it is passed on."""
        for piece in pieces:
            before, self._seen = self._seen, self._seen + len(piece)
            self.take(self._seen - max(before, self.prepaid) if self._seen > self.prepaid else 0)
            yield piece

    def release(self) -> None:
        held, self.held = self.held, 0
        if held:
            self._budget._give(held)
