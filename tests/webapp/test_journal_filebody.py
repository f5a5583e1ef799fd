"""Reading a journal's spans for a records GET (``webapp.filebody``): what is read whole, the one
span reader, and the bytes served by every path (sendfile, pread, the file read whole)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pybase64
import pytest

from webapp.filebody import (
    _SENDFILE_MIN,
    _WHOLE_MAX,
    B64Span,
    FileSpan,
    Piece,
    _B64Run,
    _FileBody,
    _Read,
    _Scratch,
    _write_parts,
    read_pieces,
    span_bytes,
)
from webapp.send_pace import UNPACED, paced


def _journal(tmp_path, size: int) -> str:
    path = str(tmp_path / "s.journal")
    with open(path, "wb") as f:
        f.write(random.Random(size).randbytes(size))
    return path


@contextlib.contextmanager
def _to_a_client() -> Iterator[tuple[socket.socket, list[bytes]]]:
    """``(server side, what the client received)`` of a real socket pair whose client reads
    everything in a thread; on exit the server side is shut down and the reader joined."""
    server, client = socket.socketpair()
    got: list[bytes] = []

    def drain() -> None:
        while chunk := client.recv(1 << 20):
            got.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        yield server, got
    finally:
        server.shutdown(socket.SHUT_WR)
        reader.join()
        server.close()
        client.close()


def _served(pieces: list[Piece], *, raw_socket: bool) -> tuple[bytes, _FileBody]:
    """What a client receives for ``pieces``: the body's yielded chunks and its sendfile spans,
    in order, over a real socket pair (the server side given to the body when ``raw_socket``)."""
    with _to_a_client() as (server, got):
        body = _FileBody(pieces, server if raw_socket else None, paced({}))
        try:
            for chunk in body:
                server.sendall(chunk)
        finally:
            body.close()
    return b"".join(got), body


def test_spans_sent_by_sendfile_do_not_count_towards_reading_the_file_whole(tmp_path):
    size = 1 << 20
    assert _SENDFILE_MIN <= size <= _WHOLE_MAX
    path = _journal(tmp_path, size)
    pieces: list[Piece] = [b'{"records":[', FileSpan(path, 0, size), b"]}"]
    expected = read_pieces(pieces)
    # The span goes by sendfile: it is never read, so the file is not read whole for it.
    sent, body = _served(pieces, raw_socket=True)
    assert sent == expected
    assert body.read_whole == set()
    # Without a raw socket the same span is read: now its bytes add up to the file, read once.
    sent, body = _served(pieces, raw_socket=False)
    assert sent == expected
    assert body.read_whole == {path}


def test_short_file_spans_and_base64_spans_count_towards_reading_the_file_whole(tmp_path):
    size = 3 * 100_000
    path = _journal(tmp_path, size)
    short = [FileSpan(path, off, 60_000) for off in range(0, size, 60_000)]  # each under _SENDFILE_MIN
    b64 = [B64Span(path, 0, size)]
    for pieces in ([b"[", *short, b"]"], [b'"', *b64, b'"'], [b"[", FileSpan(path, 0, size // 2), *b64, b"]"]):
        sent, body = _served(pieces, raw_socket=True)
        assert sent == read_pieces(pieces)
        assert body.read_whole == {path}
    # A long span by sendfile plus a short one that reads less than the file: preads, no whole read.
    pieces = [b"[", FileSpan(path, 0, size), FileSpan(path, 5, 100), b"]"]
    sent, body = _served(pieces, raw_socket=True)
    assert sent == read_pieces(pieces)
    assert body.read_whole == set()


@pytest.mark.parametrize("raw_socket", [True, False])
def test_every_send_path_serves_the_bytes_read_pieces_reads(tmp_path, raw_socket):
    size = 3 << 20
    path = _journal(tmp_path, size)
    rng = random.Random(7)
    pieces: list[Piece] = [b"{"]
    for _ in range(200):
        kind, offset = rng.randrange(3), rng.randrange(size - 1)
        length = rng.randrange(1, min(size - offset, 600_000) + 1)
        if kind == 0:
            pieces.append(FileSpan(path, offset, length))
        elif kind == 1:
            pieces.append(B64Span(path, offset, length - length % 3 or 3))
        else:
            pieces.append(b",")
    pieces.append(b"}")
    sent, _body = _served(pieces, raw_socket=raw_socket)
    assert sent == read_pieces(pieces)


def test_one_span_reader_serves_read_read_pieces_and_an_open_fd(tmp_path, monkeypatch):
    path = _journal(tmp_path, 10_000)
    data = Path(path).read_bytes()
    plain, text = FileSpan(path, 1_001, 5_000), B64Span(path, 1_001, 5_000)
    assert plain.read() == data[1_001:6_001]
    assert text.read() == pybase64.b64encode(data[1_001:6_001])
    fd = os.open(path, os.O_RDONLY)
    try:
        for span in (plain, text):
            whole = span.read()
            assert span_bytes(fd, span) == whole == read_pieces([span])
            for start, end in ((0, 1), (1, 7), (3, 4), (5, len(span)), (len(span) - 1, len(span))):
                assert span.read(start, end) == span_bytes(fd, span, start, end) == whole[start:end]
    finally:
        os.close(fd)
    # read_pieces opens the file once for all its spans
    opened = []
    real_open = os.open

    def counting_open(*args, **kwargs):
        opened.append(args[0])
        return real_open(*args, **kwargs)

    expected = plain.read() + b"-" + text.read() + plain.read()
    monkeypatch.setattr(os, "open", counting_open)
    assert read_pieces([plain, b"-", text, plain]) == expected
    assert opened == [path]


GEVENT_BODY_SCRIPT = """
    from gevent import monkey; monkey.patch_all()
    import json, os, random, socket, sys, threading
    import gevent
    import pybase64
    from webapp import filebody
    from webapp.send_pace import paced

    encoders = set()  # the native threads base64 ran in
    real_encode = pybase64.b64encode
    def spying_encode(data):
        encoders.add(threading.get_native_id())
        return real_encode(data)
    pybase64.b64encode = spying_encode
    slices = []  # each call of a send thread: where it began
    real_write_parts = filebody._write_parts
    def spying_write_parts(sock_fd, views, parts, i, *rest):
        slices.append(i)
        return real_write_parts(sock_fd, views, parts, i, *rest)
    filebody._write_parts = spying_write_parts

    path = os.path.join(sys.argv[1], "s.journal")
    with open(path, "wb") as f:
        f.write(random.Random(7).randbytes((12 << 20) + 5))
    pieces = [b'{"a":"', filebody.B64Span(path, 0, 6 << 20), filebody.B64Span(path, 6 << 20, (6 << 20) + 5),
              b'","b":"', filebody.FileSpan(path, 10, 1000), b'"}']
    expected = filebody.read_pieces(pieces)

    server, client = socket.socketpair()
    got = []
    def drain():  # a real thread, a blocking copy of the client side: a reader that pauses once
        sock = monkey.get_original("socket", "socket")(fileno=os.dup(client.fileno()))
        sock.setblocking(True)
        pauses = [1, 8 << 20]  # at these byte counts, a pause longer than a send slice: the
        size = 0                # send thread hands the wait to the hub (the second: mid-batch)
        while chunk := sock.recv(1 << 20):
            got.append(chunk)
            size += len(chunk)
            if pauses and size >= pauses[0]:
                monkey.get_original("time", "sleep")(3 * filebody._SEND_SLICE)
                pauses.pop(0)
        sock.close()
        done.release()
    done = monkey.get_original("_thread", "allocate_lock")()
    done.acquire()
    monkey.get_original("_thread", "start_new_thread")(drain, ())

    from tests.support import start_hub_ticker

    ticks, ticking = start_hub_ticker(0.005)
    body = filebody._FileBody(pieces, server, paced({}))
    for chunk in body:  # the first batch goes through the server (its headers), the rest to the socket
        server.sendall(chunk)
    body.close()
    ticking.kill()
    server.shutdown(socket.SHUT_WR)
    while not done.acquire(False):  # the reader is a real thread: joined by its lock, polled from the hub
        gevent.sleep(0.01)
    server.close()
    client.close()
    print(json.dumps({"same": b"".join(got) == expected, "hub": threading.get_native_id(),
                      "encoders": sorted(encoders), "ticks": len(ticks), "slices": slices}))
