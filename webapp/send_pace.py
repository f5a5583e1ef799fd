"""Records GETs paced while the process that sends them serves other requests.

A records GET moves GiBs over a loopback or LAN socket at the page cache's speed. On a small
host the copy's kernel work (the sender's copies, TCP, the receiving client when it runs on the
same host) takes the CPU the chats of a training run need, and no thread priority reaches it
(docs/benchmarks.md sections 39 and 50). So while the sending process has other requests in
flight, or had one within :data:`LINGER` seconds, the records GETs it sends keep together to
``records_get_pace`` MiB/s; with nothing else in flight they run flat out (0: never paced).

One :class:`Pacer` per HTTP front (the router's process: it sends every records GET, in both
server modes): its WSGI middleware (:meth:`Pacer.counting`) counts the requests in flight and
puts each one's :class:`Paced` handle in its environ; a records GET's body marks its request as
one being sent (:meth:`Paced.body_started`), so GETs do not pace each other; the send threads
(``webapp.filebody``) call :meth:`Pacer.pace` after each write, which sleeps in that thread
(never in the hub) for as long as the bytes sent so far are ahead of the rate, and ends its
call after about a send slice (0.2 s) however low the rate, the rest sent by the next call (a
lane's calls stay bounded: a worker stopping mid-GET waits for them). The decision
(:meth:`Pacer.delay`) is a function of the counts and an injected clock.
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from werkzeug.wsgi import ClosingIterator

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["ENVIRON_KEY", "LINGER", "PACE_SLICE", "UNPACED", "MiB", "Paced", "Pacer", "paced"]

MiB = 1 << 20
# A request that ended this recently still counts as in flight: a chat's client sends its next
# request a few milliseconds after the last answer, and the sockets' backlog of a burst at full
# speed is still being copied for about as long after the sender stops.
LINGER = 0.05
# The largest write a paced send makes at once (a sendfile call otherwise moves up to a GiB):
# the pace follows requests that start mid-GET within one such slice.
PACE_SLICE = 2 << 20
ENVIRON_KEY = "shinken.paced"  # a request's Paced handle in its WSGI environ


def _real_sleep() -> Callable[[float], None]:
    """``time.sleep`` as the OS gives it: under gevent ``time.sleep`` is the hub's, and a send
    thread has no hub of its own to sleep in."""
    try:
        from gevent import monkey
    except ImportError:
        return time.sleep
    sleep: Callable[[float], None] = monkey.get_original("time", "sleep")
    return sleep


def _real_lock() -> Any:
    try:
        from gevent import monkey
    except ImportError:
        import _thread

        return _thread.allocate_lock()
    return monkey.get_original("_thread", "allocate_lock")()


class Pacer:
    """The pace of one process's records GETs: ``rate_mib_s`` MiB/s together while other
    requests are in flight (0: no cap)."""

    def __init__(self, rate_mib_s: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] | None = None, linger: float = LINGER) -> None:
        if not rate_mib_s >= 0:
            raise ValueError(f"records_get_pace must be >= 0 MiB/s, got {rate_mib_s}")
        self.rate = rate_mib_s * MiB  # bytes per second; 0: off
        self.linger = linger
        self._clock = clock
        self._sleep = sleep if sleep is not None else _real_sleep()
        self._lock = _real_lock()  # the send threads share the budget
        self.requests = 0  # requests in flight in this process (the hub counts them)
        self.sending = 0  # of them, records GET bodies being sent
        self.others_ended = -float("inf")  # when the last other request ended
        self._paid_until = -float("inf")  # the bytes sent so far are on pace until this time

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    # -- what the process is doing (the hub) ------------------------------------------------

    def counting(self, app: WSGIApplication) -> WSGIApplication:
        """``app`` with its requests counted from their start until their body is closed; each
        request's :class:`Paced` handle in its environ (:func:`paced`). A bound method (a Flask
        app's ``wsgi_app``, which this replaces) is held weakly: the app and its middleware in a
        cycle would outlive the app's last use until a cyclic collection, its files with it."""
        target: Callable[[], WSGIApplication | None] = (
            weakref.WeakMethod(app) if inspect.ismethod(app) else lambda: app)

        def counted(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
            inner = target()
            assert inner is not None, "the app this middleware wraps is gone"
            handle = environ[ENVIRON_KEY] = Paced(self)
            self.requests += 1
            try:
                body = inner(environ, start_response)
            except BaseException:
                handle.ended()
                raise
            return ClosingIterator(body, handle.ended)

        return counted

    def others_in_flight(self, now: float) -> bool:
        """Another request is in flight, or one ended within :attr:`linger`."""
        return self.requests > self.sending or now - self.others_ended < self.linger

    # -- the send threads ---------------------------------------------------------------------

    def delay(self, sent: int, started: float) -> float:
        """Seconds to wait after writing ``sent`` bytes that began to go at ``started`` (0:
        before a write, what is still owed): 0 with nothing else in flight (or no cap), else
        until the bytes sent since the pace engaged are within the rate (shared by every GET
        this process sends)."""
        if not self.rate:
            return 0.0
        now = self._clock()
        if not self.others_in_flight(now):
            return 0.0
        with self._lock:
            if sent:  # time spent flat out or idle before this write is not credited
                self._paid_until = max(self._paid_until, started) + sent / self.rate
            return max(0.0, self._paid_until - now)

    def pace(self, sent: int, started: float, until: float) -> bool:
        """:meth:`delay`, slept in the calling (send) thread, but not past ``until``: whether
        the sends are on pace (False: the thread should give the send back to the hub, which
        calls again at once; a lane's call stays bounded however low the rate)."""
        wait = self.delay(sent, started)
        if wait <= 0:
            return True
        room = until - self._clock()
        self._sleep(max(0.0, min(wait, room)))
        return wait <= room

    def now(self) -> float:
        return self._clock()

    def slice_size(self, want: int) -> int:
        """A write's size: at most :data:`PACE_SLICE` while a cap is set, so the pace engages
        within one slice of a request's start; ``want`` otherwise."""
        return min(want, PACE_SLICE) if self.rate else want


class Paced:
    """One request as its process's :class:`Pacer` counts it."""

    __slots__ = ("_done", "bulk", "pacer")

    def __init__(self, pacer: Pacer, *, counted: bool = True) -> None:
        self.pacer = pacer
        self.bulk = False  # a records GET body being sent: not a request to pace for
        self._done = not counted  # a request nobody counted changes no count

    def body_started(self) -> None:
        """The request's records body began to go out: it stops counting as another request."""
        if not self.bulk and not self._done:
            self.bulk = True
            self.pacer.sending += 1

    def ended(self) -> None:
        if self._done:
            return
        self._done = True
        pacer = self.pacer
        pacer.requests -= 1
        if self.bulk:
            pacer.sending -= 1
        else:  # a records GET's end does not pace the GETs still going
            pacer.others_ended = pacer.now()


UNPACED = Pacer(0.0)  # a body sent where no app counts requests (tests, other WSGI servers)


def paced(environ: Mapping[str, Any]) -> Paced:
    """The request's handle (:meth:`Pacer.counting`), or a handle of a pacer that never paces."""
    handle = environ.get(ENVIRON_KEY)
    return handle if isinstance(handle, Paced) else Paced(UNPACED, counted=False)
