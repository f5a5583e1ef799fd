"""The exception tree, classify_exception and is_connection_loss."""

from __future__ import annotations

import asyncio
import copy

import pytest
from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK, InvalidStatus
from websockets.frames import Close

from shinken_sync import errors
from shinken_sync.errors import (
    ActionDenied,
    ActionError,
    ActionTimeout,
    AuthRefused,
    ConnectError,
    ConnectionLost,
    FrameTimeout,
    ProtocolViolation,
    RPCTimeout,
    SandboxClosed,
    SandboxDied,
    ShinkenError,
    Skipped,
    StreamLost,
    classify_exception,
    is_connection_loss,
    is_sandbox_death,
)
from shinken_sync.providers.base import Liveness


def closed_error() -> ConnectionClosedError:
    return ConnectionClosedError(Close(1011, "boom"), None)


@pytest.mark.parametrize(
    "exc, outcome",
    [
        (None, "ok"),
        (ActionError("no", kind="failed"), "error"),
        (ProtocolViolation("bad"), "error"),
        (ValueError("x"), "error"),
        (RPCTimeout("slow"), "timeout"),
        (ActionTimeout("slow", kind="timeout"), "timeout"),
        (asyncio.TimeoutError(), "timeout"),  # noqa: UP041 - distinct class on 3.10
        (FrameTimeout("none"), "timeout"),
        # a dropped connection is not a death: only SandboxDied (the provider or daemon said so) is
        (ConnectionLost(), "connection_lost"),
        (ConnectionLost(liveness=Liveness(alive=True, detail="unknown")), "connection_lost"),
        (SandboxDied(signal=9), "sandbox_died"),
        (SandboxDied.from_liveness(Liveness(alive=False, exit_code=3)), "sandbox_died"),
        (StreamLost("x", stream_id="s", params={}, last_seq=0), "connection_lost"),
        (closed_error(), "connection_lost"),
        (ConnectionClosedOK(Close(1000, ""), Close(1000, ""), True), "connection_lost"),
        (ConnectionResetError(), "connection_lost"),
        (BrokenPipeError(), "connection_lost"),
        (Skipped("later", cause_index=0), "skipped"),
        (ActionDenied("no"), "denied"),
    ],
)
def test_classify_exception(exc, outcome):
    assert classify_exception(exc) == outcome


def test_is_connection_loss_covers_transport_failures_only():
    for exc in (
        ConnectionLost(),
        SandboxDied(),
        closed_error(),
        ConnectionResetError(),
        EOFError(),
        StreamLost("x", stream_id="s", params={}, last_seq=0),
    ):
        assert is_connection_loss(exc), exc
    for exc in (None, ActionError("x", kind="failed"), RPCTimeout("x"), ValueError(), SandboxClosed("x")):
        assert not is_connection_loss(exc), exc


def test_tree_shape():
    assert issubclass(SandboxDied, ConnectionLost)
    assert issubclass(AuthRefused, ConnectError)
    assert issubclass(RPCTimeout, TimeoutError) and issubclass(ActionTimeout, ActionError)
    assert issubclass(SandboxClosed, RuntimeError)
    public = [obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, Exception)]
    assert all(issubclass(cls, ShinkenError) for cls in public if cls.__module__ == errors.__name__)
    for cls in public:  # the docstring draws every class
        if cls.__module__ == errors.__name__:
            assert cls.__name__ in errors.__doc__, cls


def test_sandbox_died_from_liveness_and_copy_keep_the_detail():
    died = SandboxDied.from_liveness(Liveness(alive=False, exit_code=None, signal=9, oom=True, detail="oom"))
    assert (died.signal, died.oom, died.detail) == (9, True, "oom")
    assert "signal 9" in str(died)
    clone = copy.copy(died)  # the client hands each failed call its own copy
    assert (clone.signal, clone.oom, str(clone)) == (9, True, str(died))
    exited = SandboxDied.from_liveness(Liveness(alive=False, exit_code=3))
    assert exited.exit_code == 3 and exited.signal is None


def test_action_error_names_verb_and_kind():
    exc = ActionError("x=5 out of range", kind="bad_args", verb="click", call_id=7)
    assert str(exc) == "click failed (bad_args): x=5 out of range"
    assert copy.copy(exc).kind == "bad_args"


def test_auth_refused_keeps_the_handshake_cause():
    try:
        try:
            raise InvalidStatus(None)  # stands in for the 401 response
        except InvalidStatus as original:
            raise AuthRefused("refused", "ws://x") from original
    except AuthRefused as exc:
        assert isinstance(exc.__cause__, InvalidStatus) and exc.url == "ws://x"


def test_errors_pickle_with_their_fields():
    import pickle

    lost = StreamLost("gone", stream_id="s1", params={"fps": 5.0}, last_seq=12)
    again = pickle.loads(pickle.dumps(lost))
    assert (type(again), again.stream_id, again.params, again.last_seq, str(again)) == (
        StreamLost,
        "s1",
        {"fps": 5.0},
        12,
        "gone",
    )
    timeout = pickle.loads(pickle.dumps(RPCTimeout("slow", verb="wait", call_id=3, timeout=1.5)))
    assert (timeout.verb, timeout.call_id, timeout.timeout) == ("wait", 3, 1.5)


def test_only_a_confirmed_death_is_a_sandbox_death_and_the_verdict_survives_copy_and_pickle():
    import pickle

    alive = Liveness(alive=True, detail="unknown")
    lost = ConnectionLost("dropped", code=1006, liveness=alive)
    died = SandboxDied.from_liveness(Liveness(alive=False, signal=9, oom=True, detail="cgroup oom_kill"))
    assert not is_sandbox_death(lost) and not is_sandbox_death(ConnectionResetError())
    assert is_sandbox_death(died) and is_connection_loss(died) and is_connection_loss(lost)
    for clone in (copy.copy(lost), pickle.loads(pickle.dumps(lost))):
        assert clone.liveness == alive and clone.code == 1006
    clone = pickle.loads(pickle.dumps(died))
    assert clone.oom and clone.signal == 9 and clone.liveness == died.liveness and "OOM-killed" in str(clone)