"""


def test_under_gevent_base64_batches_are_read_encoded_and_written_off_the_hub(tmp_path):
    """A records GET's base64 (packed R3 served as text) is read, encoded and written by a send
    thread, not by the hub that runs the process's chats; a reader that pauses for longer than
    a send slice still gets every byte, in order, and the hub runs meanwhile."""
    from tests.support import clean_stdout, run_script

    out = json.loads(clean_stdout(run_script(GEVENT_BODY_SCRIPT, str(tmp_path))))
    assert out["same"]
    assert any(tid != out["hub"] for tid in out["encoders"]), out
    assert out["ticks"] >= 10  # ~120 ticks of 5 ms while the reader paused; fewer if the hub was held
    assert len(out["slices"]) >= 2  # the thread gave the paused reader's wait back to the hub, then went on


def test_base64_runs_are_read_into_one_reused_buffer_per_body(tmp_path, monkeypatch):
    """The packed bytes of every base64 run of a body go into one buffer, reused run after run
    (no ``bytes`` per read, no joined copy per run): a fresh buffer each time made the send
    thread's heap shrink and grow per hand-off, the pages faulted in again each time."""
    size = _WHOLE_MAX + (3 << 20)  # larger than a file read whole: every span is read
    path = _journal(tmp_path, size)
    pieces: list[Piece] = [b'{"a":"']
    for offset in range(0, size - (1 << 20), 1 << 20):  # a record's rows: one span per turn
        pieces.append(B64Span(path, offset, 3 * 100_000))
    pieces += [b'","b":"', B64Span(path, 5, 7 << 20), b'"}']
    reads: list[object] = []
    real_preadv = os.preadv

    def spying_preadv(fd, buffers, offset):
        reads.extend(b.obj for b in buffers)
        return real_preadv(fd, buffers, offset)

    def no_pread(*args):
        raise AssertionError("a base64 run read into a fresh bytes")

    monkeypatch.setattr(os, "preadv", spying_preadv)
    monkeypatch.setattr(os, "pread", no_pread)
    sent, _body = _served(pieces, raw_socket=True)
    monkeypatch.undo()
    assert sent == read_pieces(pieces)
    assert len(reads) > len(pieces) - 4  # every span read (the long one in 3 MiB parts)
    assert len({id(buffer) for buffer in reads}) == 1


def test_a_send_slice_leaves_the_callers_buffer_list_alone(tmp_path):
    """What a send slice makes, it frees: the list it was handed (the hub's) is not added to,
    or the hub would free the slice's last buffers, and a free from another thread trims the
    send thread's heap (its pages faulted in again on the next hand-off)."""
    path = _journal(tmp_path, 3 << 20)
    fd = os.open(path, os.O_RDONLY)
    views: list[memoryview] = []
    try:
        with _to_a_client() as (server, got):
            parts = (b"[", _B64Run((_Read(fd, 0, 3 << 20),)), b"]")
            left = _write_parts(server.fileno(), views, parts, 0, _Scratch(), UNPACED)
    finally:
        os.close(fd)
    assert left is None
    assert b"".join(got) == b"[" + B64Span(path, 0, 3 << 20).read() + b"]"
    assert views == []
