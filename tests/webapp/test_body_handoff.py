"""A large body handed to the session worker with the client's connection (``webapp.body_handoff``).

In one process: the real channel (``IpcClient``/``IpcServer`` over socketpairs, the handoff
channel included) and a real loopback TCP connection standing for the client's, with gunicorn's
own body reader on the router's side (``webapp.http_limits.SocketBody``). The worker receives the
body from the connection itself, the router's side reads none of it, and every ending leaves the
connection in a known state with no descriptor left open. Through the launcher: the router
process reads none of a large body's bytes, and a worker killed mid-read costs that request its
connection and nothing else.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import http.client
import os
import resource
import socket
import time

import gevent
import gevent.socket
import psutil
import pytest
import requests
from gunicorn.http.body import Body, LengthReader
from gunicorn.http.unreader import SocketUnreader

from tests.support import wait_for
from webapp import body_handoff, ipc_channel
from webapp.body_handoff import handed_body_error
from webapp.core import Reply
from webapp.http_limits import BodyTimeout, MalformedBody, SocketBody
from webapp.ipc import WORKER_BUSY, IpcRemoteError
from webapp.ipc_channel import IpcClient, IpcServer, open_socket

NEXT = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
BODY = bytes(range(256)) * (12 * 1024 + 7)  # ~3 MiB, not a multiple of the read size


def echo(meta, body):
    """What the worker received: its length and digest (the reply stays one frame)."""
    return Reply(200, f"{len(body)} {hashlib.sha256(body).hexdigest()}".encode(), "text/plain")


def _received(body: bytes) -> bytes:
    return f"{len(body)} {hashlib.sha256(body).hexdigest()}".encode()


@pytest.fixture
def channel():
    main_a, main_b = socket.socketpair()
    hand_a, hand_b = body_handoff.open_pair()
    server = IpcServer(open_socket(main_b.detach()), echo, name="worker", handoff=open_socket(hand_b.detach()))
    client = IpcClient(open_socket(main_a.detach()), name="router", handoff=open_socket(hand_a.detach()))
    yield client, server
    client.close()
    server.close()


@pytest.fixture
def connection():
    """(the router's side as gevent sockets see it, the client's side) of one loopback TCP connection."""
    ours, client = _fresh_connection()
    yield ours, client
    ours.close()
    client.close()


def _handed(ours, ahead: bytes, length: int) -> SocketBody:
    """The body as the router hands it: ``ahead`` already read with the head (here: read now)."""
    got = b""
    while len(got) < len(ahead):
        got += ours.recv(len(ahead) - len(got))
    assert got == ahead
    reader = LengthReader(SocketUnreader(ours), length)
    return SocketBody(ours, ahead, length, Body(reader), reader)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open_to(path: str) -> int:
    """This process's descriptors open on ``path``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:  # closed meanwhile (listdir's own)
            pass
    return count


@pytest.mark.parametrize("ahead", [0, 8000], ids=["none-ahead", "some-ahead"])
def test_the_worker_receives_the_body_and_leaves_the_next_request_on_the_connection(channel, connection,
                                                                                      ahead) -> None:
    client, _ = channel
    ours, theirs = connection
    fds = _open_fds()
    sender = gevent.spawn(theirs.sendall, BODY + NEXT)
    handed = _handed(ours, BODY[:ahead], len(BODY))
    reply = client.request({"op": "echo"}, body_socket=handed, timeout=30, body_timeout=30)
    sender.join()
    assert reply.status == 200 and reply.body == _received(BODY)
    assert handed._reader.length == 0 and not getattr(handed._body, "failed", False)  # consumed: gunicorn reads on
    assert ours.recv(len(NEXT)) == NEXT  # nothing past the body was taken
    assert _open_fds() == fds  # the worker's copy of the connection is closed


def test_a_body_cut_short_is_400_and_the_connection_is_not_reused(channel, connection) -> None:
    client, _ = channel
    ours, theirs = connection
    theirs.sendall(BODY[:100_000])
    theirs.shutdown(socket.SHUT_WR)
    handed = _handed(ours, BODY[:10], len(BODY))
    with pytest.raises(IpcRemoteError) as caught:
        client.request({"op": "echo"}, body_socket=handed, timeout=30, body_timeout=30)
    error = handed_body_error(caught.value)
    assert isinstance(error, MalformedBody) and error.status == 400
    assert str(error) == f"request body of 100000 bytes, Content-Length {len(BODY)}"
    assert handed._body.failed


