"""One error root (webapp.errors.WebappError) carrying the HTTP status every layer's errors
derive from, and the router's one rule mapping them."""

from __future__ import annotations

import inspect

import pytest

from webapp import http_limits, ipc, limits, session_errors, supervisor
from webapp.errors import WebappError
from webapp.ipc import FrameTooLarge, IpcRemoteError, IpcTimeout, IpcVersionMismatch
from webapp.router import RouterConfig, create_app
from webapp.supervisor import ShardUnavailable

MODULES = (session_errors, limits, http_limits, ipc, supervisor)


def _error_classes() -> list[type[BaseException]]:
    return [obj for module in MODULES for _, obj in inspect.getmembers(module, inspect.isclass)
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__]


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda cls: cls.__name__)
def test_every_webapp_error_derives_from_the_one_root_with_a_status(cls: type[BaseException]) -> None:
    assert issubclass(cls, WebappError)
    if isinstance(cls.__dict__.get("status"), property):
        return  # computed per instance (IpcRemoteError)
    assert isinstance(cls.status, int) and 400 <= cls.status <= 599


def test_remote_error_status_says_whether_the_worker_was_busy() -> None:
    assert IpcRemoteError(ipc.WORKER_BUSY, "9 requests running").status == 503
    assert IpcRemoteError("KeyError", "x").status == 500


@pytest.mark.parametrize("exc, status, names_shard", [
    (ShardUnavailable(1, "failed: the worker could not boot"), 503, True),
    (IpcTimeout("no reply to 'get_session' within 30 s"), 504, True),
    (FrameTooLarge(99, 10), 413, False),
    (IpcRemoteError("KeyError", "boom"), 500, True),
    (IpcVersionMismatch(2), 502, True),  # before: no mapping, a 500 with a traceback
])
def test_the_router_answers_each_layers_error_with_its_status(exc: WebappError, status: int,
                                                              names_shard: bool) -> None:
    app = create_app(RouterConfig(workers=2, core={"backend_url": "http://127.0.0.1:9"}))

    def request(shard: int, meta: dict, body: bytes = b"", **kw: object) -> None:
        raise exc

    app.extensions["shinken_supervisor"].request = request
    resp = app.test_client().get("/sessions/abc")
    assert resp.status_code == status
    assert str(exc) in resp.json["error"]
    assert ("shard" in resp.json) is names_shard
