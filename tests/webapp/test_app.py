"""The Flask adapter: routes, error shapes, headers under real gunicorn, embedded reference backend."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

import psutil
import pytest

from webapp.app import CORE_EXTENSION_KEY, create_app
from webapp.core import CoreConfig, Reply
from webapp.local_shard import _as_ipc_reply


@pytest.fixture(scope="module")
def backend(reference_backend_factory):
    return reference_backend_factory(r3_layers=4, r3_topk=4)


@pytest.fixture(scope="module")
def client(backend):
    app = create_app(CoreConfig(backend_url=backend.url, routing_replay_layers=4))
    yield app.test_client()
    app.extensions[CORE_EXTENSION_KEY].close()


def test_routes_and_lifecycle(client):
    created = client.post("/sessions")
    assert created.status_code == 200
    sid = created.get_json()["session_id"]
    turn = client.post(f"/sessions/{sid}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]})
    assert turn.status_code == 200 and turn.mimetype == "application/json"
    assert "routed_experts" not in turn.get_json()["choices"][0]["meta_info"]
    got = client.get(f"/sessions/{sid}")
    assert got.status_code == 200
    assert int(got.headers["Content-Length"]) == len(got.data)
    record = got.get_json()["records"][0]
    assert "routed_experts" in record["response"]["choices"][0]["meta_info"]
    deleted = client.delete(f"/sessions/{sid}")
    assert deleted.status_code == 204 and deleted.data == b"" and "Content-Type" not in deleted.headers
    assert client.delete(f"/sessions/{sid}").status_code == 410
    assert client.get(f"/sessions/{sid}").get_json() == {"error": f"session reclaimed: session_id={sid} (the trainer "
                                                         "released this session and is no longer waiting for the agent)"}


@pytest.mark.parametrize("method, path, status", [
    ("get", "/nope", 404), ("put", "/sessions", 405), ("patch", "/sessions/x", 405),
])
def test_http_errors_have_the_error_shape(client, method, path, status):
    resp = getattr(client, method)(path)
    assert resp.status_code == status and isinstance(resp.get_json()["error"], str)


def test_bad_json_and_wrong_types_are_400(client):
    sid = client.post("/sessions").get_json()["session_id"]
    for data, code in ((b"{", "invalid_json"), (b"null", "invalid_json"),
                       (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": 1}), "invalid_field")):
        resp = client.post(f"/sessions/{sid}/v1/chat/completions", data=data,
                           content_type="application/json")
        assert resp.status_code == 400 and resp.get_json()["error"]["code"] == code


def test_chunked_reply_is_handed_over_unjoined():
    chunks = [b'{"a":', b"1", b"}"]
    reply = _as_ipc_reply(Reply(200, chunks))
    assert reply.length == 7 and reply.content_type == "application/json" and reply.body == b""
    assert reply.stream is not None
    handed = list(reply.stream)
    assert all(a is b for a, b in zip(handed, chunks, strict=True)) and reply.stream.consumed == 7


# --- under real gunicorn with the gevent worker -------------------------------------------------

def request(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, list, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        return resp.status, resp.getheaders(), resp.read()
    finally:
        conn.close()


@pytest.mark.integration
def test_gunicorn_headers_big_records_and_embedded_backend(session_server_factory):
    # No SHINKEN_BACKEND_URL: the app starts the reference backend itself (with a sizeable R3).
    server = session_server_factory(env={"SHINKEN_REFERENCE_R3_LAYERS": "48", "SHINKEN_REFERENCE_R3_TOPK": "8"})
    status, headers, body = request(server.url, "POST", "/sessions")
    sid = json.loads(body)["session_id"]
    messages = [{"role": "user", "content": "x" * 2000}]
    answers = []
    for _ in range(3):
        answers.append(request(server.url, "POST", f"/sessions/{sid}/v1/chat/completions",
                               json.dumps({"messages": messages}).encode()))
        assert answers[-1][0] == 200
        messages = messages + [json.loads(answers[-1][2])["choices"][0]["message"],
                               {"role": "user", "content": "next"}]
    answers.append(request(server.url, "GET", f"/sessions/{sid}"))
    answers.append(request(server.url, "DELETE", f"/sessions/{sid}"))
    answers.append(request(server.url, "GET", "/health"))
    for status, headers, body in answers:
        names = [name.lower() for name, _ in headers]
        assert names.count("server") == 1 and names.count("date") == 1, headers
    status, headers, body = answers[3]
    assert status == 200 and int(dict(headers)["Content-Length"]) == len(body) > 3 * 2000 * 48 * 8 * 4
    records = json.loads(body)["records"]
    assert len(records) == 3 and all("routed_experts" in r["response"]["choices"][0]["meta_info"] for r in records)
    assert answers[4][0] == 204 and answers[4][2] == b""

    workers = psutil.Process(server.proc.pid).children(recursive=True)
    embedded = [p for p in workers if "webapp.reference_backend" in " ".join(p.cmdline())]
    assert len(embedded) == 1
    server.close()
    deadline = time.monotonic() + 10
    while embedded[0].is_running() and embedded[0].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not embedded[0].is_running() or embedded[0].status() == psutil.STATUS_ZOMBIE
