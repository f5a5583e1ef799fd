"""The engine client: proxy settings are taken once, when the client is made; a redirect is the
engine's answer; one kept-alive connection; a reply cut short or late fails as the errors say."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import urllib3

import webapp.backend
from webapp.backend import BackendClient, payload_bytes
from webapp.session_errors import BackendTimeout, BackendUnreachable, UpstreamStatus
from webapp.sockets import send_gathered

REPLY = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}}]}).encode()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed


@pytest.fixture
def engine(stub_backend_factory) -> str:
    return stub_backend_factory(lambda _request: (200, REPLY))


def _proxy_env(monkeypatch: pytest.MonkeyPatch, no_proxy: str = "") -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, no_proxy)


def test_a_proxy_in_the_environment_is_used_for_the_engine(engine, monkeypatch) -> None:
    _proxy_env(monkeypatch)
    client = BackendClient(engine)
    try:
        with pytest.raises(BackendUnreachable):
            client.send("/v1/chat/completions", b"{}")
    finally:
        client.close()


def test_no_proxy_for_the_engine_host_is_honoured(engine, monkeypatch) -> None:
    _proxy_env(monkeypatch, no_proxy="127.0.0.1")
    client = BackendClient(engine)
    try:
        assert client.send("/v1/chat/completions", b"{}").raw == REPLY
    finally:
        client.close()


def test_the_environment_is_read_once_when_the_client_is_made(engine, monkeypatch) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    client = BackendClient(engine)
    try:
        _proxy_env(monkeypatch)  # set after start: not seen (documented in docs/session-server-ops.md)
        assert client.send("/v1/chat/completions", b"{}").raw == REPLY
    finally:
        client.close()


class _RawEngine:
    """A loopback engine that answers every request on a connection with ``reply`` (raw HTTP
    bytes) and counts the connections it accepted."""

    def __init__(self, reply: bytes, *, close_after: bool = False) -> None:
        self.reply, self.close_after, self.connections = reply, close_after, 0
        self.requests: list[bytes] = []  # each request as received, head and body
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile:
            while (line := rfile.readline()) and line.strip():
                length, received = 0, [line]
                while (header := rfile.readline()).strip():
                    received.append(header)
                    name, _, value = header.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                received += (header, rfile.read(length))
                self.requests.append(b"".join(received))
                conn.sendall(self.reply)
                if self.close_after:
                    return

    def close(self) -> None:
        self._sock.close()


def _http(status: str, body: bytes, *extra: str, length: int | None = None) -> bytes:
    head = [f"HTTP/1.1 {status}", "Content-Type: application/json",
            f"Content-Length: {len(body) if length is None else length}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def test_a_redirect_from_the_engine_is_its_answer_not_followed() -> None:
    engine = _RawEngine(_http("307 Temporary Redirect", b'{"moved":1}', "Location: /elsewhere"))
    client = BackendClient(engine.url)
    try:
        with pytest.raises(UpstreamStatus) as caught:
            client.send("/v1/chat/completions", b"{}")
        assert (caught.value.status, caught.value.body) == (307, b'{"moved":1}')
        reply = client.proxy("GET", "v1/models", "", b"", {}, routing_key="s")
        assert (reply.status, reply.body) == (307, b'{"moved":1}')
    finally:
        client.close()
        engine.close()


def test_calls_share_one_kept_alive_connection() -> None:
    engine = _RawEngine(_http("200 OK", REPLY))
    client = BackendClient(engine.url)
    try:
        for _ in range(5):
            assert client.send("/v1/chat/completions", b"{}").raw == REPLY
        assert client.proxy("GET", "v1/models", "a=1", b"", {}, routing_key="s").body == REPLY
        assert engine.connections == 1
    finally:
        client.close()
        engine.close()


def test_a_reply_cut_short_is_unreachable_and_its_connection_not_reused() -> None:
    engine = _RawEngine(_http("200 OK", REPLY[:5], length=len(REPLY)), close_after=True)
    client = BackendClient(engine.url)
    try:
        for _ in range(2):
            with pytest.raises(BackendUnreachable):
                client.send("/v1/chat/completions", b"{}")
        assert engine.connections == 2
    finally:
        client.close()
        engine.close()


def test_a_body_past_the_read_timeout_is_a_timeout() -> None:
    engine = _RawEngine(_http("200 OK", b"", length=len(REPLY)))  # the head, then nothing
    client = BackendClient(engine.url, connect_timeout=2.0, read_timeout=0.2)
    try:
        with pytest.raises(BackendTimeout):
            client.send("/v1/chat/completions", b"{}")
    finally:
        client.close()
        engine.close()


def test_a_small_request_goes_out_in_one_send(monkeypatch) -> None:
    """Head and body joined, and in one ``send`` (gevent's ``sendall`` costs a ``getsockopt``
    and its chunking loop per call); a large body follows the head by ``sendall``, uncopied."""
    engine = _RawEngine(_http("200 OK", REPLY))
    client = BackendClient(engine.url)
    sent: list[tuple[str, bytes]] = []
    real_send, real_sendall = socket.socket.send, socket.socket.sendall

    def record(name: str, data: bytes) -> None:
        if bytes(data[:5]) != b"HTTP/":  # the engine's replies are not counted
            sent.append((name, bytes(data)))

    def send(sock: socket.socket, data: bytes, *args: object) -> int:
        record("send", data)
        return real_send(sock, data, *args)

    def sendall(sock: socket.socket, data: bytes, *args: object) -> None:
        record("sendall", data)
        real_sendall(sock, data, *args)

    monkeypatch.setattr(socket.socket, "send", send)
    monkeypatch.setattr(socket.socket, "sendall", sendall)
    try:
        assert client.send("/v1/chat/completions", b'{"a":1}').raw == REPLY
        assert [name for name, _ in sent] == ["send"]
        assert sent[0][1].startswith(b"POST /v1/chat/completions ") and sent[0][1].endswith(b'\r\n\r\n{"a":1}')
        big = b'{"a":"' + b"x" * (1 << 20) + b'"}'  # a large body is not copied into the head's buffer
        assert client.send("/v1/chat/completions", big).raw == REPLY
        assert [name for name, _ in sent] == ["send", "sendall", "sendall"] and sent[2][1] == big
    finally:
        client.close()
        engine.close()


def test_a_connection_the_engine_closed_is_not_reused(monkeypatch) -> None:
    """The check before reusing a kept-alive connection is one real zero-timeout poll of its
    socket (never urllib3's, which under gevent is the hub's poll): a connection the engine
    closed after its reply is replaced, an open one is reused."""
    import urllib3.connection

    def hub_poll(*args: object, **kwargs: object) -> bool:
        raise AssertionError("urllib3's wait_for_read was used")

    monkeypatch.setattr(urllib3.connection, "wait_for_read", hub_poll)
    closing = _RawEngine(_http("200 OK", REPLY), close_after=True)
    keeping = _RawEngine(_http("200 OK", REPLY))
    clients = [BackendClient(closing.url), BackendClient(keeping.url)]
    try:
        for client in clients:
            for _ in range(3):
                assert client.send("/v1/chat/completions", b"{}").raw == REPLY
                time.sleep(0.05)  # (the closing engine's FIN arrives before the next call)
        assert (closing.connections, keeping.connections) == (3, 1)
    finally:
        for client in clients:
            client.close()
        closing.close()
        keeping.close()


def test_a_large_body_lets_the_process_small_requests_go_first(monkeypatch) -> None:
    """In a gevent-patched process a body over 1 MiB (an image turn's) waits for what the hub
    has pending (a small chat's greenlet) before it is sent; a small body does not wait."""
    import gevent
    from gevent import monkey

    monkeypatch.setattr(monkey, "is_module_patched", lambda name: name == "socket")
    order: list[str] = []

    def opened(*args, **kwargs):
        order.append("send")
        raise OSError("not sent: the test only looks at the order")

    client = BackendClient("http://127.0.0.1:9")
    monkeypatch.setattr(client, "_open", opened)
    for size, expected in ((2 << 20, ["chat", "send"]), (1000, ["send"])):
        order.clear()
        small = gevent.spawn(order.append, "chat")
        with pytest.raises(BackendUnreachable):
            client.send("/v1/chat/completions", b"x" * size)
        assert order == expected, order
        small.join()
    client.close()


def test_a_body_in_pieces_goes_out_as_its_joined_bytes_would(monkeypatch) -> None:
    """An image turn's engine request is pieces (its data URLs views of the client's body): on
    the wire it is byte for byte the request of the same bytes joined, head included, sent from
    the pieces themselves (no joined copy); on urllib3's own connection (a proxy's or TLS's
    path) too, piece by piece."""
    client_body = bytearray(b"x" * 300_000)
    pieces = (b'{"messages":[],"image_data":["', memoryview(client_body)[1000:250_000], b'"]}')
    gathered: list[list[object]] = []

    def recording(sock: socket.socket, views: list[object]) -> None:
        gathered.append(list(views))
        send_gathered(sock, views)  # type: ignore[arg-type]

    monkeypatch.setattr(webapp.backend, "send_gathered", recording)
    engine = _RawEngine(_http("200 OK", REPLY))
    ours, plain = BackendClient(engine.url), BackendClient(engine.url)
    plain._pool.ConnectionCls = urllib3.connection.HTTPConnection
    try:
        assert ours.send("/v1/chat/completions", payload_bytes(pieces)).raw == REPLY
        assert ours.send("/v1/chat/completions", pieces).raw == REPLY
        assert plain.send("/v1/chat/completions", pieces).raw == REPLY
        assert len(engine.requests) == 3 and engine.requests[1] == engine.requests[0] == engine.requests[2]
        assert engine.requests[0].endswith(b"\r\n\r\n" + payload_bytes(pieces))
        # the head, then the pieces as given: the client's view is sent, not a copy of it
        assert len(gathered) == 1 and gathered[0][1:] == list(pieces) and gathered[0][2] is pieces[1]
    finally:
        ours.close()
        plain.close()
        engine.close()


def test_send_gathered_sends_every_piece_in_order_across_partial_sends() -> None:
    """Pieces larger than the socket takes at once (partial ``sendmsg``s, a piece cut in the
    middle) arrive whole and in order."""
    pieces = [bytes([k]) * size for k, size in enumerate((1, 700_000, 3, 1_300_001, 0, 65_536))]
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    received = bytearray()
    reader = threading.Thread(target=lambda: [received.extend(chunk) for chunk in iter(lambda: b.recv(65536), b"")])
    reader.start()
    try:
        send_gathered(a, [*pieces[:2], memoryview(pieces[3])[:1000], memoryview(pieces[3])[1000:], pieces[4], pieces[5]])
        a.shutdown(socket.SHUT_WR)
        reader.join(30)
        assert bytes(received) == pieces[0] + pieces[1] + pieces[3] + pieces[5]
    finally:
        a.close()
        b.close()
