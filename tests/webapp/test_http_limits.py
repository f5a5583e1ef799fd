"""Session server: slow bodies, per-client connections and malformed
chunked bodies against a real ``shinken-session-server`` (real gunicorn, real sockets), in
both modes."""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import requests

pytestmark = pytest.mark.integration

MODES = {"single-process": 0, "router": 2}
SLOW_CLIENTS = 2000
ATTACKER_HOSTS = [f"127.0.0.{i}" for i in range(2, 22)]  # 20 addresses x 100 connections


@pytest.fixture(scope="module", params=sorted(MODES))
def server(request, backend, session_server_factory) -> str:
    return session_server_factory.launch(MODES[request.param], backend.url,
                                         "--body-timeout", "60", "--max-client-connections", "150").url


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname, parts.port


def _exchange(url: str, request: bytes, source: str = "127.0.0.1", timeout: float = 30.0) -> bytes:
    with socket.create_connection(_address(url), timeout=timeout, source_address=(source, 0)) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        with contextlib.suppress(ConnectionResetError):  # the server closing with input unread
            while chunk := sock.recv(65536):
                out += chunk
        return out


@contextlib.contextmanager
def _slow_clients(url: str, hosts: list[str], per_host: int, path: str) -> Iterator[list[socket.socket]]:
    """Connections that send a request head announcing a body, then nothing."""
    socks = []
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n".encode()
    try:
        for host in hosts:
            for _ in range(per_host):
                sock = socket.create_connection(_address(url), timeout=30, source_address=(host, 0))
                socks.append(sock)
                sock.sendall(head)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _normal_client_is_served(url: str) -> None:
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    sid = requests.post(f"{url}/sessions", timeout=30).json()["session_id"]
    chat = requests.post(f"{url}/sessions/{sid}/v1/chat/completions", timeout=60,
                         json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text


@pytest.mark.timeout(300)
def test_a_normal_client_is_served_during_2000_slow_body_clients(server) -> None:
    sid = requests.post(f"{server}/sessions", timeout=30).json()["session_id"]
    per_host = SLOW_CLIENTS // len(ATTACKER_HOSTS)
    with _slow_clients(server, ATTACKER_HOSTS, per_host, f"/sessions/{sid}/v1/chat/completions") as socks:
        _normal_client_is_served(server)
        # ... while the slow clients are all still connected and unanswered
        for sock in socks[:: len(socks) // 50]:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)


def test_a_body_not_sent_within_body_timeout_is_408(backend, session_server_factory) -> None:
    """A small body (one frame), and a large one (the router's worker reads it from the
    connection itself: webapp.body_handoff): the same 408, and the connection is closed:
    where the next request starts is unknown, so what the client sends after the answer (the
    rest of the body, then a request) is never read as a request. On every gunicorn setup.py
    allows (tox env oldest: before 27 gunicorn drained the body by its length and parsed
    the request behind it)."""
    for workers in MODES.values():
        url = session_server_factory.launch(workers, backend.url, "--body-timeout", "1").url
        sid = requests.post(f"{url}/sessions", timeout=30).json()["session_id"]
        for length, sent in ((50, 1), (2_000_000, 100_000)):
            head = f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
            with socket.create_connection(_address(url), timeout=4) as sock:
                sock.sendall(head.encode() + b"{" + b" " * (sent - 1))
                reply = http.client.HTTPResponse(sock)
                reply.begin()
                assert reply.status == 408 and b"body_timeout" in reply.read(), (workers, length)
                with contextlib.suppress(OSError):  # the server may have closed already
                    sock.sendall(b" " * (length - sent) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                after = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := sock.recv(65536):  # a wait past the 4 s timeout fails the test
                        after += chunk
                assert after == b"", (workers, length, after[:200])


def test_connections_past_max_client_connections_are_429_and_others_are_served(server) -> None:
    with _slow_clients(server, ["127.0.0.99"], 150, "/sessions/x/v1/chat/completions"):
        refused = _exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", source="127.0.0.99")
        assert refused.startswith(b"HTTP/1.1 429") and b"max_client_connections=150" in refused
        _normal_client_is_served(server)
    # the slots are given back when those connections close
    for _ in range(100):
        again = _exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                          source="127.0.0.99")
        if again.startswith(b"HTTP/1.1 200"):
            break
    assert again.startswith(b"HTTP/1.1 200"), again


@pytest.mark.parametrize("chunked", [
    b"zz\r\nabc\r\n0\r\n\r\n",
    b"-5\r\nabc\r\n0\r\n\r\n",
    b"3\r\nabcXX0\r\n\r\n",
    b"0x3\r\nabc\r\n0\r\n\r\n",
    b"3;" + b"e" * 3000 + b"\r\nabc\r\n0\r\n\r\n",
], ids=["not-hex", "negative", "no-terminator", "0x-prefix", "huge-extension"])
def test_malformed_chunked_bodies_are_400_not_500(server, chunked) -> None:
    sid = requests.post(f"{server}/sessions", timeout=30).json()["session_id"]
    head = f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    reply = _exchange(server, head.encode() + chunked)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]
    assert len(reply) < 2000  # the offending bytes are not echoed in full
    _normal_client_is_served(server)


def _chat_head(sid: str, length: int, extra: str = "") -> bytes:
    return (f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("pad", [0, 1_500_000], ids=["one-frame", "streamed"])
def test_a_body_of_known_length_then_a_pipelined_request_on_one_connection(server, pad) -> None:
    """The body is read to its Content-Length and no further: the request the client sent
    right behind it (in the same packets) is answered on the same connection."""
    sid = requests.post(f"{server}/sessions", timeout=30).json()["session_id"]
    body = b'{"messages": [{"role": "user", "content": "hi"}]}' + b" " * pad
    pipelined = _chat_head(sid, len(body)) + body + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    reply = _exchange(server, pipelined, timeout=60)
    first, _, rest = reply.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200"), reply[:300]
    assert rest.count(b"HTTP/1.1 200") == 1 and b'"status": "ok"' in rest, rest[-300:]


@pytest.mark.parametrize("sent", [100, 1_200_000], ids=["one-frame", "streamed"])
def test_a_body_shorter_than_its_content_length_is_400(server, sent) -> None:
    sid = requests.post(f"{server}/sessions", timeout=30).json()["session_id"]
    reply = _exchange(server, _chat_head(sid, 2_000_000) + b" " * sent, timeout=60)
    assert reply.startswith(b"HTTP/1.1 400") and b"Content-Length 2000000" in reply, reply[:300]
    _normal_client_is_served(server)
