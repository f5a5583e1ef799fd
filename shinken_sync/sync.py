"""The blocking face of the SDK: :func:`connect` and :class:`Sandbox`.

A :class:`Sandbox` is a thin handle on an :class:`~shinken_sync.client.AsyncSandbox`
that lives on a :class:`~shinken_sync.sharedloop.SharedLoop` thread. Each
method submits the async method of the same name to that loop and waits (a
plain thread blocks; under gevent only the calling greenlet does). The async
objects are only ever touched by the loop thread.

The facade is *derived*, not written: every public coroutine method and
property of ``AsyncSandbox`` (and of its ``ScreencastStream``) gets a blocking
twin with the same name, signature and docstring, and the async context
manager / iterator protocols become their sync counterparts. The two surfaces
cannot drift; ``tests/sdk/test_sync.py`` checks it anyway.

Deadlines on the caller's side
------------------------------
The async core bounds every call (``rpc_timeout``, or ``timeout=``, plus the
duration of verbs that wait on purpose, and in a pipelined ``step`` of those
queued ahead of it). The facade bounds the caller's wait *again*, at the
deadline the protocol object gives for the method
(:data:`shinken_sync.client_protocol.SANDBOX_DEADLINES`) plus :data:`CALLER_MARGIN`, so even a wedged loop
thread cannot hang a caller: the wait ends with
:class:`~shinken_sync.errors.RPCTimeout`. The margin lets the loop's own, more
precise error arrive first. Three waits have no deadline because the caller
asked for none: any call with ``timeout=None`` (``DEFAULT`` is the bounded default),
``next_frame(timeout=None)``, iterating a stream, and
``read_file`` of a whole file of unknown size (each chunk call is still
bounded on the loop). A dead loop thread ends those too.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

from . import client, client_protocol
from .client import AsyncSandbox, aconnect
from .client_protocol import CLOSE_DEADLINE
from .errors import RPCTimeout
from .sharedloop import LoopThreadDied, LoopTimeout, SharedLoop

__all__ = ["CALLER_MARGIN", "CLOSE_DEADLINE", "Sandbox", "ScreencastStream", "connect"]

CALLER_MARGIN = 5.0
"""Seconds a caller waits past a call's own deadline before giving up on the loop."""

# The deadline rules (which seconds each method may take) belong to the
# protocol object; the facade only adds CALLER_MARGIN on top.
DeadlineRule = client_protocol.DeadlineRule

# async protocol method -> its blocking counterpart
_PROTOCOLS = {"__aenter__": "__enter__", "__aexit__": "__exit__", "__aiter__": "__iter__", "__anext__": "__next__"}

# async class -> its facade, filled in as facades are derived
_FACADES: dict[type, type[_Facade]] = {}


class _Facade:
    """What every derived facade holds: the async object, the loop that owns it
    and the connection's ``rpc_timeout`` (a stream inherits its sandbox's)."""

    __slots__ = ("__weakref__", "_async", "_pid", "_rpc_timeout", "_shared")

    def __init__(self, target: Any, loop: SharedLoop, rpc_timeout: float | None = None) -> None:
        self._async = target
        self._shared = loop
        self._rpc_timeout = target.rpc_timeout if rpc_timeout is None else rpc_timeout
        self._pid = os.getpid()

    def _target(self) -> Any:
        if self._pid != os.getpid():
            raise LoopThreadDied(
                f"{type(self).__name__} was opened in process {self._pid}, before a fork; "
                "connect again in this process"
            )
        return self._async

    def _wait(self, name: str, coro: Any, deadline: float | None) -> Any:
        budget = None if deadline is None else deadline + CALLER_MARGIN
        try:
            result = self._shared.run(coro, budget)
        except LoopTimeout as exc:
            raise RPCTimeout(
                f"{name}: the loop gave no answer within {budget:g} s", verb=name, timeout=budget or 0.0
            ) from exc
        if result is self._async:
            return self
        facade = _FACADES.get(type(result))
        return facade(result, self._shared, self._rpc_timeout) if facade is not None else result


def _blocking(name: str, function: Callable[..., Any], rule: DeadlineRule | None) -> Callable[..., Any]:
    signature = inspect.signature(function)
    is_coroutine = inspect.iscoroutinefunction(function)
    deadline_of = rule or client_protocol.plain_rpc
    params = list(signature.parameters.values())[1:]  # after self
    # For signatures made only of named parameters, naming the positional
    # arguments is all the deadline rules need: a fraction of Signature.bind's
    # cost on the hot path. Calling the async method then checks the arguments.
    simple = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]

    def method(self: _Facade, *args: Any, **kwargs: Any) -> Any:
        target = self._target()
        if simple and len(args) <= len(positional) and not kwargs.keys() & positional[: len(args)]:
            arguments = dict(zip(positional, args))
            arguments.update(kwargs)
            deadline = deadline_of(self._rpc_timeout, arguments)
            call_args: tuple[Any, ...] = (target,)
            call_kwargs = arguments
        else:  # unusual: let bind raise the TypeError the async method would
            bound = signature.bind(target, *args, **kwargs)
            deadline = deadline_of(self._rpc_timeout, bound.arguments)
            call_args, call_kwargs = bound.args, bound.kwargs
        if is_coroutine:
            coro = function(*call_args, **call_kwargs)
        else:
            coro = _on_loop(function, call_args, call_kwargs)
        return self._wait(name, coro, deadline)

    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__doc__ = function.__doc__
    return method


