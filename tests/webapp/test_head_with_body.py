"""A response head held until the body's first write (webapp.gunicorn_worker.HeadWithBody).

Over a real socket pair: what the peer receives, in order, and how many sends the server side
made (a recorder wraps the real socket's ``sendall``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from webapp.gunicorn_worker import JOIN_MAX, HeadWithBody
from webapp.sockets import send_small

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"


class Recorder:
    """A real socket whose ``send`` and ``sendall`` calls are counted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sends: list[bytes] = []
        self.calls: list[str] = []

    def send(self, data: Any) -> int:
        self.sends.append(bytes(data))
        self.calls.append("send")
        return self.sock.send(data)

    def sendall(self, data: Any) -> None:
        self.sends.append(bytes(data))
        self.calls.append("sendall")
        self.sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.fixture
def pair() -> Iterator[tuple[HeadWithBody, Recorder, socket.socket]]:
    server, client = socket.socketpair()
    client.settimeout(5)
    recorder = Recorder(server)
    yield HeadWithBody(recorder), recorder, client
    server.close()
    client.close()


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "peer closed early"
        out += chunk
    return out


def test_head_and_small_body_go_in_one_send(pair: tuple[HeadWithBody, Recorder, socket.socket]) -> None:
    sock, recorder, peer = pair
    sock.sendall(HEAD)
    assert recorder.sends == []  # held
    sock.sendall(b'{"ok":true}')
    assert recorder.sends == [HEAD + b'{"ok":true}']
    assert recorder.calls == ["send"]  # one send: not gevent's sendall (a getsockopt and a loop per call)
    assert read_exactly(peer, len(HEAD) + 11) == HEAD + b'{"ok":true}'


class PartialSocket:
    """A socket whose ``send`` takes at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[tuple[str, bytes]] = []

    def send(self, data: Any) -> int:
        self.calls.append(("send", bytes(data[:self.limit])))
        return min(len(data), self.limit)

    def sendall(self, data: Any) -> None:
        self.calls.append(("sendall", bytes(data)))


def test_what_one_send_leaves_goes_by_sendall() -> None:
    sock = PartialSocket(limit=10)
    send_small(sock, b"0123456789abcdef")
    assert sock.calls == [("send", b"0123456789"), ("sendall", b"abcdef")]
    whole = PartialSocket(limit=100)
    send_small(whole, b"0123456789abcdef")
    assert whole.calls == [("send", b"0123456789abcdef")]


def test_a_large_body_follows_the_head_in_its_own_send(pair: tuple[HeadWithBody, Recorder, socket.socket]) -> None:
    sock, recorder, peer = pair
    body = b"x" * (JOIN_MAX + 1)
    sock.sendall(HEAD)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(read_exactly(peer, len(HEAD) + len(body))))
    reader.start()
    sock.sendall(body)
    reader.join(10)
    assert [len(s) for s in recorder.sends] == [len(HEAD), len(body)]
    assert got == [HEAD + body]


def test_other_writes_pass_straight_through(pair: tuple[HeadWithBody, Recorder, socket.socket]) -> None:
    sock, recorder, peer = pair
    sock.sendall(b"not a head")
    sock.sendall(b"HTTP/1.1 200 OK\r\n")  # no blank line: not a whole head
    assert recorder.sends == [b"not a head", b"HTTP/1.1 200 OK\r\n"]
    assert read_exactly(peer, 27) == b"not a headHTTP/1.1 200 OK\r\n"


@pytest.mark.parametrize("use", ["recv", "fileno", "send", "setblocking", "flush"])
def test_any_other_use_of_the_socket_sends_the_held_head_first(
        pair: tuple[HeadWithBody, Recorder, socket.socket], use: str) -> None:
    sock, recorder, peer = pair
    sock.sendall(HEAD)  # a reply without a body: 204, or a HEAD request's
    if use == "recv":
        peer.sendall(b"GET / HTTP/1.1\r\n\r\n")  # the client's next request: gunicorn reads it
        assert sock.recv(100) == b"GET / HTTP/1.1\r\n\r\n"
    elif use == "fileno":
        assert sock.fileno() == recorder.sock.fileno()  # sendfile / writev to the raw socket next
    elif use == "send":
        sock.send(b"!")
    elif use == "setblocking":
        sock.setblocking(True)
    else:
        sock.flush()
    assert recorder.sends[0] == HEAD
    assert read_exactly(peer, len(HEAD)) == HEAD


def test_close_sends_the_held_head_then_closes(pair: tuple[HeadWithBody, Recorder, socket.socket]) -> None:
    sock, _recorder, peer = pair
    sock.sendall(HEAD)
    sock.close()
    assert read_exactly(peer, len(HEAD)) == HEAD
    assert peer.recv(1) == b""  # closed after it


def test_close_with_the_peer_gone_still_closes() -> None:
    server, client = socket.socketpair()
    client.close()
    sock = HeadWithBody(server)
    sock.sendall(HEAD)
    sock.close()  # the held head has nobody to go to: no error
    assert server.fileno() == -1
