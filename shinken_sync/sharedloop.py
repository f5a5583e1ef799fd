"""SharedLoop: one native OS thread hosting one asyncio loop, for blocking callers.

Every blocking :class:`~shinken_sync.sync.Sandbox` of a process submits its
work to one background loop; the caller's threads or gevent greenlets only
wait. One loop multiplexes every connection (and holds the per-loop frame
budget), instead of the ~7 MB and 2 threads per sandbox a thread-per-connection
facade costs.

How the pieces fit, and why (measured facts in ``docs/sync.md``):

- The loop thread is a *native* thread even when gevent has patched
  ``threading`` (a patched ``Thread`` is a greenlet of the caller's thread), and
  the loop is created inside it: under patching ``asyncio.new_event_loop()``
  then binds gevent's selector to that thread's own hub, which DNS and
  ``run_in_executor`` need.
- A waiter is woken through a mechanism that matches *its* context: a greenlet
  parks on a ``gevent.hub.Waiter``; the loop thread queues it on its hub's
  :class:`_HubWaker` and fires one libev async watcher, the only operation
  made from the foreign thread (``ev_async_send`` is thread-safe by design),
  and the hub thread itself switches to the waiter. Not
  ``loop.run_callback_threadsafe``: it also updates the hub loop's reference
  count and callback timer from the calling thread, which races with the hub
  (gevent#2212) and, at 1024 greenlets, drove the count negative so a waiting
  greenlet got ``LoopExit``. A plain thread waits on a native lock. Either way
  the wait is sliced, so a dead loop thread or a fork is noticed within
  :data:`LIVENESS_POLL` seconds even if nobody told the waiter.
- Fair turns: the loop starts at most :data:`MAX_STARTS_PER_TURN` submitted
  coroutines per loop turn and its selector reports at most
  :data:`MAX_EVENTS_PER_SELECT` ready sockets per select, so a 1024-caller
  burst (or the burst of their replies) never holds timers and other callers
  for 100+ ms (:func:`new_fair_event_loop` gives the same loop to the async
  face). Under the ``[fast]`` transport the loop is uvloop, outside gevent.
- The loop thread fails every waiter at once when it dies; after ``fork()`` the
  child starts a fresh loop on first use; at interpreter exit the loop closes
  its tracked resources, cancels its tasks and stops *before* ``threading``
  joins the program's threads (so a thread blocked on a sandbox call is
  released instead of hanging the exit).

Errors raised here (all under :class:`shinken_sync.errors.ShinkenError`)::

    ShinkenError
    ├── LoopThreadDied             the loop thread died, or was inherited across fork();
    │                              every pending and later call on that loop fails with it
    ├── LoopClosed (RuntimeError)  misuse: the SharedLoop was closed (or closed mid-call)
    └── LoopTimeout (TimeoutError) run()/result() waited ``timeout`` seconds; the coroutine
                                   was cancelled on the loop
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import concurrent.futures.thread  # see _register_exit_hook
import contextlib
import encodings.idna  # noqa: F401  -- see _prepare_caller
import functools
import math
import os
import select
import selectors
import ssl  # noqa: F401  -- see _prepare_caller
import sys
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .errors import ShinkenError
from .framebudget import USE_GLOBAL, BudgetSetting, budget_for_loop
from .native import native

if TYPE_CHECKING:
    import _thread

T = TypeVar("T")
_SharedLoopT = TypeVar("_SharedLoopT", bound="SharedLoop")

START_TIMEOUT = 10.0
"""Seconds the loop thread may take to come up before the caller gives up."""

CLOSE_TIMEOUT = 10.0
"""Seconds ``close()`` (and interpreter exit) waits for a graceful shutdown."""

LIVENESS_POLL = 1.0
"""A waiter re-checks that its loop is alive (thread running, same pid) this often."""

MAX_STARTS_PER_TURN = 64
"""Submitted coroutines the loop starts per loop turn (read at every turn).

A burst (1024 greenlets each calling ``step()`` at once) is started in slices
of this many, one slice per turn, so timers and replies run between slices
instead of waiting out the whole burst. None = start everything at once."""

MAX_EVENTS_PER_SELECT = 32
"""Ready sockets the loop handles per select (read when the loop is built).

