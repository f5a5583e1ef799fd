"""The single-process server's in-process shard: what a worker's channel would do, without one.

The route-parity suite (test_route_parity.py) compares every answer with the multi-process
mode; these check what it cannot reach from outside: a handler that raises, a shard number the
router never sends, a streamed request body.
"""

from __future__ import annotations

import json

import pytest

from webapp.app import CORE_EXTENSION_KEY, create_app
from webapp.core import CoreConfig
from webapp.ipc import Op
from webapp.local_shard import LocalShard


@pytest.fixture(scope="module")
def backend(reference_backend_factory):
    return reference_backend_factory(r3_layers=0)


@pytest.fixture()
def app(backend, tmp_path):
    app = create_app(CoreConfig(backend_url=backend.url, data_dir=str(tmp_path / "data")))
    yield app
    app.extensions[CORE_EXTENSION_KEY].close()


def test_a_handler_that_raises_is_the_router_error_of_a_failed_worker_request(app, monkeypatch):
    client = app.test_client()
    sid = client.post("/sessions").get_json()["session_id"]
    core = app.extensions[CORE_EXTENSION_KEY]

    def boom(session_id: str, include_images: bool = False) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(core, "get_session", boom)
    failed = client.get(f"/sessions/{sid}")
    # The same answer the router gives when a worker's ERROR frame comes back (webapp.router.call).
    assert failed.status_code == 500
    assert failed.get_json() == {"error": "session worker for shard 0: RuntimeError: boom", "shard": 0}
    monkeypatch.undo()
    assert client.get(f"/sessions/{sid}").status_code == 200  # one failed request costs nothing else


def test_the_local_shard_is_shard_0_of_1(backend, tmp_path):
    shard = LocalShard(CoreConfig(backend_url=backend.url, data_dir=str(tmp_path / "data")))
    try:
        assert shard.workers == 1 and [s["state"] for s in shard.status()] == ["ready"]
        with pytest.raises(ValueError, match="shard 0 of 1"):
            shard.request(1, {"op": Op.HEALTH}, timeout=1.0)
        created = shard.request(0, {"op": Op.CREATE_SESSION, "session_id": "local-test-1"}, timeout=1.0)
        assert created.status == 200 and json.loads(created.body)["session_id"] == "local-test-1"
        # a streamed body (the router streams one over INLINE_BODY_MAX) reaches the core whole
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
        reply = shard.request(0, {"op": Op.CHAT, "session_id": "local-test-1"}, timeout=30.0,
                              body_stream=iter([chat[:7], chat[7:]]), body_length=len(chat))
        assert reply.status == 200, reply.body
        bad = shard.request(0, {"op": Op.PROXY, "session_id": "local-test-1"}, timeout=1.0)
        assert bad.status == 400  # the worker's own check of the op's fields, as over a channel
    finally:
        shard.stop()
    assert [s["state"] for s in shard.status()] == ["stopped"]