def test_a_stalled_body_is_408_within_the_body_timeout(channel, connection) -> None:
    client, _ = channel
    ours, theirs = connection
    theirs.sendall(BODY[:5000])
    handed = _handed(ours, b"", len(BODY))
    start = time.monotonic()
    with pytest.raises(IpcRemoteError) as caught:
        client.request({"op": "echo"}, body_socket=handed, timeout=30, body_timeout=0.5)
    assert time.monotonic() - start < 10
    error = handed_body_error(caught.value)
    assert isinstance(error, BodyTimeout) and error.status == 408 and "0.5 s" in str(error)
    assert handed._body.failed


def test_a_router_that_gives_up_stops_the_worker_reading(channel, connection) -> None:
    """The request's greenlet is killed (its HTTP client went away, the router is stopping) while
    the worker waits for the rest of the body: the read side is shut down, so the worker stops
    at once instead of waiting out the body timeout."""
    client, server = channel
    ours, theirs = connection
    theirs.sendall(BODY[:5000])
    handed = _handed(ours, b"", len(BODY))
    caller = gevent.spawn(client.request, {"op": "echo"}, body_socket=handed, timeout=60, body_timeout=60)
    with gevent.Timeout(10):
        while not server._inflight:
            gevent.sleep(0.01)
    caller.kill()
    assert handed._body.failed
    with gevent.Timeout(10):  # long before the 60 s body timeout
        while server._inflight:
            gevent.sleep(0.01)


def test_a_busy_worker_refuses_and_closes_its_copy(channel, connection, monkeypatch) -> None:
    client, _ = channel
    ours, theirs = connection
    monkeypatch.setattr(ipc_channel, "MAX_INFLIGHT_REQUESTS", 0)
    theirs.sendall(BODY[:1000])
    fds = _open_fds()
    handed = _handed(ours, b"", len(BODY))
    with pytest.raises(IpcRemoteError) as caught:
        client.request({"op": "echo"}, body_socket=handed, timeout=30, body_timeout=30)
    assert caught.value.remote_type == WORKER_BUSY and handed_body_error(caught.value) is None
    assert handed._body.failed
    with gevent.Timeout(5):
        while _open_fds() != fds:
            gevent.sleep(0.01)


def test_a_worker_at_its_descriptor_limit_refuses_that_request_only(channel, connection) -> None:
    """The kernel cannot give the worker the connection (no descriptor left): that request is
    refused unrun, retryable, and the channel serves the next one."""
    client, _ = channel
    ours, theirs = connection
    theirs.sendall(BODY[:1000])
    handed = _handed(ours, b"", len(BODY))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1, hard))
    filler = []
    try:
        with contextlib.suppress(OSError):  # every free number below the limit taken
            while True:
                filler.append(os.open(os.devnull, os.O_RDONLY))
        with pytest.raises(IpcRemoteError) as caught:
            client.request({"op": "echo"}, body_socket=handed, timeout=30, body_timeout=30)
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert caught.value.worker_busy and "descriptor" in caught.value.message
    assert handed._body.failed
    other, peer = _fresh_connection()
    sender = gevent.spawn(peer.sendall, BODY)
    again = client.request({"op": "echo"}, body_socket=_handed(other, b"", len(BODY)), timeout=30, body_timeout=30)
    sender.join()
    assert again.body == _received(BODY)
    other.close()
    peer.close()