A lockstep round's replies land within a few ms; handling all 1024 ready
sockets in one turn starves timers for as long. The selectors here are
level-triggered, so a socket left over is simply reported again at the next
select. None = no bound."""


class LoopThreadDied(ShinkenError):
    """The SharedLoop's thread is gone (it died, or this process is a fork child
    holding a call or a sandbox from the parent's loop). Nothing running on that
    loop will complete; sandboxes bound to it must be reconnected."""


class LoopClosed(ShinkenError, RuntimeError):
    """The SharedLoop was closed before or while this call ran."""


class LoopTimeout(ShinkenError, TimeoutError):
    """A blocking wait on the loop ran out of time; the coroutine was cancelled."""

    def __init__(self, message: str, *, timeout: float):
        super().__init__(message)
        self.timeout = timeout


class AsyncClosable(Protocol):
    async def close(self) -> Any: ...


# native() gives Any; these are _thread's own functions (gevent's originals are those).
_native_allocate_lock: Callable[[], _thread.LockType] = native("_thread", "allocate_lock")
_native_get_ident: Callable[[], int] = native("_thread", "get_ident")


class _Gevent:
    """The gevent pieces a waiter needs, looked up once (gevent may be imported
    after this module, so not at import time)."""

    def __init__(self) -> None:
        import gevent
        from gevent.hub import Waiter, _get_hub

        self.get_hub = gevent.get_hub
        self.get_hub_if_exists = _get_hub  # the thread's hub, or None; never creates one
        self.Waiter = Waiter


_gevent: _Gevent | None = None


def _gevent_hub() -> Any:
    """The current thread's gevent hub when a wait here must be cooperative.

    That is: the process is monkey-patched, or this thread already runs a hub
    (greenlets spawned without patching). Otherwise None: block the thread.
    """
    global _gevent
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None:
        return None
    if _gevent is None:
        _gevent = _Gevent()
    if monkey.is_module_patched("threading"):
        return _gevent.get_hub()
    return _gevent.get_hub_if_exists()


# -- waking a waiter from the loop thread ------------------------------------


class _LockWaiter:
    """A plain thread waits on a native lock the loop thread releases."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = _native_allocate_lock()
        self._lock.acquire()

    def wake(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # woken twice (a completion racing a death notice)
            pass

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(True, timeout)


class _HubWaker:
    """Wakes greenlets of one hub from any thread.

    Other threads only append to a deque and ``send()`` one async watcher; the
    watcher's callback runs in the hub's own thread and switches to each queued
    waiter there. The watcher is unreferenced: it never keeps the hub alive on
    its own (each wait's timer does), so ``gevent.wait()`` semantics are intact.
    """

    def __init__(self, hub: Any) -> None:
        self._queued: collections.deque[Any] = collections.deque()
        # True from the send() until the drain finds the queue empty: wakes in
        # between only append. A burst of 1024 completions then costs a few
        # watcher sends instead of 1024 (each a syscall, and a GIL hand-off to
        # the hub's thread). The lock is held for a few instructions, never
        # across a switch.
        self._armed = False
        self._lock = _native_allocate_lock()
        self._watcher = hub.loop.async_(ref=False)
        self._watcher.start(self._drain)

    def wake(self, waiter: Any) -> None:  # any thread
        with self._lock:
            self._queued.append(waiter)
            if self._armed:
                return
            self._armed = True
        self._watcher.send()

    def _drain(self) -> None:  # the hub's thread
        queued = self._queued
        try:
            while True:
                with self._lock:
                    if not queued:
                        self._armed = False
                        return
                    waiter = queued.popleft()
                waiter.switch(None)
        except BaseException:
            # Never leave the waker armed with nobody coming to drain it.
            with self._lock:
                rearm = self._armed = bool(queued)
            if rearm:
                self._watcher.send()
            raise


_WAKERS: weakref.WeakKeyDictionary[Any, _HubWaker] = weakref.WeakKeyDictionary()


def _hub_waker(hub: Any) -> _HubWaker:
    # Only the hub's own thread creates its waker (a waiter is built where it waits).
    waker = _WAKERS.get(hub)
    if waker is None:
        waker = _WAKERS[hub] = _HubWaker(hub)
    return waker


class _GreenletWaiter:
    """A greenlet parks on a gevent ``Waiter``; another thread reaches it only
    through its hub's :class:`_HubWaker` (the hub then switches to it).

    Cheaper than an ``AsyncResult`` plus a ``gevent.Timeout`` per wait: the
    slice deadline is a raw hub timer that switches in a marker.
    """

    __slots__ = ("_loop", "_waiter", "wake")

    def __init__(self, hub: Any) -> None:
        assert _gevent is not None  # _gevent_hub() found the hub
        self._loop = hub.loop
        self._waiter = _gevent.Waiter(hub)
        self.wake = functools.partial(_hub_waker(hub).wake, self._waiter)

    def wait(self, timeout: float) -> bool:
        timer = self._loop.timer(timeout)
        timer.start(self._waiter.switch, _EXPIRED)
        try:
            # Returns at once if the wake came first; the timer is closed before
            # this greenlet can switch again, so a stale expiry never lands.
            return self._waiter.get() is not _EXPIRED
        finally:
            timer.close()


_EXPIRED = object()


class _Outcome:
    """A one-shot result, set once from any thread, waited on by any number of
    threads or greenlets (each with its own waiter)."""

    __slots__ = ("_error", "_lock", "_value", "_wakers", "done")

    def __init__(self) -> None:
        self.done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._wakers: list[Callable[[], None]] = []
        self._lock = _native_allocate_lock()  # never held across a wait or a switch

    def set(self, value: Any = None, error: BaseException | None = None) -> bool:
        with self._lock:
            if self.done:
                return False
            self._value, self._error = value, error
            self.done = True
        # A waiter appends its waker before re-reading `done`, and `done` is set
        # before this snapshot, so every waiter is either in it or sees `done`.
        for wake in list(self._wakers):
            wake()
        return True

    def wait(self, timeout: float | None, check_alive: Callable[[], None]) -> Any:
        if not self.done:
            hub = _gevent_hub()
            waiter = _GreenletWaiter(hub) if hub is not None else _LockWaiter()
            self._wakers.append(waiter.wake)
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self.done:
                budget = LIVENESS_POLL
                if deadline is not None:
                    budget = min(budget, deadline - time.monotonic())
                    if budget <= 0:
                        assert timeout is not None  # a deadline comes from a timeout
                        raise LoopTimeout(f"no result within {timeout} s", timeout=timeout)
                if waiter.wait(budget):
                    continue  # woken: `done` is set (a spurious wake-up just waits on)
                check_alive()
        if self._error is not None:
            raise self._error
        return self._value


# -- the loop itself -----------------------------------------------------------


class _BoundedSelector(selectors.BaseSelector):
    """A selector that reports at most ``limit`` ready files per ``select()``.

    Wraps whatever ``selectors.DefaultSelector`` is in this thread (epoll, or
    gevent's selector bound to the loop thread's hub under patching). Both are
    level-triggered: a file left out is reported again by the next select, so
    nothing is lost, only deferred by one turn. With epoll the kernel returns
    at most ``limit`` events itself and rotates its ready list, so no socket
    waits behind a busy one for more than a turn or two.
    """

    def __init__(self, inner: selectors.BaseSelector, limit: int) -> None:
        self._inner = inner
        self._limit = limit
        # Gevent's patching removes selectors.EpollSelector (and select.epoll).
        epoll_class = getattr(selectors, "EpollSelector", None)
        self._epoll: select.epoll | None = (
            inner._selector if epoll_class and isinstance(inner, epoll_class) else None
        )

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self._epoll is None:
            return self._inner.select(timeout)[: self._limit]
        return self._select_epoll(timeout)

    def _select_epoll(self, timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
        # selectors.EpollSelector.select with maxevents = limit (same rounding).
        if timeout is None:
            timeout = -1
        elif timeout <= 0:
            timeout = 0
        else:
            timeout = math.ceil(timeout * 1e3) * 1e-3
        assert self._epoll is not None  # select() comes here only with an epoll
        try:
            fd_events = self._epoll.poll(timeout, self._limit)
        except InterruptedError:
            return []
        ready = []
        key_of = self._inner.get_map().get  # public: the private _key_from_fd is gone in 3.12
        for fd, event in fd_events:
            events = 0
            if event & ~select.EPOLLIN:
                events |= selectors.EVENT_WRITE
            if event & ~select.EPOLLOUT:
                events |= selectors.EVENT_READ
            key = key_of(fd)
            if key:
                ready.append((key, events & key.events))
        return ready


def new_fair_event_loop() -> asyncio.AbstractEventLoop:
    """A new asyncio loop that handles at most :data:`MAX_EVENTS_PER_SELECT`
    ready sockets per select (None: a plain ``asyncio.new_event_loop()``).

    The SharedLoop runs on one; the async face may too, for the same reason
    (a lockstep round's replies land together)::

        loop = shinken_sync.sharedloop.new_fair_event_loop()
        loop.run_until_complete(main())      # or asyncio.Runner(loop_factory=...) on 3.11+

    Call it in the thread that will run the loop (under gevent patching the
    selector binds to that thread's hub).
    """
    limit = MAX_EVENTS_PER_SELECT
    if limit is None:
        return asyncio.new_event_loop()
    return asyncio.SelectorEventLoop(_BoundedSelector(selectors.DefaultSelector(), limit))


def _new_loop() -> asyncio.AbstractEventLoop:
    """The loop thread's event loop: uvloop under the ``fast`` transport (see
    :mod:`shinken_sync.transport`), else :func:`new_fair_event_loop`.

    Built in the loop thread: under gevent patching ``DefaultSelector`` is then
    gevent's selector bound to this thread's hub (DNS and executors need it).
    """
    from .transport import uses_uvloop

    if uses_uvloop():  # the [fast] extra; libuv handles its own polling (no per-select bound)
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()  # uvloop is Any here (setup.cfg)
        return loop
    return new_fair_event_loop()


# -- one incarnation of the loop thread --------------------------------------


class _LoopThread:
    """One native thread and the loop built inside it (a fork child gets a new one)."""

    def __init__(self, owner: SharedLoop) -> None:
        self.name = owner.name
        self.frame_budget_bytes = owner.frame_budget_bytes
        self.pid = os.getpid()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ident: int | None = None
        self.ready = _Outcome()
        self.exited = _Outcome()
        self.pending: set[LoopFuture[Any]] = set()
        # Submissions wait here; one scheduled drain starts them all, so a burst
        # of calls costs one self-pipe write and one loop wake-up, not one each.
        self.inbox: collections.deque[tuple[LoopFuture[Any], Coroutine[Any, Any, Any]]] = collections.deque()
        self.inbox_scheduled = False
        self.resources: weakref.WeakSet[AsyncClosable] = weakref.WeakSet()
        self.closing = False  # close() asked; the thread drains and exits
        self.serving = False  # inside run_forever (as opposed to starting or draining)
        self.dead: BaseException | None = None  # why the thread stopped serving, once it has

    def start(self) -> None:
        native("_thread", "start_new_thread")(self._main, ())

    def check_alive(self) -> None:
        if self.pid != os.getpid():
            raise LoopThreadDied(f"{self.name}: this call belongs to the parent process's loop (fork)")
        if self.dead is not None:
            raise self.dead

    # The thread itself.

    def _main(self) -> None:
        death: BaseException | None = None
        try:
            loop = _new_loop()
            asyncio.set_event_loop(loop)
            self.loop, self.ident = loop, _native_get_ident()
            if self.frame_budget_bytes is not USE_GLOBAL:  # the loop's own, before any connection
                budget_for_loop(loop, self.frame_budget_bytes)
            loop.call_soon(self.ready.set)
            self.serving = True
            loop.run_forever()
        except BaseException as exc:  # noqa: BLE001 -- anything escaping run_forever kills the thread
            death = exc
        self.serving = False
        # Waiters learn first; the best-effort cleanup below may take a while.
        if death is None and self.closing:
            reason: BaseException = LoopClosed(f"{self.name} closed")
        else:
            reason = LoopThreadDied(f"{self.name}: the loop thread died ({death!r})")
            reason.__cause__ = death
        self.dead = reason
        self.closing = True
        self._fail_pending(reason)
        self.ready.set(error=reason)
        try:
            if self.loop is not None:
                try:
                    self.loop.run_until_complete(self._drain())
                finally:
                    self.loop.close()
        except BaseException:  # noqa: BLE001, S110 -- a broken loop cannot drain; waiters already know
            pass
        finally:
            while self.inbox:  # posted after the loop closed: never started
                future, coro = self.inbox.popleft()
                coro.close()
                future._settle(error=reason)
            self._fail_pending(reason)
            self.exited.set()

    def post(self, future: LoopFuture[Any], coro: Coroutine[Any, Any, Any]) -> None:
        """Hand ``coro`` to the loop (any thread). Append first, then check the
        flag; the drain clears the flag before popping: nothing is stranded."""
        self.inbox.append((future, coro))
        if not self.inbox_scheduled:
            self.inbox_scheduled = True
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._drain_inbox)

    def _drain_inbox(self) -> None:
        """Start at most :data:`MAX_STARTS_PER_TURN` submissions, then yield the
        turn (the rest start from the next one, after I/O and timers ran)."""
        inbox = self.inbox
        budget = MAX_STARTS_PER_TURN
        started = 0
        while inbox and (budget is None or started < budget):
            future, coro = inbox.popleft()
            future._start(coro)
            started += 1
        if inbox:  # still scheduled: post() need not wake the loop again
            assert self.loop is not None
            self.loop.call_soon(self._drain_inbox)
            return
        self.inbox_scheduled = False
        # A post() between the emptiness check and the flag reset saw the flag
        # still set and did not schedule: pick its item up now.
        if inbox and not self.inbox_scheduled:
            self.inbox_scheduled = True
            assert self.loop is not None
            self.loop.call_soon(self._drain_inbox)

    def stop(self) -> None:
        """Leave run_forever (and so drain). On the loop thread; a no-op once draining."""
        if self.serving:
            assert self.loop is not None
            self.loop.stop()

    def _fail_pending(self, reason: BaseException) -> None:
        for future in list(self.pending):
            future._settle(error=reason)

    async def _drain(self) -> None:
        """Close tracked resources, then cancel and reap every other task."""
        resources = [asyncio.ensure_future(r.close()) for r in list(self.resources)]
        if resources:
            await asyncio.wait(resources, timeout=CLOSE_TIMEOUT / 2)
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT / 4)
        for task in tasks + resources:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a close error at shutdown is not worth a log line
        loop = asyncio.get_running_loop()
        await loop.shutdown_asyncgens()
        await loop.shutdown_default_executor()


