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
queued ahead of it). The facade bounds the caller's wait
*again*, at that deadline plus :data:`CALLER_MARGIN`, so even a wedged loop
thread cannot hang a caller: the wait ends with
:class:`~shinken_sync.errors.RPCTimeout`. The margin lets the loop's own, more
precise error arrive first. Three waits have no deadline because the caller
asked for none: ``next_frame(timeout=None)``, iterating a stream, and
``read_file`` of a whole file of unknown size (each chunk call is still
bounded on the loop). A dead loop thread ends those too.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from . import client
from .client import AsyncSandbox, aconnect
from .errors import RPCTimeout
from .sharedloop import LoopThreadDied, LoopTimeout, SharedLoop
from .verbs import VERBS

__all__ = ["CALLER_MARGIN", "CLOSE_DEADLINE", "Sandbox", "ScreencastStream", "connect"]

CALLER_MARGIN = 5.0
"""Seconds a caller waits past a call's own deadline before giving up on the loop."""

CLOSE_DEADLINE = 30.0
"""Bound on ``close()``: the closing handshake plus the reader winding down."""

# A deadline rule maps (the connection's rpc_timeout, bound arguments) to the
# seconds the async core may legitimately take, or None for "as long as the
# caller asked". It may normalise arguments in place (an actions iterator
# becomes a list, so the rule and the call both see every action).
DeadlineRule = Callable[[float, dict[str, Any]], "float | None"]


def _one_call(verb: str) -> DeadlineRule:
    def rule(rpc_timeout: float, args: dict[str, Any]) -> float:
        return client.call_deadline(rpc_timeout, verb, args, args.get("timeout"))

    return rule


def _action_calls(args: dict[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    actions = args.get("actions")
    if actions is None:
        return []  # missing: calling the async method raises the TypeError
    args["actions"] = actions = list(actions)
    calls: list[tuple[str, Mapping[str, Any]]] = []
    for action in actions:
        # A malformed action gets the plain rpc deadline here; the core rejects it.
        call = {k: v for k, v in action.items() if k != "verb"} if isinstance(action, Mapping) else {}
        verb = action.get("verb", "") if isinstance(action, Mapping) else ""
        calls.append((verb, call))
    if args.get("observe") is not None:
        calls.append(("screenshot", {}))
    return calls


def _act_batch_deadline(rpc_timeout: float, args: dict[str, Any]) -> float:
    # One action after another, each with its own deadline from its own send.
    timeout = args.get("timeout")
    return sum(client.call_deadline(rpc_timeout, verb, call, timeout) for verb, call in _action_calls(args))


def _step_deadline(rpc_timeout: float, args: dict[str, Any]) -> float:
    # All in flight at once, run in order: the core's latest deadline, counting
    # every call as sent (a gateway denial only shortens the step).
    return max(
        client.pipelined_deadlines(rpc_timeout, _action_calls(args), args.get("timeout")),
        default=rpc_timeout,
    )


def _read_file_deadline(rpc_timeout: float, args: dict[str, Any]) -> float | None:
    max_bytes = args.get("max_bytes")
    if max_bytes is None:
        return None  # chunk count unknown; each chunk call is bounded on the loop
    chunks = max(1, math.ceil(max_bytes / client.READ_FILE_CHUNK))
    return chunks * client.call_deadline(rpc_timeout, "read_file", args, args.get("timeout"))


def _next_frame_deadline(rpc_timeout: float, args: dict[str, Any]) -> float | None:
    return args.get("timeout")


def _fixed(seconds: float) -> DeadlineRule:
    return lambda rpc_timeout, args: seconds


def _rpc(rpc_timeout: float, args: dict[str, Any]) -> float:
    return rpc_timeout


#: Method name -> the verb it sends, from the verb table (``screencast`` sends
#: ``screencast_start``); these methods get that verb's one-call deadline.
_VERB_OF_METHOD = {verb.method: name for name, verb in VERBS.items()}

_SANDBOX_RULES: dict[str, DeadlineRule] = {
    "read_file": _read_file_deadline,
    "act_batch": _act_batch_deadline,
    "step": _step_deadline,
    "close": _fixed(CLOSE_DEADLINE),
    "__aexit__": _fixed(CLOSE_DEADLINE),
}

_STREAM_RULES: dict[str, DeadlineRule] = {
    "next_frame": _next_frame_deadline,
    "__anext__": _next_frame_deadline,
}

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
    deadline_of = rule or _rpc
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
        if name in rules:
            rule: DeadlineRule | None = rules[name]
        elif name in _VERB_OF_METHOD:
            rule = _one_call(_VERB_OF_METHOD[name])
        else:
            rule = None  # a call's plain rpc_timeout
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


_derive(Sandbox, AsyncSandbox, _SANDBOX_RULES)
_derive(ScreencastStream, client.ScreencastStream, _STREAM_RULES)


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
