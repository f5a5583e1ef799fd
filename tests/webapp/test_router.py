"""The thin router: no session core in its process, API key, deadlines, error shape and
headers, configuration."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import gevent
import psutil
import pytest
import requests
from werkzeug.test import EnvironBuilder

from webapp.ipc import INLINE_BODY_MAX, MAX_BODY_CHUNK
from webapp.ipc_channel import STREAM_WINDOW, IpcClient, IpcReply, IpcServer, open_socket
from webapp.router import RouterConfig, _relay, create_app
from webapp.serve import build_parser
from webapp.sharding import shard_for

KEY = "s3cret-key"


def raw_request(url: str, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheaders(), resp.read()
    finally:
        conn.close()


def header_count(headers: list[tuple[str, str]], name: str) -> int:
    return sum(1 for k, _ in headers if k.lower() == name)


def test_defaults_bind_loopback_and_config_from_env() -> None:
    assert build_parser().parse_args([]).bind == ("127.0.0.1", 8000)
    config = RouterConfig.from_env({"SHINKEN_BACKEND_URL": "http://b", "SHINKEN_WORKERS": "3",
                                    "SHINKEN_API_KEY": "k", "SHINKEN_CONTROL_TIMEOUT": "1.5"})
    assert (config.workers, config.backend_url, config.api_key, config.control_timeout) == (3, "http://b", "k", 1.5)
    assert RouterConfig.from_env({"SHINKEN_BACKEND_URL": "http://b"}).api_key is None
    with pytest.raises(ValueError):
        RouterConfig.from_env({})


class _BigReply:
    status, content_type, headers = 200, "application/json", ()
    body = [b"r" * MAX_BODY_CHUNK] * (2 * STREAM_WINDOW // MAX_BODY_CHUNK)  # stalls on credit


@pytest.mark.parametrize("method", ["HEAD", "GET"])
def test_a_relayed_stream_is_closed_even_when_its_body_is_never_sent(method: str) -> None:
    """HEAD gets the headers only: the worker must still be told to stop streaming at once."""
    a, b = socket.socketpair()
    server = IpcServer(open_socket(b.detach()), lambda meta, body: _BigReply(), name="worker")
    client = IpcClient(open_socket(a.detach()), name="router")
    try:
        reply = client.request({"op": "get_session"}, timeout=5)
        assert reply.stream is not None
        started: list[str] = []
        app_iter = _relay(reply)(EnvironBuilder(method=method).get_environ(),
                                 lambda status, headers: started.append(status))
        sent = b"".join(app_iter)
        app_iter.close()  # what every WSGI server does with the app_iter
        assert started == ["200 OK"]
        assert len(sent) == (reply.length if method == "GET" else 0)
        with gevent.Timeout(5):  # without the close the worker holds the stream for 120 s
            while server._inflight or client._streams:
                gevent.sleep(0.01)
        assert client.request({"op": "get_session"}, timeout=5).length == reply.length
    finally:
        client.close()
        server.close()


def test_health_reports_a_shard_whose_probe_crashed() -> None:
    app = create_app(RouterConfig(workers=2, core={"backend_url": "http://127.0.0.1:9"}))
    supervisor = app.extensions["shinken_supervisor"]

    def request(shard: int, meta: dict, body: bytes = b"", **kw: object) -> IpcReply:
        if shard == 1:
            raise LookupError("probe bug")
        return IpcReply(status=200, content_type="application/json", headers=[], length=2, body=b"{}")

    supervisor.request = request
    resp = app.test_client().get("/health")
    assert resp.status_code == 503 and resp.json["unhealthy_shards"] == [1]
    assert "LookupError('probe bug')" in resp.json["error"]


def test_the_viewer_names_a_shard_that_answered_its_session_list_with_an_error() -> None:
    app = create_app(RouterConfig(workers=2, core={"backend_url": "http://127.0.0.1:9"}))
    supervisor = app.extensions["shinken_supervisor"]

    def request(shard: int, meta: dict, body: bytes = b"", **kw: object) -> IpcReply:
        assert meta["op"] == "viewer_sessions"
        if shard == 1:
            return IpcReply(status=500, content_type="application/json", headers=[], length=2, body=b"{}")
        rows = b'{"sessions":[]}'
        return IpcReply(status=200, content_type="application/json", headers=[], length=len(rows), body=rows)

    supervisor.request = request
    resp = app.test_client().get("/ui/api/sessions")
    assert resp.status_code == 200, resp.data
    assert resp.json["sessions"] == []
    assert resp.json["unavailable"] == ["shard 1: session worker for shard 1 is unavailable: status 500"]


@pytest.mark.integration
def test_router_process_never_imports_the_core_or_a_tokenizer(reference_backend_factory) -> None:
    backend = reference_backend_factory()
    script = textwrap.dedent(f"""
        from gevent import monkey; monkey.patch_all()
        import json, sys
        from webapp.router import RouterConfig, create_app, start_supervisor, stop_supervisor
        app = create_app(RouterConfig(workers=2, core={{"backend_url": {backend.url!r}}}))
        start_supervisor(app)
        assert app.extensions["shinken_supervisor"].wait_ready(60)
        client = app.test_client()
        sid = client.post("/sessions").get_json()["session_id"]
        chat = client.post(f"/sessions/{{sid}}/v1/chat/completions",
                           json={{"messages": [{{"role": "user", "content": "hi"}}]}})
        records = client.get(f"/sessions/{{sid}}")
        statuses = [chat.status_code, records.status_code, client.get("/health").status_code,
                    client.get("/ui/api/sessions").status_code,  # the viewer, fanned out to the workers
                    client.get(f"/ui/api/sessions/{{sid}}/timeline").status_code]
        stop_supervisor(app)
        loaded = sorted(m for m in sys.modules if m.startswith(("webapp", "tokenizers", "shinken_sync")))
        print(json.dumps({{"statuses": statuses, "modules": loaded}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["statuses"] == [200, 200, 200, 200, 200]
    assert "webapp.router" in result["modules"] and "webapp.worker" in result["modules"]
    # (jinja2 is not on the list: Flask itself imports it)
    forbidden = {"webapp.core", "webapp.tito", "webapp.tokenizers", "webapp.backend", "webapp.engines", "webapp.app",
                 "webapp.reference_backend", "webapp.session_errors", "tokenizers", "webapp.viewer_data",
                 "shinken_sync.client", "shinken_sync.fleet_view"}
    assert forbidden.isdisjoint(result["modules"])


@pytest.fixture(scope="module")
def keyed(reference_backend_factory, session_server_factory):
    """workers=2, an API key by flag, a 1 s deadline on control ops, slow hang detection; a
    backend with R3, so a few turns make a records body that crosses the IPC as a stream."""
    backend = reference_backend_factory(r3_layers=16, r3_topk=8)
    return session_server_factory.launch(2, backend.url, "--api-key", KEY, "--heartbeat-timeout", "60",
                                         "--routing-replay-layers", "16", env={"SHINKEN_CONTROL_TIMEOUT": "1"})


@pytest.mark.integration
def test_api_key_is_required_on_every_route_but_health(keyed) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    assert requests.get(f"{keyed.url}/health", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("POST", "/sessions"), ("GET", "/sessions/" + "a" * 32),
                             ("DELETE", "/sessions/" + "a" * 32),
                             ("POST", "/sessions/" + "a" * 32 + "/v1/chat/completions"), ("GET", "/nope")):
            resp = requests.request(method, keyed.url + path, headers=headers, timeout=10)
            assert resp.status_code == 401, (method, path, headers)
            assert "error" in resp.json() and resp.headers["WWW-Authenticate"] == "Bearer"
    sid = requests.post(f"{keyed.url}/sessions", headers=auth, timeout=10).json()["session_id"]
    chat = requests.post(f"{keyed.url}/sessions/{sid}/v1/chat/completions", headers=auth, timeout=30,
                         json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200
    assert requests.get(f"{keyed.url}/sessions/{sid}", headers=auth, timeout=10).status_code == 200


@pytest.mark.integration
def test_api_key_from_environment(reference_backend_factory, session_server_factory) -> None:
    backend = reference_backend_factory()
    server = session_server_factory.launch(1, backend.url, env={"SHINKEN_API_KEY": "from-env"})
    assert requests.post(f"{server.url}/sessions", timeout=10).status_code == 401
    assert requests.post(f"{server.url}/sessions", headers={"Authorization": "Bearer from-env"},
                         timeout=10).status_code == 200


@pytest.mark.integration
def test_one_server_and_one_date_header_and_json_errors(keyed) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    status, headers, body = raw_request(keyed.url, "POST", "/sessions", auth)
    sid = json.loads(body)["session_id"]
    content = json.dumps({"messages": [{"role": "user", "content": "type hello " * 500}]}).encode()
    raw_request(keyed.url, "POST", f"/sessions/{sid}/v1/chat/completions",
                {**auth, "Content-Type": "application/json"}, content)
    cases = [
        ("GET", "/health", {}, 200),
        ("GET", f"/sessions/{sid}", auth, 200),
        ("GET", "/sessions/" + "b" * 32, auth, 404),
        ("GET", "/no/such/route", auth, 404),
        ("PUT", "/sessions", auth, 405),
        ("POST", "/sessions", {}, 401),
        ("DELETE", f"/sessions/{sid}", auth, 204),
    ]
    for method, path, hdrs, expected in cases:
        status, headers, body = raw_request(keyed.url, method, path, hdrs)
        assert status == expected, (method, path, body)
        if path == f"/sessions/{sid}" and method == "GET":  # the streamed relay (> 1 MiB)
            assert len(body) > 1024 * 1024 and json.loads(body)["session_id"] == sid
        if status != 204:
            assert int({k.lower(): v for k, v in headers}["content-length"]) == len(body)
        assert header_count(headers, "server") == 1 and header_count(headers, "date") == 1, headers
        if status >= 400:
            assert set(json.loads(body)) >= {"error"}
            assert {k.lower(): v for k, v in headers}["content-type"] == "application/json"
    # The router's own errors take OpenAI's shape on the OpenAI routes, miles' elsewhere.
    status, _, body = raw_request(keyed.url, "POST", f"/sessions/{sid}/v1/chat/completions", {})
    assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
    assert isinstance(json.loads(raw_request(keyed.url, "GET", f"/sessions/{sid}", {})[2])["error"], str)


@pytest.mark.integration
def test_a_stuck_worker_costs_its_callers_one_deadline_not_forever(keyed) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    owned: dict[int, str] = {}
    while len(owned) < 2:
        sid = requests.post(f"{keyed.url}/sessions", headers=auth, timeout=10).json()["session_id"]
        owned.setdefault(shard_for(sid, 2), sid)
    stuck = next(p for p in psutil.Process(keyed.proc.pid).children(recursive=True)
                 if "shinken-session-worker[0/2]" in " ".join(p.cmdline()))
    stuck.suspend()
    try:
        resp = requests.get(f"{keyed.url}/sessions/{owned[0]}", headers=auth, timeout=30)
        assert resp.status_code == 504 and "shard 0" in resp.json()["error"]
        health = requests.get(f"{keyed.url}/health", timeout=30)
        assert health.status_code == 503 and health.json()["unhealthy_shards"] == [0]
        assert requests.get(f"{keyed.url}/sessions/{owned[1]}", headers=auth, timeout=10).status_code == 200
    finally:
        stuck.resume()
    # the worker wakes up and answers the abandoned requests late: they are dropped, and
    # its next callers get their own answers
    time.sleep(0.2)
    for _ in range(3):
        resp = requests.get(f"{keyed.url}/sessions/{owned[0]}", headers=auth, timeout=10)
        assert resp.status_code == 200 and resp.json()["session_id"] == owned[0]
    assert requests.get(f"{keyed.url}/health", timeout=10).status_code == 200


@pytest.mark.integration
def test_a_chat_the_router_gave_up_on_is_never_committed(reference_backend_factory, stub_backend_factory,
                                                          session_server_factory) -> None:
    """Turns of one session queue on its lock: the ones that cannot finish within the router's
    deadline must fail in the worker (503/502) before the router answers 504, and commit nothing."""
    reference = reference_backend_factory()

    def slow(request: dict):  # each turn holds the session for a second
        time.sleep(1.0)
        req = urllib.request.Request(f"{reference.url}/v1/chat/completions", data=json.dumps(request).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()

    # router deadline per chat: 0.5 + 3 + 2 = 5.5 s; six queued turns need ~6 s
    server = session_server_factory.launch(1, stub_backend_factory(slow), "--read-timeout", "3",
                                           env={"SHINKEN_CONNECT_TIMEOUT": "0.5", "SHINKEN_CHAT_MARGIN": "2"})
    sid = requests.post(f"{server.url}/sessions", timeout=10).json()["session_id"]
    statuses: list[int] = []

    def turn() -> None:
        statuses.append(requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", timeout=30,
                                      json={"messages": [{"role": "user", "content": "hi"}]}).status_code)

    threads = [threading.Thread(target=turn) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(statuses) == 6 and 504 not in statuses and set(statuses) <= {200, 502, 503}, statuses
    assert statuses.count(200) < 6  # some turns did run out of time
    # Six turns with the same messages: each after the first is a retry that replaces the record.
    metadata = requests.get(f"{server.url}/sessions/{sid}", timeout=10).json()["metadata"]
    committed = metadata["num_records"] + metadata["num_rollbacks"]
    assert committed == statuses.count(200) and metadata["num_records"] == min(1, committed)


class _InProcessShard:
    """A shard in the router's process (``takes_body_sockets`` False, as ``LocalShard``): records
    how each request's body arrived."""

    workers, takes_body_sockets = 1, False

    def __init__(self, config: RouterConfig) -> None:
        self.bodies: list[tuple[object, object]] = []

    def request(self, shard: int, meta: dict, body: object = b"", *, body_stream: object = None,
                **kw: object) -> IpcReply:
        self.bodies.append((body, body_stream))
        return IpcReply(status=200, content_type="application/json", headers=[], length=2, body=b"{}")

    def status(self) -> list[dict]:
        return []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


@pytest.mark.parametrize("size", [100, INLINE_BODY_MAX + 1, 3 * INLINE_BODY_MAX])
def test_a_shard_in_process_gets_a_body_of_known_length_as_one_buffer(tmp_path, size: int) -> None:
    """It parses every body whole: a large one too arrives as the one buffer it was received
    into, not as pieces for it to join (a screenshot turn's ~3.6 MB at ``--workers 0``)."""
    app = create_app(RouterConfig(workers=1, core={"backend_url": "http://127.0.0.1:9",
                                                   "data_dir": str(tmp_path / "data")}),
                     shards=_InProcessShard)
    shard = app.extensions["shinken_supervisor"]
    body = b'{"messages":["' + b"x" * (size - 17) + b'"]}'
    resp = app.test_client().post("/sessions/s1/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"})
    assert resp.status_code == 200, resp.data
    [(got, stream)] = shard.bodies
    assert stream is None
    assert bytes(got) == body