# -- the handle a caller holds for one submitted coroutine -------------------


class LoopFuture(Generic[T]):
    """A coroutine submitted to a :class:`SharedLoop`, waitable from any thread or greenlet.

    Like :class:`concurrent.futures.Future`: ``result(timeout)`` waits without
    cancelling on timeout; ``cancel()`` asks the loop to cancel the task, whose
    ``result()`` then raises :class:`concurrent.futures.CancelledError`.
    """

    __slots__ = ("__weakref__", "_outcome", "_task", "_thread")

    def __init__(self, thread: _LoopThread) -> None:
        self._thread = thread
        self._outcome = _Outcome()
        self._task: asyncio.Task[T] | None = None

    def done(self) -> bool:
        return self._outcome.done

    def result(self, timeout: float | None = None) -> T:
        """The coroutine's result (or its exception, raised here).

        Raises :class:`LoopTimeout` after ``timeout`` seconds (None: no
        deadline, but a dead loop thread is still noticed), and
        :class:`LoopThreadDied`/:class:`LoopClosed` when the loop goes away.
        """
        value: T = self._outcome.wait(timeout, self._thread.check_alive)  # _Outcome holds Any
        return value

    def cancel(self) -> None:
        if self._outcome.done:
            return
        loop = self._thread.loop
        assert loop is not None  # a future exists only once its loop runs
        try:
            loop.call_soon_threadsafe(self._cancel_in_loop)
        except RuntimeError:  # loop already closed: the exiting thread settles every pending future
            pass

    # Loop-thread side. submit() posts _start before it returns the future, and
    # cancel() schedules after that, so _cancel_in_loop always runs after _start.

    def _start(self, coro: Coroutine[Any, Any, T]) -> None:
        if self._thread.closing:
            coro.close()
            self._settle(error=self._thread.dead or LoopClosed(f"{self._thread.name} is closing"))
            return
        self._task = asyncio.ensure_future(coro)
        self._task.add_done_callback(self._on_done)

    def _cancel_in_loop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _on_done(self, task: asyncio.Task[T]) -> None:
        if task.cancelled():
            if self._thread.closing:
                self._settle(error=self._thread.dead or LoopClosed(f"{self._thread.name} closed mid-call"))
            else:
                self._settle(error=concurrent.futures.CancelledError())
            return
        error = task.exception()
        if error is not None:
            self._settle(error=error)
        else:
            self._settle(task.result())

    def _settle(self, value: Any = None, error: BaseException | None = None) -> None:
        self._thread.pending.discard(self)
        self._outcome.set(value, error)


