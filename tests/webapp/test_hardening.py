"""Hostile input costs nothing, session server: each limit and refusal against a real
``shinken-session-server`` in both modes (``--workers 0`` and router mode), so every new
setting is shown to reach the core either way."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import subprocess
import threading
import time
from urllib.parse import urlsplit

import psutil
import pytest
import requests

from webapp.limits import (
    MAX_JSON_CONTAINERS,
    MAX_JSON_DEPTH,
    LimitExceeded,
    RequestLimits,
    json_depth_exceeds,
    loads_strict,
)
from webapp.serve import server_argv
from webapp.session_errors import InvalidJSON

pytestmark = pytest.mark.integration

MODES = {"single-process": 0, "router": 1}
LIMIT_FLAGS = ("--max-message-bytes", "2000", "--max-prompt-tokens", "3000", "--max-sessions", "3")


@pytest.fixture(scope="module", params=sorted(MODES))
def limited(request, backend, session_server_factory) -> str:
    """A server with small limits; one per mode."""
    server = session_server_factory.launch(MODES[request.param], backend.url, *LIMIT_FLAGS)
    return server.url


@pytest.fixture
def sid(limited):
    """A fresh session on ``limited``, deleted afterwards (the servers hold only 3)."""
    session_id = _session(limited)
    yield session_id
    requests.delete(f"{limited}/sessions/{session_id}", timeout=30)


def _chat(url: str, sid: str, body: bytes | dict) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{url}/sessions/{sid}/v1/chat/completions", data=data, timeout=60,
                         headers={"Content-Type": "application/json"})


def _session(url: str) -> str:
    resp = requests.post(f"{url}/sessions", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["session_id"]


def _raw(url: str, request: bytes, *, reuse: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = reuse or http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    if conn.sock is None:
        conn.connect()
    conn.sock.sendall(request)
    resp = http.client.HTTPResponse(conn.sock, method="POST")
    resp.begin()
    return resp.status, resp.read()


def test_a_message_over_max_message_bytes_is_413_naming_the_limit(limited, sid) -> None:
    resp = _chat(limited, sid, {"messages": [{"role": "user", "content": "x" * 2001}]})
    # an OpenAI route: OpenAI's error shape
    assert resp.status_code == 413 and "max_message_bytes=2000" in resp.json()["error"]["message"]
    assert resp.json()["error"]["code"] == "limit_exceeded"
    ok = _chat(limited, sid, {"messages": [{"role": "user", "content": "x" * 1900}]})
    assert ok.status_code == 200, ok.text  # nothing was stored by the refused turn


def test_a_prompt_over_max_prompt_tokens_is_413_naming_the_limit(limited, sid) -> None:
    # Each message passes max_message_bytes; together they tokenize (1 token per byte) past 3000.
    messages = [{"role": "user", "content": "y" * 1500}, {"role": "assistant", "content": "z" * 1500},
                {"role": "user", "content": "w" * 100}]
    resp = _chat(limited, sid, {"messages": messages})
    assert resp.status_code == 413 and "max_prompt_tokens=3000" in resp.json()["error"]["message"]
    assert requests.get(f"{limited}/sessions/{sid}", timeout=30).json()["records"] == []


def test_sessions_past_max_sessions_are_429_until_one_is_deleted(limited) -> None:
    before = []
    while len(before) < 10:
        resp = requests.post(f"{limited}/sessions", timeout=30)
        if resp.status_code == 429:
            break
        assert resp.status_code == 200
        before.append(resp.json()["session_id"])
    assert resp.status_code == 429 and "max_sessions=3" in resp.json()["error"], before
    assert len(before) == 3
    assert requests.delete(f"{limited}/sessions/{before[-1]}", timeout=30).status_code == 204
    again = requests.post(f"{limited}/sessions", timeout=30)
    assert again.status_code == 200
    for session_id in [*before[:-1], again.json()["session_id"]]:
        assert requests.delete(f"{limited}/sessions/{session_id}", timeout=30).status_code == 204


@pytest.mark.parametrize("mode", sorted(MODES))
def test_idle_sessions_expire_after_the_ttl(mode, backend, session_server_factory) -> None:
    server = session_server_factory.launch(MODES[mode], backend.url, "--session-idle-ttl", "2.0")
    idle, used = _session(server.url), _session(server.url)
    # Touch one session (each request also runs the lazy sweep) for well over the TTL; any
    # request on the idle one would count as use, so it is only asked at the end.
    until = time.monotonic() + 5.0
    while time.monotonic() < until:
        assert requests.get(f"{server.url}/sessions/{used}", timeout=30).status_code == 200
        time.sleep(0.2)
    assert requests.get(f"{server.url}/sessions/{idle}", timeout=30).status_code == 410  # expired: gone
    assert requests.get(f"{server.url}/sessions/{used}", timeout=30).status_code == 200


@pytest.mark.parametrize("body", [
    b'{"messages":' + b"[" * 1000 + b"]" * 1000 + b"}",
    b'{"messages":' + b"[" * 100_000,
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}',
], ids=["deep-1000", "deep-100k-unclosed", "nan", "infinity"])
def test_deep_nesting_and_non_finite_numbers_are_400_and_the_connection_is_kept(limited, sid, body) -> None:
    parts = urlsplit(limited)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    head = (f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    status, reply = _raw(limited, head + body, reuse=conn)
    assert status == 400, reply
    sock = conn.sock
    status, reply = _raw(limited, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", reuse=conn)
    assert status == 200 and conn.sock is sock  # the same keep-alive connection
    conn.close()


def test_loads_strict_unit() -> None:
    assert loads_strict(b'{"a": [1, {"b": [2.5]}]}') == {"a": [1, {"b": [2.5]}]}
    deep_ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert loads_strict(deep_ok) is not None
    with pytest.raises(InvalidJSON, match="deeper"):
        loads_strict(b"[" + deep_ok + b"]")
    # brackets inside strings do not count
    assert not json_depth_exceeds(json.dumps(["[" * 500]).encode(), 4)
    assert json_depth_exceeds(b'[[[["]"]]]]', 3) and not json_depth_exceeds(b'[[[["]"]]]]', 4)
    # a body of few containers around large strings (a screenshot turn) is measured on its decoded
    # value, many small containers on the text: the same limit either way
    padding = "A" * 200_000
    for depth, refused in ((MAX_JSON_DEPTH, False), (MAX_JSON_DEPTH + 1, True)):
        for pad in ("", padding):
            body = ("[" * (depth - 1) + json.dumps({"x": pad}) + "]" * (depth - 1)).encode()
            if refused:
                with pytest.raises(InvalidJSON, match="deeper"):
                    loads_strict(body)
            else:
                assert loads_strict(body) is not None
    # a lone surrogate escape is not text (found by the fuzz suite: it made the core answer 500)
    with pytest.raises(InvalidJSON, match="surrogate"):
        loads_strict(b'{"x": "\\ud800"}')
    assert loads_strict(b'{"x": "\\ud83d\\ude00", "y": "\\\\ud800"}') == {"x": "\U0001f600", "y": "\\ud800"}
    # a container bomb is refused before decoding (it would decode to gigabytes of lists)
    with pytest.raises(LimitExceeded, match="max_json_containers=2000000"):
        loads_strict(b"[" + b"[]," * (MAX_JSON_CONTAINERS) + b"[]]")
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        with pytest.raises(InvalidJSON, match="not a JSON number"):
            loads_strict(b'{"x": ' + literal + b"}")


def test_request_limits_unit() -> None:
    limits = RequestLimits(max_message_bytes=10, max_prompt_tokens=2)
    limits.check_messages([{"role": "user", "content": "012345"}])  # role counts too
    with pytest.raises(Exception, match="max_message_bytes=10"):
        limits.check_messages([{"role": "user", "content": [{"type": "text", "text": "☃" * 4}]}])
    with pytest.raises(Exception, match="max_message_bytes=10"):
        limits.check_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                                  "arguments": "x" * 10}}]}])
    with pytest.raises(Exception, match="max_prompt_tokens=2"):
        limits.check_messages([{"role": "user", "content": "x" * 6}] * 6)
    with pytest.raises(Exception, match="max_prompt_tokens=2"):
        limits.check_prompt([1, 2, 3])


SECRET = "k3y-" + "s" * 28


def _visible_in_ps(root_pid: int) -> list[str]:
    procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    return [" ".join(p.cmdline()) for p in procs if SECRET in " ".join(p.cmdline())]


def _requires_key(url: str) -> None:
    assert requests.post(f"{url}/sessions", timeout=30).status_code == 401
    assert requests.post(f"{url}/sessions", headers={"Authorization": f"Bearer {SECRET}"},
                         timeout=30).status_code == 200


def test_api_key_from_a_file_never_shows_in_ps(tmp_path, backend, session_server_factory) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(SECRET + "\n")
    key_file.chmod(0o600)
    server = session_server_factory.launch(1, backend.url, "--api-key-file", str(key_file))
    _requires_key(server.url)
    assert _visible_in_ps(server.proc.pid) == []
    assert "warning" not in server.output()


def test_api_key_flag_still_works_with_a_warning_and_is_scrubbed_from_ps(backend, session_server_factory) -> None:
    server = session_server_factory.launch(1, backend.url, "--api-key", SECRET)
    _requires_key(server.url)
    assert "warning: --api-key shows the key" in server.output()
    assert _visible_in_ps(server.proc.pid) == []


@pytest.mark.parametrize("problem", ["readable-by-others", "empty", "missing"])
def test_a_bad_api_key_file_is_refused_before_serving(tmp_path, backend, problem) -> None:
    key_file = tmp_path / "key"
    if problem != "missing":
        key_file.write_text("" if problem == "empty" else SECRET)
        key_file.chmod(0o644 if problem == "readable-by-others" else 0o600)
    run = subprocess.run(server_argv(1, backend.url, "127.0.0.1:0", "--api-key-file", str(key_file)),
                         check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "--api-key-file" in run.stderr and "ready" not in run.stdout


def _embedded_backend(server) -> psutil.Process:
    found = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
             if "webapp.reference_backend" in " ".join(p.cmdline())]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_killed_embedded_backend_is_restarted(mode, session_server_factory) -> None:
    server = session_server_factory.launch(MODES[mode])
    sid = _session(server.url)
    first = _embedded_backend(server)
    first.kill()
    first.wait(10)
    deadline = time.monotonic() + 60
    while True:
        chat = _chat(server.url, sid, {"messages": [{"role": "user", "content": "hi"}]})
        if chat.status_code == 200:
            break
        assert chat.status_code == 502 and time.monotonic() < deadline, chat.text
        time.sleep(0.2)
    assert _embedded_backend(server).pid != first.pid
    health = requests.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["backend"] == "ok"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_health_reports_an_unreachable_backend(mode, reference_backend_factory, session_server_factory) -> None:
    backend = reference_backend_factory()
    server = session_server_factory.launch(MODES[mode], backend.url)
    assert requests.get(f"{server.url}/health", timeout=30).json()["backend"] == "ok"
    backend.close()
    health = requests.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["backend"] == "unreachable"
    assert backend.url in health.json()["error"]


@pytest.mark.timeout(300)
def test_a_worker_busy_with_a_large_legal_turn_is_not_killed(backend, session_server_factory) -> None:
    # A worker tokenizing and encoding a big prompt misses heartbeats for
    # seconds; it uses CPU meanwhile, so it is busy, not hung, and its shard keeps its sessions.
    server = session_server_factory.launch(
        1, backend.url, "--heartbeat-timeout", "0.3",
        "--max-message-bytes", str(64 << 20), "--max-prompt-tokens", str(64 << 20),
        env={"SHINKEN_HEARTBEAT_INTERVAL": "0.1"})
    keep = _session(server.url)
    assert _chat(server.url, keep, {"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    worker = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
              if "shinken-session-worker" in " ".join(p.cmdline())]
    big = _session(server.url)
    resp = _chat(server.url, big, {"messages": [{"role": "user", "content": "x" * (24 << 20)}], "max_tokens": 2})
    assert resp.status_code == 200, resp.text[:300]
    assert "is busy" in server.output()  # it did miss heartbeats
    assert "hung" not in server.output() and len(worker) == 1 and worker[0].is_running()
    assert requests.get(f"{server.url}/sessions/{keep}", timeout=30).status_code == 200


@pytest.mark.timeout(300)
def test_the_router_streams_request_bodies_in_bounded_memory(backend, session_server_factory) -> None:
    # 4 x 200 MB bodies cost the router +823 MB when it buffered them whole.
    server = session_server_factory.launch(1, backend.url)
    router = next(p for p in psutil.Process(server.proc.pid).children(recursive=True)
                  if "gunicorn: worker" in " ".join(p.cmdline()))
    sid = _session(server.url)
    size = 64 << 20
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * size + b'"}]}'
    baseline = router.memory_info().rss
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], router.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda _: _chat(server.url, sid, body).status_code, range(4)))
    done.set()
    sampler.join()
    assert statuses == [413] * 4  # each arrived whole at the worker, which refused the message
    assert peak[0] - baseline < 48 << 20, f"router grew by {(peak[0] - baseline) >> 20} MiB"
