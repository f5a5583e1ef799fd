"""The request body of known length read straight from gunicorn's client socket
(``webapp.http_limits``): the same bytes as gunicorn's reader gives, the read-ahead first,
nothing past the body taken, and a short body refused, over a real socket pair."""

from __future__ import annotations

import gevent
import gevent.socket
import pytest
from gunicorn.http.body import Body, LengthReader
from gunicorn.http.unreader import SocketUnreader

from webapp.http_limits import BodyTimeout, MalformedBody, _socket_body

NEXT = b"GET /health HTTP/1.1\r\n\r\n"


def _body(ahead: bytes, length: int) -> tuple[Body, LengthReader, gevent.socket.socket]:
    ours, theirs = gevent.socket.socketpair()
    unreader = SocketUnreader(ours)
    unreader.buf.write(ahead)  # what gunicorn read with the request head
    reader = LengthReader(unreader, length)
    return Body(reader), reader, theirs


@pytest.mark.parametrize("ahead", [0, 10, 3000, 5000], ids=lambda n: f"ahead-{n}")
def test_the_body_in_pieces_then_the_next_request_left_to_gunicorn(ahead) -> None:
    data = bytes(range(256)) * 20  # 5120 bytes
    both = data + NEXT
    body, reader, client = _body(both[:ahead], len(data))
    sender = gevent.spawn(client.sendall, both[ahead:])
    pieces = list(_socket_body(body, reader, timeout=10, chunk=1024))
    sender.join()
    assert b"".join(pieces) == data and [len(p) for p in pieces] == [1024] * 5
    assert reader.length == 0 and not getattr(body, "failed", False) and body.read() == b""
    assert reader.unreader.read(len(NEXT)) == NEXT  # the pipelined request: gunicorn's again
    client.close()


def test_a_body_cut_short_is_malformed_and_the_connection_not_reused() -> None:
    body, reader, client = _body(b"abc", 100)
    client.sendall(b"d" * 40)
    client.close()
    with pytest.raises(MalformedBody, match="request body of 43 bytes, Content-Length 100"):
        list(_socket_body(body, reader, timeout=10, chunk=64))
    assert body.failed


def test_after_a_failed_read_gunicorn_reads_nothing_more_from_the_connection() -> None:
    """Where the next request would start is unknown: whatever the client sends after the
    answer, gunicorn's reader finds the end of input. (gunicorn 27+ also closes the connection
    on ``Body.failed``; older ones drain the body by its length and parse what follows.)"""
    body, reader, client = _body(b"", 100)
    client.sendall(b"d" * 10)
    with pytest.raises(BodyTimeout):
        list(_socket_body(body, reader, timeout=0.3, chunk=64))
    client.sendall(b"d" * 90 + NEXT)
    gevent.sleep(0.1)  # the bytes are there to be read
    assert body.failed
    assert reader.unreader.read() == b""  # the drain's and the next request's reads alike
    client.close()


def test_a_body_left_unread_is_left_to_gunicorn_in_order() -> None:
    """A consumer that stops early (the worker answered before the whole body came) leaves the
    rest, read-ahead included, to gunicorn's reader: it drains exactly the body, then finds the
    next request."""
    data = bytes(range(256)) * 8  # 2048 bytes
    body, reader, client = _body((data + NEXT)[:1500], len(data))  # read ahead: past the first piece
    client.sendall((data + NEXT)[1500:])
    pieces = _socket_body(body, reader, timeout=10, chunk=1024)
    assert next(pieces) == data[:1024]
    pieces.close()
    assert reader.length == 1024 and not getattr(body, "failed", False)
    assert body.read() == data[1024:]  # gunicorn's own drain
    assert reader.unreader.read(len(NEXT)) == NEXT
    client.close()