# -- the public handle --------------------------------------------------------

_INSTANCES: weakref.WeakSet[SharedLoop] = weakref.WeakSet()
# Loops with a running thread are held strongly until closed: one the program
# dropped still has a thread, and exit must still stop it.
_STARTED: set[SharedLoop] = set()
_FORK_ORPHANS: list[_LoopThread] = []
_exit_hook_registered = False


class SharedLoop:
    """One native thread running one asyncio loop, shared by blocking callers.

    ``SharedLoop.default()`` is the lazily created process-wide instance every
    :func:`shinken_sync.connect` uses unless given ``loop=``; make your own for
    an isolated loop (its own thread, its own frame budget). The thread starts on
    first use. Use from any thread or greenlet, never from the loop thread itself
    (there, ``await`` the coroutine instead).
    """

    _default: SharedLoop | None = None
    _default_lock = _native_allocate_lock()

    def __init__(self, name: str = "shinken-loop", *, frame_budget_bytes: BudgetSetting = USE_GLOBAL) -> None:
        """``frame_budget_bytes``: this loop's byte budget for queued screencast
        frames (None = off); not given, ``client.GLOBAL_FRAME_BUDGET_BYTES`` as
        it is when the loop's first connection opens."""
        if frame_budget_bytes is not USE_GLOBAL and frame_budget_bytes is not None and frame_budget_bytes < 0:
            raise ValueError(f"frame_budget_bytes must be >= 0 or None, not {frame_budget_bytes}")
        self.name = name
        self.frame_budget_bytes = frame_budget_bytes
        self._lock = _native_allocate_lock()  # guards state changes only; never held across a wait
        self._thread: _LoopThread | None = None
        self._closed = False
        _INSTANCES.add(self)

    @classmethod
    def default(cls) -> SharedLoop:
        """The process-wide loop; a closed or dead default is replaced on the next call."""
        loop = cls._default
        if loop is None or not loop._usable():
            with cls._default_lock:
                loop = cls._default
                if loop is None or not loop._usable():
                    loop = cls._default = cls("shinken-default-loop")
        return loop

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The asyncio loop (starting the thread if needed). Hand it to code that
        schedules its own callbacks with ``call_soon_threadsafe``."""
        loop = self._running().loop
        assert loop is not None
        return loop

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block this thread (or only this greenlet,
        under gevent) until it finishes.

        After ``timeout`` seconds the coroutine is cancelled and
        :class:`LoopTimeout` raised. ``timeout=None`` waits as long as the
        coroutine runs; the loop's death still ends the wait.
        """
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            # Our deadline, or the caller itself interrupted (KeyboardInterrupt,
            # a killed greenlet): the coroutine has no one left to report to.
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> LoopFuture[T]:
        """Schedule ``coro`` on the loop and return at once with its :class:`LoopFuture`."""
        try:
            thread = self._running()
            if thread.ident == _native_get_ident():
                raise RuntimeError(f"{self.name}: a blocking call from the loop thread itself would deadlock")
            if thread.closing:
                raise thread.dead or LoopClosed(f"{self.name} is closing")
            future: LoopFuture[T] = LoopFuture(thread)
            thread.pending.add(future)
            try:
                thread.post(future, coro)
            except RuntimeError:  # the loop closed under us
                thread.pending.discard(future)
                with contextlib.suppress(ValueError):
                    thread.inbox.remove((future, coro))
                raise thread.dead or LoopClosed(f"{self.name} closed") from None
        except BaseException:
            coro.close()  # never leave a "coroutine was never awaited" behind
            raise
        return future

    def track(self, resource: AsyncClosable) -> None:
        """Close ``resource`` (awaiting its ``close()``) when this loop shuts down.

        Held weakly: a resource that is garbage-collected drops out. The
        blocking facade tracks every sandbox it opens, so an interpreter exiting
        with sandboxes still open closes their connections cleanly.
        """
        thread = self._running()
        if thread.ident == _native_get_ident():
            thread.resources.add(resource)
        else:
            assert thread.loop is not None
            thread.loop.call_soon_threadsafe(thread.resources.add, resource)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close tracked resources, cancel remaining tasks, stop the loop and wait
        for its thread to exit. Pending and later calls fail with
        :class:`LoopClosed`. Idempotent.

        Raises :class:`LoopTimeout` if the loop does not stop within
        ``timeout`` seconds (something blocks the loop thread); waiters are
        released regardless.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            _STARTED.discard(self)
        if thread is None or thread.pid != os.getpid():
            return
        if thread.ident == _native_get_ident():
            raise RuntimeError(f"{self.name}: close() from the loop thread itself would deadlock")
        deadline = time.monotonic() + timeout
        thread.ready.wait(timeout, thread.check_alive)
        thread.closing = True
        if not thread.exited.done:
            assert thread.loop is not None
            try:
                thread.loop.call_soon_threadsafe(thread.stop)
            except RuntimeError:  # already closed: the thread is on its way out
                pass
            try:
                thread.exited.wait(max(0.0, deadline - time.monotonic()), lambda: None)
            finally:
                thread._fail_pending(LoopClosed(f"{self.name} closed"))

    def __enter__(self: _SharedLoopT) -> _SharedLoopT:  # noqa: PYI019 - no typing.Self on 3.10
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        thread = self._thread
        state = "closed" if self._closed else "idle" if thread is None else "dead" if thread.dead else "running"
        return f"<SharedLoop {self.name!r} {state}>"

    def _usable(self) -> bool:
        thread = self._thread
        return not self._closed and (thread is None or thread.dead is None)

    def _running(self) -> _LoopThread:
        """The live loop thread, started on first use."""
        thread = self._thread
        if thread is not None and thread.ready.done and thread.dead is None:
            return thread
        with self._lock:
            if self._closed:
                raise LoopClosed(f"{self.name} is closed")
            thread = self._thread
            if thread is None:
                _prepare_caller()
                thread = self._thread = _LoopThread(self)
                thread.start()
                _STARTED.add(self)
                _register_exit_hook()
        thread.ready.wait(START_TIMEOUT, thread.check_alive)
        thread.check_alive()
        return thread