async def _on_loop(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a plain method on the loop thread: it may touch loop-owned state."""
    return function(*args, **kwargs)


def _next(anext: Callable[..., Any]) -> Callable[..., Any]:
    def __next__(self: _Facade) -> Any:
        try:
            return anext(self)
        except StopAsyncIteration:
            raise StopIteration from None

    __next__.__doc__ = anext.__doc__
    return __next__


def _mirror_property(name: str, prop: property) -> property:
    return property(lambda self: getattr(self._async, name), doc=prop.__doc__)


def _derive(facade: type[_Facade], source: type, rules: Mapping[str, DeadlineRule]) -> None:
    """Give ``facade`` a blocking twin of every public member of ``source``."""
    unknown = set(rules) - set(dir(source))
    if unknown:
        raise TypeError(f"deadline rules for {sorted(unknown)}, which {source.__name__} lacks")
    for name in dir(source):
        if name.startswith("_") and name not in _PROTOCOLS:
            continue
        member = inspect.getattr_static(source, name)
        if isinstance(member, property):
            setattr(facade, name, _mirror_property(name, member))
            continue
        if not callable(member):
            continue
        rule = rules.get(name)  # None: a call's plain rpc_timeout
        method = _blocking(name, member, rule)
        target_name = _PROTOCOLS.get(name, name)
        if target_name == "__next__":
            method = _next(method)
        method.__name__ = target_name
        method.__qualname__ = f"{facade.__name__}.{target_name}"
        method.__module__ = facade.__module__
        setattr(facade, target_name, method)
    _FACADES[source] = facade


class Sandbox(_Facade):
    """A blocking connection to one sandbox. Create it with :func:`connect`.

    Every method of :class:`~shinken_sync.client.AsyncSandbox` exists here with
    the same name, arguments, results and errors, and blocks until done; use it
    as a context manager or call :meth:`close`. One ``Sandbox`` may be used from
    several threads (or greenlets) at once. ``Sandbox(async_sandbox, loop)``
    wraps an ``AsyncSandbox`` that lives on ``loop``.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<Sandbox {self._async.sandbox_id} {self._async.url}>"


class ScreencastStream(_Facade):
    """A blocking screencast: ``for frame in stream`` or :meth:`next_frame`.

    The blocking twin of :class:`shinken_sync.client.ScreencastStream`.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<ScreencastStream {self._async.stream_id}>"


_derive(Sandbox, AsyncSandbox, client_protocol.SANDBOX_DEADLINES)
_derive(ScreencastStream, client.ScreencastStream, client_protocol.STREAM_DEADLINES)


def connect(url: str, token: str | None = None, *, loop: SharedLoop | None = None, **kwargs: Any) -> Sandbox:
    async def open_sandbox() -> AsyncSandbox:
        sandbox = await aconnect(url, token, **kwargs)
        shared.track(sandbox)  # closed cleanly if still open when the loop shuts down
        return sandbox

    shared = loop if loop is not None else SharedLoop.default()
    deadline = kwargs.get("open_timeout", client.DEFAULT_OPEN_TIMEOUT) + CALLER_MARGIN
    try:
        sandbox = shared.run(open_sandbox(), deadline)
    except LoopTimeout as exc:
        raise RPCTimeout(f"connect: the loop gave no answer within {deadline:g} s", timeout=deadline) from exc
    return Sandbox(sandbox, shared)


def _connect_signature() -> inspect.Signature:
    params = list(inspect.signature(aconnect).parameters.values())
    loop = inspect.Parameter("loop", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="SharedLoop | None")
    first_keyword = next(i for i, p in enumerate(params) if p.kind is inspect.Parameter.KEYWORD_ONLY)
    params.insert(first_keyword, loop)
    return inspect.signature(aconnect).replace(parameters=params, return_annotation="Sandbox")


connect.__signature__ = _connect_signature()  # type: ignore[attr-defined]
connect.__doc__ = (
    "Dial one sandbox and return a blocking :class:`Sandbox` for it.\n\n"
    "Takes every argument of :func:`shinken_sync.client.aconnect`, plus ``loop``: the\n"
    ":class:`~shinken_sync.sharedloop.SharedLoop` the connection lives on (default: the\n"
    "process-wide ``SharedLoop.default()``).\n\n" + inspect.cleandoc(aconnect.__doc__ or "")
)
