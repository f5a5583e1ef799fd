"""The one scatter-list step every gathered writer resumes with (webapp.iovec)."""

from __future__ import annotations

import os
import random
import socket

from webapp import iovec


def test_advance_moves_past_whole_views_and_keeps_the_rest_of_a_partial_one() -> None:
    buffers = iovec.views([b"abc", b"", bytearray(b"defg"), memoryview(b"hi")])
    assert [bytes(b) for b in buffers] == [b"abc", b"defg", b"hi"]  # the empty one left out
    assert iovec.advance(buffers, 0, 0) == 0
    assert iovec.advance(buffers, 0, 3) == 1
    assert iovec.advance(buffers, 1, 2) == 1 and bytes(buffers[1]) == b"fg"
    assert iovec.advance(buffers, 1, 4) == 3  # the rest of one view and all of the next


def test_partial_writes_of_random_sizes_deliver_every_byte_in_order() -> None:
    rng = random.Random(7)
    pieces = [os.urandom(rng.randrange(0, 5000)) for _ in range(300)]
    buffers, first, out = iovec.views(pieces), 0, bytearray()
    while first < len(buffers):
        offered = b"".join(bytes(b) for b in buffers[first:first + iovec.IOV_MAX])
        taken = min(len(offered), rng.randrange(1, 9000))  # what a short write took
        out += offered[:taken]
        first = iovec.advance(buffers, first, taken)
    assert bytes(out) == b"".join(pieces)


def test_writev_with_short_writes_on_a_real_socket() -> None:
    """A socket with a small send buffer takes part of each ``writev``; the reader still gets
    the pieces' bytes in order."""
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        pieces = [bytes([i]) * (1000 + 37 * i) for i in range(64)]
        want = b"".join(pieces)
        buffers, first, got, partial = iovec.views(pieces), 0, bytearray(), 0
        a.setblocking(False)
        while first < len(buffers) or len(got) < len(want):
            if first < len(buffers):
                try:
                    offered = sum(len(v) for v in buffers[first:first + iovec.IOV_MAX])
                    sent = os.writev(a.fileno(), buffers[first:first + iovec.IOV_MAX])
                    partial += sent < offered
                    first = iovec.advance(buffers, first, sent)
                except BlockingIOError:
                    pass
            got += b.recv(65536)
        assert bytes(got) == want
        assert partial  # the kernel did cut writes short: the resume path ran
    finally:
        a.close()
        b.close()