def _prepare_caller() -> None:
    """Under gevent, create this thread's hub before the loop thread starts.

    With patching, import locks are gevent locks: a caller creating its hub for
    the first time while the new thread imports can deadlock both. The modules
    the loop thread needs (asyncio, ssl, idna, the executor) are imported at the
    top of this module for the same reason.
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        import gevent

        gevent.get_hub()


def _register_exit_hook() -> None:
    """Close every loop at interpreter exit, *before* threading joins threads.

    ``threading._register_atexit`` hooks run first in ``threading._shutdown``,
    last-registered first, so this runs before concurrent.futures (imported
    above) shuts its executors down, and while a program thread blocked on a
    sandbox call can still be released instead of hanging the join.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    try:
        threading._register_atexit(_close_all)  # type: ignore[attr-defined]
    except RuntimeError:  # first use during shutdown itself
        import atexit

        atexit.register(_close_all)


def _close_all() -> None:
    for shared in list(_STARTED):
        try:
            shared.close()
        except ShinkenError:  # a wedged loop at exit: nothing better to do than move on
            pass


def _after_fork_in_child() -> None:
    # The parent's loop thread does not exist here. Its objects (sockets shared
    # with the parent, a loop with tasks) stay referenced forever: tearing them
    # down would close the parent's connections or warn. Each loop restarts on
    # first use; inherited waiters notice the pid change within LIVENESS_POLL.
    for shared in list(_INSTANCES):
        shared._lock = _native_allocate_lock()
        if shared._thread is not None:
            _FORK_ORPHANS.append(shared._thread)
            shared._thread = None
    SharedLoop._default_lock = _native_allocate_lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