def test_a_malformed_handoff_message_tears_the_channel_down_and_closes_its_descriptors() -> None:
    main_a, main_b = socket.socketpair()
    hand_a, hand_b = body_handoff.open_pair()
    server = IpcServer(open_socket(main_b.detach()), echo, name="worker", handoff=open_socket(hand_b.detach()))
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(2)]
    nulls = _open_to(os.devnull)
    hand_a.sendmsg([b"not a frame"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", spare))])
    closed = server.wait_closed(10)
    assert closed is not None and "handoff protocol error" in closed.reason
    assert _open_to(os.devnull) == nulls  # the two copies that arrived are closed again
    for fd in spare:
        os.close(fd)
    hand_a.close()
    main_a.close()


def test_a_channel_without_a_handoff_end_takes_no_body_socket(connection) -> None:
    main_a, main_b = socket.socketpair()
    server = IpcServer(open_socket(main_b.detach()), echo, name="worker")
    client = IpcClient(open_socket(main_a.detach()), name="router")
    ours, _ = connection
    assert not client.takes_body_sockets
    with pytest.raises(ValueError, match="no handoff channel"):
        client.request({"op": "echo"}, body_socket=_handed(ours, b"", 10), timeout=5)
    client.close()
    server.close()


def test_a_body_never_handed_on_is_abandoned_when_closed(connection) -> None:
    """The router took the body but failed before the channel did (its shard was down): the
    read-ahead bytes are gone from gunicorn's buffer, so the connection must not be read on."""
    ours, theirs = connection
    theirs.sendall(b"x" * 100 + NEXT)
    untouched = _handed(ours, b"x" * 10, 100)
    untouched.close()
    assert untouched._body.failed  # gunicorn closes it after the answer
    with gevent.Timeout(5):  # its read side is shut down: what was queued, then EOF, not a wait
        while ours.recv(1000):
            pass
    other, peer = _fresh_connection()
    handed = _handed(other, b"", 10)
    handed.consumed()
    handed.close()
    assert not getattr(handed._body, "failed", False) and handed._reader.length == 0
    other.close()
    peer.close()


def _fresh_connection():
    listener = gevent.socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = gevent.socket.create_connection(listener.getsockname())
    ours, _ = listener.accept()
    listener.close()
    return ours, client


# -- through the launcher: a router and its worker processes -----------------------------------


def _processes(server) -> tuple[psutil.Process, psutil.Process]:
    tree = psutil.Process(server.proc.pid).children(recursive=True)
    router = next(p for p in tree if "gunicorn: worker" in " ".join(p.cmdline()))
    worker = next(p for p in tree if "shinken-session-worker" in " ".join(p.cmdline()))
    return router, worker


def _holds(process: psutil.Process, sock: socket.socket) -> bool:
    """Whether ``process`` has the server's end of the client connection ``sock`` open."""
    return any(c.raddr and tuple(c.raddr) == sock.getsockname() for c in process.net_connections("tcp"))


def _chat_head(sid: str, length: int) -> bytes:
    return (f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _connect(server) -> socket.socket:
    host, port = server.url.split("//")[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60)




@pytest.mark.integration
def test_the_worker_reads_a_large_body_from_the_connection_itself(backend, session_server_factory) -> None:
    """Mid-body, the worker holds the client's connection (the router passed it), and once the
    turn is answered it holds it no more; the connection serves the client's next request."""
    server = session_server_factory.launch(1, backend.url)
    sid = requests.post(f"{server.url}/sessions", timeout=30).json()["session_id"]
    router, worker = _processes(server)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}' + b" " * (3 << 20)
    with _connect(server) as sock:
        sock.sendall(_chat_head(sid, len(body)) + body[:1 << 20])
        assert wait_for(lambda: _holds(worker, sock), 30), "the worker never held the client's connection"
        assert _holds(router, sock)  # the router keeps its own: it writes the reply
        sock.sendall(body[1 << 20:] + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
        assert reply.count(b"HTTP/1.1 200") == 2 and b'"status": "ok"' in reply, reply[-300:]
    assert wait_for(lambda: not any(c.raddr for c in worker.net_connections("tcp")
                                    if c.raddr and c.raddr[1] != int(backend.url.rsplit(":", 1)[1])), 30)
    with _connect(server) as sock:  # a client that waits for "100 Continue" (curl does, over 1 MiB)
        head = _chat_head(sid, len(body)).replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n", 1)
        sock.sendall(head)
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        assert reply.status == 200, reply.read()[:300]


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_worker_killed_mid_body_costs_that_connection_only(backend, session_server_factory) -> None:
    server = session_server_factory.launch(1, backend.url)
    sid = requests.post(f"{server.url}/sessions", timeout=30).json()["session_id"]
    _, worker = _processes(server)
    with _connect(server) as sock:
        sock.sendall(_chat_head(sid, 4 << 20) + b"{" + b" " * (1 << 20))  # a quarter of it, then a stall
        assert wait_for(lambda: _holds(worker, sock), 30)  # the worker is reading it
        worker.kill()
        reply = b""
        while chunk := sock.recv(65536):  # the answer, then the router closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 503"), reply[:300]
    deadline = time.monotonic() + 60  # the supervisor restarts the worker; a new session is served
    while time.monotonic() < deadline:
        fresh = requests.post(f"{server.url}/sessions", timeout=30)
        if fresh.status_code == 200:
            break
        time.sleep(0.2)
    chat = requests.post(f"{server.url}/sessions/{fresh.json()['session_id']}/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200, chat.text[:300]
