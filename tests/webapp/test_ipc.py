"""The IPC codec (sans-I/O) and the gevent channel over a real socketpair, in one process."""

from __future__ import annotations

import mmap
import socket

import gevent
import gevent.event
import pytest

from webapp import ipc
from webapp.ipc import (
    FRAME_HEADER,
    MAX_FRAME_BYTES,
    FrameDecoder,
    FrameTooLarge,
    FrameType,
    IpcChannelClosed,
    IpcProtocolError,
    IpcRemoteError,
    IpcTimeout,
    IpcVersionMismatch,
    Op,
    decode_envelope,
    encode_envelope_frame,
    iter_frames,
    pack_header,
)
from webapp.ipc_channel import STREAM_WINDOW, IpcClient, IpcServer, open_socket

GiB = 1024**3


def _wire(buffers) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def _roundtrip(data: bytes, piece: int) -> list[ipc.Frame]:
    blocks = [data[i : i + piece] for i in range(0, len(data), piece)]
    return list(iter_frames(FrameDecoder(), blocks))


BINARY = bytes(range(256)) * 3


LARGE = b"x" * (3 * 1024 * 1024 + 5)
# Every piece size for the small bodies; for the 3 MiB body only the large pieces (byte-at-a-time
# feeding of 3 MiB is slow and exercises nothing the small bodies do not).
ENVELOPE_CASES = [(body, piece) for body in (b"", BINARY) for piece in (1, 7, 65536, 10**9)]
ENVELOPE_CASES += [(LARGE, 65536), (LARGE, 10**9)]


@pytest.mark.parametrize(("body", "piece"), ENVELOPE_CASES,
                         ids=[f"{len(b)}B-by-{p}" for b, p in ENVELOPE_CASES])
def test_envelope_roundtrip(body: bytes, piece: int) -> None:
    meta = {"op": "chat", "session_id": "ab" * 16, "ünï": [1, None]}
    data = _wire(encode_envelope_frame(42, FrameType.REQUEST, meta, body))
    assert data[:3] == ipc.MAGIC + bytes([ipc.IPC_VERSION]) and len(data) == FRAME_HEADER.unpack_from(data)[2]
    data += _wire(encode_envelope_frame(43, FrameType.REPLY, {"status": 204}, [body, b"", b"tail"]))
    first, second = _roundtrip(data, piece)
    assert (first.request_id, first.type) == (42, FrameType.REQUEST)
    got_meta, got_body = decode_envelope(first.payload)
    assert got_meta == meta and bytes(got_body) == body
    assert (second.request_id, second.type) == (43, FrameType.REPLY)
    assert bytes(decode_envelope(second.payload)[1]) == body + b"tail"


@pytest.mark.parametrize("piece", [7, 100_000, 10**9])
def test_body_frames_arrive_as_ordered_pieces(piece: int) -> None:
    chunks = {5: bytes(range(256)) * 4096, 6: b"tail-of-six", 7: b""}  # 1 MiB, small, empty
    data = b"".join(_wire(ipc.encode_frame(rid, FrameType.BODY, [body])) for rid, body in chunks.items())
    data += _wire(ipc.encode_frame(9, FrameType.CANCEL))
    got: dict[int, bytes] = {}
    frames = _roundtrip(data, piece) if piece > 7 else _roundtrip(data[: 3 * 65536], piece)
    for frame in frames:
        assert frame.type in (FrameType.BODY, FrameType.CANCEL)
        assert isinstance(frame.payload, bytes)
        got[frame.request_id] = got.get(frame.request_id, b"") + frame.payload
    if piece > 7:
        assert got == {**chunks, 9: b""}
    else:  # a prefix cut anywhere yields a prefix of the body, never a wrong byte
        assert chunks[5].startswith(got[5])


def test_many_small_frames_in_one_read() -> None:
    data = b"".join(_wire(ipc.encode_frame(i, FrameType.CANCEL)) for i in range(1, 5001))
    frames = _roundtrip(data, len(data))
    assert [f.request_id for f in frames] == list(range(1, 5001))


@pytest.mark.parametrize(
    "header",
    [
        pack_header(3, 1, FrameType.REQUEST),  # shorter than its own header
        pack_header(MAX_FRAME_BYTES + 1, 1, FrameType.REQUEST),  # over the cap
        pack_header(FRAME_HEADER.size + ipc.MAX_BODY_CHUNK + 1, 1, FrameType.BODY),
        pack_header(FRAME_HEADER.size, 1, 99),  # unknown type
        pack_header(MAX_FRAME_BYTES, 1, FrameType.REQUEST, magic=b"GE"),  # not our frame (say, "GET ...")
        pack_header(MAX_FRAME_BYTES, 1, FrameType.REQUEST, version=ipc.IPC_VERSION + 1),  # another version
    ],
    ids=["short", "over-cap", "body-chunk-too-big", "unknown-type", "bad-magic", "other-version"],
)
def test_corrupt_header_is_rejected_before_allocating(header: bytes) -> None:
    allocations = []
    decoder = FrameDecoder(allocate=lambda n: allocations.append(n) or bytearray(n))
    with pytest.raises(IpcProtocolError):
        list(iter_frames(decoder, [header]))
    assert allocations == []


@pytest.mark.parametrize("version", [0, ipc.IPC_VERSION + 1, 255])
def test_another_version_is_a_typed_error_naming_both_versions(version: int) -> None:
    frame = _wire(ipc.encode_frame(1, FrameType.CANCEL))
    other = pack_header(len(frame), 1, FrameType.CANCEL, version=version)
    with pytest.raises(IpcVersionMismatch) as exc:
        list(iter_frames(FrameDecoder(), [other]))
    assert (exc.value.peer, exc.value.ours) == (version, ipc.IPC_VERSION)
    assert f"peer speaks version {version}, this side {ipc.IPC_VERSION}" in str(exc.value)
    assert isinstance(exc.value, IpcProtocolError) and exc.value.status == 502


def test_a_peer_of_another_version_tears_the_channel_down_with_a_clear_cause() -> None:
    a, b = socket.socketpair()
    client = IpcClient(open_socket(a.detach()), name="victim")
    pending = gevent.spawn(client.request, {"op": Op.PING}, b"", timeout=10)
    gevent.sleep(0.05)
    b.sendall(pack_header(FRAME_HEADER.size, 1, FrameType.REPLY, version=ipc.IPC_VERSION + 1))
    pending.join(timeout=5)
    assert isinstance(pending.exception, IpcChannelClosed)
    assert isinstance(client.closed.__cause__, IpcVersionMismatch)
    assert "IPC version mismatch" in client.closed.reason
    b.close()


def test_u64_length_above_4gib_without_allocating_it() -> None:
    size = 4 * GiB + 123
    # encoder: a lazily-mapped body never touched, so no memory is committed
    body = mmap.mmap(-1, size)
    header = ipc.encode_frame(7, FrameType.REQUEST, [body])[0]
    _magic, _version, total, rid, ftype = FRAME_HEADER.unpack(header)
    assert (total, rid, ftype) == (size + FRAME_HEADER.size, 7, FrameType.REQUEST)
    assert total > 2**32  # would have wrapped in a u32
    # decoder: accepts the length and asks for a buffer of exactly that size
    requested = []

    def allocate(n: int) -> mmap.mmap:
        requested.append(n)
        return body

    decoder = FrameDecoder(allocate=allocate)
    assert list(iter_frames(decoder, [header + b"abc"])) == []
    assert requested == [size]
    assert len(decoder.buffer()) == size - 3
    body.close()


def test_encode_over_cap_raises_frame_too_large() -> None:
    one_gib = mmap.mmap(-1, GiB)  # the same untouched mapping 65 times: 65 GiB, nothing committed
    with pytest.raises(FrameTooLarge) as info:
        encode_envelope_frame(1, FrameType.REPLY, {}, [one_gib] * 65)
    assert info.value.size > MAX_FRAME_BYTES
    one_gib.close()


def test_envelope_errors_are_typed() -> None:
    with pytest.raises(IpcProtocolError):
        decode_envelope(b"\x00" * 3)
    with pytest.raises(IpcProtocolError):
        decode_envelope(ipc._U64.pack(100) + b"{}")
    with pytest.raises(IpcProtocolError):
        decode_envelope(ipc._U64.pack(2) + b"[]")
    err = ipc.decode_error(IpcRemoteError("KeyError", "boom").to_payload())
    assert (err.remote_type, err.message) == ("KeyError", "boom")


# -- the channel ------------------------------------------------------------------------


class Reply:
    def __init__(self, body, status: int = 200, content_type: str = "application/octet-stream") -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = (("X-Op", "toy"),)


class Gate:
    """Holds ``"hold"`` requests in their handler until opened, so a test knows they still run."""

    def __init__(self) -> None:
        self.entered = 0
        self.opened = gevent.event.Event()

    def pass_through(self) -> None:
        self.entered += 1
        self.opened.wait(HOLD_LIMIT)


HOLD_LIMIT = 30.0  # a held handler gives up after this, so none outlives a failed test for long
gate = Gate()


@pytest.fixture(autouse=True)
def _fresh_gate():
    global gate
    gate = Gate()
    yield
    gate.opened.set()


def until(predicate, timeout: float = 5.0) -> None:
    """Wait (polling) until ``predicate()`` holds; gevent.Timeout if it does not in time."""
    with gevent.Timeout(timeout):
        while not predicate():
            gevent.sleep(0.01)


def toy_handler(meta, body):
    gevent.sleep(meta.get("delay", 0))
    if meta.get("hold"):
        gate.pass_through()
    op = meta["op"]
    if op == "echo":
        return Reply(bytes(body))
    if op == "fail":
        raise KeyError("no such thing")
    if op == "big":
        chunk = bytes(range(256)) * 4096  # 1 MiB
        return Reply([chunk] * meta["n"] + [b"end"])
    if op == "huge":
        one_gib = mmap.mmap(-1, GiB)
        return Reply([one_gib] * 65)
    raise ValueError(op)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    server = IpcServer(open_socket(b.detach()), toy_handler, name="toy-server")
    client = IpcClient(open_socket(a.detach()), name="toy-client")
    yield client, server
    client.close()
    server.close()


def test_out_of_order_replies_from_many_greenlets(pair) -> None:
    client, _ = pair
    delays = [0.05 * ((7 * i) % 5) for i in range(40)]

    def call(i: int):
        reply = client.request({"op": "echo", "delay": delays[i]}, f"req-{i}".encode(), timeout=10)
        return reply.body

    jobs = [gevent.spawn(call, i) for i in range(40)]
    gevent.joinall(jobs, timeout=10, raise_error=True)
    assert [j.value for j in jobs] == [f"req-{i}".encode() for i in range(40)]


def test_reply_fields_and_empty_and_binary_bodies(pair) -> None:
    client, _ = pair
    for body in (b"", BINARY):
        reply = client.request({"op": "echo"}, body, timeout=5)
        assert (reply.status, reply.content_type, reply.headers) == (
            200, "application/octet-stream", [("X-Op", "toy")])
        assert reply.body == body and reply.length == len(body) and reply.stream is None


def test_handler_error_becomes_remote_error_and_channel_keeps_working(pair) -> None:
    client, _ = pair
    with pytest.raises(IpcRemoteError) as info:
        client.request({"op": "fail"}, timeout=5)
    assert info.value.remote_type == "KeyError"
    assert client.request({"op": "echo"}, b"still here", timeout=5).body == b"still here"


def test_eof_fails_pending_requests_and_later_ones_fast(pair) -> None:
    client, server = pair
    jobs = [gevent.spawn(client.request, {"op": "echo", "hold": True}, b"x", timeout=30) for _ in range(5)]
    until(lambda: gate.entered == 5)
    server.close()
    gevent.joinall(jobs, timeout=5)
    assert all(isinstance(j.exception, IpcChannelClosed) for j in jobs)
    assert "EOF" in client.closed.reason
    with gevent.Timeout(1), pytest.raises(IpcChannelClosed):
        client.request({"op": "echo"}, b"x", timeout=30)


def test_timeout_then_late_reply_is_dropped(pair) -> None:
    client, _ = pair
    with pytest.raises(IpcTimeout):
        client.request({"op": "echo", "delay": 0.3}, b"late", timeout=0.05)
    killed = gevent.spawn(client.request, {"op": "echo", "delay": 0.3}, b"killed", timeout=5)
    gevent.sleep(0.05)
    killed.kill()
    # The late replies arrive while these are pending; each caller still gets its own.
    results = [gevent.spawn(client.request, {"op": "echo", "delay": 0.1 * i}, f"mine-{i}".encode(), timeout=5)
               for i in range(6)]
    gevent.joinall(results, timeout=5, raise_error=True)
    assert [r.value.body for r in results] == [f"mine-{i}".encode() for i in range(6)]
    assert client._pending == {} and client.closed is None


def test_oversized_frames_fail_only_their_request(pair) -> None:
    client, _ = pair
    one_gib = mmap.mmap(-1, GiB)
    with pytest.raises(FrameTooLarge):
        client.request({"op": "echo"}, [one_gib] * 65, timeout=5)
    one_gib.close()
    with pytest.raises(IpcRemoteError) as info:  # the worker's reply is over the cap
        client.request({"op": "huge"}, timeout=5)
    assert info.value.remote_type == "FrameTooLarge"
    assert client.request({"op": "echo"}, b"ok", timeout=5).body == b"ok"


def test_streamed_body_arrives_whole_and_small_requests_overtake_it(pair) -> None:
    client, _ = pair
    n = 40  # 40 MiB, five times the stream window: it must wait for credit
    reply = client.request({"op": "big", "n": n}, timeout=5)
    assert reply.stream is not None and reply.length == n * 1024 * 1024 + 3
    # nothing consumed yet, the stream is stalled on credit: a small request still answers
    assert client.request({"op": "echo"}, b"overtakes", timeout=5).body == b"overtakes"
    received = bytearray()
    for chunk in reply.stream:
        assert isinstance(chunk, bytes) and len(chunk) <= ipc.MAX_BODY_CHUNK
        received += chunk
    assert len(received) == reply.length and received.endswith(b"end")
    assert received[: 1024 * 1024] == bytes(range(256)) * 4096


def test_abandoned_stream_is_cancelled(pair) -> None:
    client, server = pair
    reply = client.request({"op": "big", "n": 40}, timeout=5)
    it = iter(reply.stream)
    next(it)
    it.close()
    until(lambda: server._inflight == {})  # the worker stopped streaming (else: 120 s credit wait)
    assert client.request({"op": "echo"}, b"next", timeout=5).body == b"next"


def test_corrupt_frame_tears_the_channel_down() -> None:
    a, b = socket.socketpair()
    client = IpcClient(open_socket(a.detach()), name="victim")
    pending = gevent.spawn(client.request, {"op": "echo"}, b"x", timeout=10)
    gevent.sleep(0.05)
    b.sendall(pack_header(5, 1, FrameType.REPLY))
    pending.join(timeout=5)
    assert isinstance(pending.exception, IpcChannelClosed)
    assert isinstance(client.closed.__cause__, IpcProtocolError)
    b.close()


# -- receive buffer pool ----------------------------------------------------------------------

MiB = 1024 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pool_reuses_a_released_buffer_of_a_fitting_size_class() -> None:
    pool = ipc.ReceiveBufferPool(max_bytes=64 * MiB)
    first = pool.acquire(5 * MiB + 1)
    assert len(first) >= 5 * MiB + 1 and pool.lent == 1
    assert pool.release(memoryview(first)[: 5 * MiB + 1]) is True
    assert (pool.lent, pool.idle_bytes) == (0, len(first))
    again = pool.acquire(5 * MiB + 100)  # a slightly bigger body still fits the size class
    assert again is first and pool.idle_bytes == 0
    other = pool.acquire(5 * MiB)  # the only idle buffer is lent: a new one
    assert other is not first and pool.lent == 2


def test_pool_grows_an_idle_buffer_for_a_larger_body_keeping_its_pages() -> None:
    """An agent's body grows every turn: the last body's buffer is grown (its pages kept), not
    replaced by a new mapping the whole next body faults in again."""
    pool = ipc.ReceiveBufferPool(max_bytes=64 * MiB)
    first = pool.acquire(3 * MiB)
    first[:5] = b"pages"
    assert pool.release(memoryview(first)) is True
    grown = pool.acquire(5 * MiB)  # over the idle buffer's size class
    assert grown is first and len(grown) >= 5 * MiB and grown[:5] == b"pages"
    grown[-5:] = b"grown"  # the new tail is memory like the rest
    assert grown[-5:] == b"grown"
    assert (pool.lent, pool.idle_bytes) == (1, 0)
    assert pool.release(memoryview(grown)) is True
    assert pool.acquire(65 * MiB) is not grown  # one the pool would not keep: mapped apart
    assert pool.idle_bytes == len(grown)


def test_pool_never_reuses_a_buffer_someone_still_sees() -> None:
    pool = ipc.ReceiveBufferPool(max_bytes=64 * MiB)
    buffer = pool.acquire(MiB)
    payload = memoryview(buffer)[:MiB]
    payload[:4] = b"keep"
    body = payload[1:]
    kept = body[:3]  # a handler holding on to a slice of its body
    assert pool.release(payload, body) is False
    assert pool.idle_bytes == 0 and pool.lent == 0
    fresh = pool.acquire(MiB)
    assert fresh is not buffer
    fresh[:4] = b"XXXX"
    assert bytes(kept) == b"eep"
    with pytest.raises(ValueError):  # the views the pool was given are released
        bytes(body)


def test_pool_idle_memory_is_bounded_and_trimmed() -> None:
    clock = FakeClock()
    pool = ipc.ReceiveBufferPool(max_bytes=8 * MiB, idle_seconds=30.0, clock=clock)
    lent = [pool.acquire(n * MiB) for n in (1, 2, 3, 4)]
    kept = [pool.release(memoryview(b)) for b in lent]
    assert pool.idle_bytes <= 8 * MiB
    assert kept == [True] * 4 and sorted(len(b) for b in lent if not b.closed) == [3 * MiB, 4 * MiB]
    assert pool.release(memoryview(pool.acquire(9 * MiB))) is False  # over the budget on its own
    assert pool.idle_bytes == 7 * MiB
    clock.now = 31.0
    pool.trim()
    assert pool.idle_bytes == 0 and all(b.closed for b in lent)


def test_pool_leaves_foreign_payloads_alone() -> None:
    pool = ipc.ReceiveBufferPool()
    foreign = bytearray(10)
    view = memoryview(foreign)
    assert pool.release(view) is False and pool.release(b"small") is False
    view[0] = 1  # not released by the pool
    assert pool.idle_bytes == 0


def test_decoder_receives_large_payloads_into_pooled_buffers() -> None:
    pool = ipc.ReceiveBufferPool(max_bytes=64 * MiB)
    body = bytes(range(256)) * 4096 * 2  # 2 MiB: over the staging buffer
    data = _wire(encode_envelope_frame(3, FrameType.REQUEST, {"op": "x"}, body)) * 2
    decoder = FrameDecoder(allocate=pool.acquire)
    first, second = iter_frames(decoder, [data])
    assert pool.lent == 2
    bodies = []
    for frame in (first, second):
        assert isinstance(frame.payload, memoryview) and frame.payload.nbytes < len(frame.payload.obj)
        meta, got = decode_envelope(frame.payload)
        assert meta == {"op": "x"} and got == body
        bodies.append(got)
    del got
    assert pool.release(first.payload, bodies[0]) is True
    assert pool.release(second.payload) is False  # its body view is still alive


# -- the pool in the channel: concurrent requests, cancel, errors ----------------------------------

kept_bodies: list[memoryview] = []


def pool_handler(meta, body):
    if meta["op"] == "keep":
        kept_bodies.append(body[:])
        return Reply(b"kept")
    return toy_handler(meta, body)


@pytest.fixture
def pooled_pair():
    a, b = socket.socketpair()
    pool = ipc.ReceiveBufferPool(max_bytes=64 * MiB)
    lent_buffers: list[int] = []  # ids of every buffer lent (kept alive below, so ids stay unique)
    alive = []
    acquire = pool.acquire

    def recording_acquire(size: int):
        buffer = acquire(size)
        alive.append(buffer)
        lent_buffers.append(id(buffer))
        return buffer

    pool.acquire = recording_acquire
    server = IpcServer(open_socket(b.detach()), pool_handler, name="pool-server", receive_pool=pool)
    client = IpcClient(open_socket(a.detach()), name="pool-client")
    yield client, server, lent_buffers
    client.close()
    server.close()
    kept_bodies.clear()


def _body(i: int, size: int = 600 * 1024) -> bytes:
    return bytes([i % 251]) * (size - 8) + i.to_bytes(8, "big")


def test_concurrent_large_bodies_each_see_only_their_own_bytes(pooled_pair) -> None:
    client, server, lent_buffers = pooled_pair

    def wave(base: int) -> None:
        jobs = [gevent.spawn(client.request, {"op": "echo", "delay": 0.02 * ((5 * i) % 7)}, _body(base + i),
                             timeout=10) for i in range(8)]
        gevent.joinall(jobs, timeout=10, raise_error=True)
        assert [j.value.body for j in jobs] == [_body(base + i) for i in range(8)]

    wave(0)
    first_wave = set(lent_buffers)
    assert len(first_wave) > 1  # the requests overlapped, each in a buffer of its own
    wave(100)
    assert set(lent_buffers[len(first_wave):]) & first_wave  # the second wave reused them
    assert server.receive_pool.lent == 0


def test_a_kept_body_is_never_overwritten(pooled_pair) -> None:
    client, server, _ = pooled_pair
    assert client.request({"op": "keep"}, _body(1), timeout=5).body == b"kept"
    for i in range(2, 5):
        assert client.request({"op": "echo"}, _body(i), timeout=5).body == _body(i)
    assert bytes(kept_bodies[0]) == _body(1)
    assert server.receive_pool.lent == 0


def test_timed_out_and_failed_requests_give_their_buffers_back(pooled_pair) -> None:
    client, server, lent_buffers = pooled_pair
    with pytest.raises(IpcTimeout):
        client.request({"op": "echo", "hold": True}, _body(1), timeout=0.05)
    until(lambda: gate.entered == 1)
    assert server.receive_pool.lent == 1  # the handler still runs (held): its body stays lent
    with pytest.raises(IpcRemoteError):
        client.request({"op": "fail"}, _body(2), timeout=5)
    killed = gevent.spawn(client.request, {"op": "echo", "hold": True}, _body(3), timeout=5)
    until(lambda: gate.entered == 2)
    killed.kill()
    assert server.receive_pool.lent == 2  # both held handlers still hold their bodies
    gate.opened.set()
    until(lambda: server.receive_pool.lent == 0)
    assert server.receive_pool.idle_bytes > 0
    assert client.request({"op": "echo"}, _body(4), timeout=5).body == _body(4)
    assert len(set(lent_buffers)) < len(lent_buffers)  # buffers given back were lent again


def test_busy_worker_gives_the_refused_body_back(pooled_pair, monkeypatch) -> None:
    client, server, _ = pooled_pair
    monkeypatch.setattr("webapp.ipc_channel.MAX_INFLIGHT_REQUESTS", 1)
    slow = gevent.spawn(client.request, {"op": "echo", "hold": True}, _body(1), timeout=5)
    until(lambda: gate.entered == 1)
    with pytest.raises(IpcRemoteError) as info:
        client.request({"op": "echo"}, _body(2), timeout=5)
    assert info.value.worker_busy and info.value.remote_type == ipc.WORKER_BUSY
    assert server.receive_pool.lent == 1
    gate.opened.set()
    slow.join(timeout=5)
    assert slow.value.body == _body(1)
    until(lambda: server.receive_pool.lent == 0)


# -- streamed request bodies (the router never holds a whole body) ----------

def _pieces(body: bytes, size: int, seen: list[int] | None = None, client: IpcClient | None = None):
    for i in range(0, len(body), size):
        if seen is not None:
            seen.append(client._transport.bulk_bytes)
        yield body[i : i + size]


@pytest.mark.parametrize("known_length", [True, False])
def test_streamed_request_bodies_arrive_whole(pooled_pair, known_length) -> None:
    client, server, _ = pooled_pair

    def call(i: int) -> bytes:
        body = _body(i, 3 * 1024 * 1024 + i)
        reply = client.request({"op": "echo"}, timeout=10, body_stream=_pieces(body, 300_000 + i),
                               body_length=len(body) if known_length else None)
        return b"".join(reply.stream) if reply.stream is not None else reply.body

    jobs = [gevent.spawn(call, i) for i in range(6)]
    gevent.joinall(jobs, timeout=30, raise_error=True)
    assert [j.value for j in jobs] == [_body(i, 3 * 1024 * 1024 + i) for i in range(6)]
    assert client.request({"op": "echo"}, timeout=5, body_stream=iter(()), body_length=0).body == b""
    until(lambda: server.receive_pool.lent == 0 and not server._incoming and not server._inflight)


def test_a_streamed_body_never_queues_more_than_the_window(pair) -> None:
    client, _ = pair
    seen: list[int] = []
    body = bytes(range(256)) * (256 * 1024)  # 64 MiB, produced far faster than a socket takes it
    reply = client.request({"op": "echo"}, timeout=30, body_stream=_pieces(body, 1 << 20, seen, client),
                           body_length=len(body))
    assert reply.length == len(body)
    reply.stream.close()
    assert max(seen) <= STREAM_WINDOW + (1 << 20)


def test_a_failing_body_cancels_its_request_and_the_worker_forgets_it(pooled_pair) -> None:
    client, server, _ = pooled_pair

    def broken():
        yield b"x" * (2 << 20)
        raise ValueError("client went away")

    with pytest.raises(ValueError, match="went away"):
        client.request({"op": "echo"}, timeout=5, body_stream=broken(), body_length=10 << 20)
    until(lambda: not server._incoming and not server._inflight and server.receive_pool.lent == 0)
    assert client.request({"op": "echo"}, b"still up", timeout=5).body == b"still up"


@pytest.mark.parametrize("announced", [10, 1000])
def test_a_streamed_body_unlike_its_length_fails_only_its_request(pooled_pair, announced) -> None:
    # found by the HTTP fuzz suite: a mismatch used to tear the channel (and every shard's session) down
    client, server, _ = pooled_pair
    with pytest.raises(IpcRemoteError, match="announced") as caught:
        client.request({"op": "echo"}, timeout=5, body_stream=iter([b"y" * 100]), body_length=announced)
    assert caught.value.remote_type == "BodyMismatch"
    assert client.request({"op": "echo"}, b"still up", timeout=5).body == b"still up"
    until(lambda: not server._incoming and not server._inflight and server.receive_pool.lent == 0)


def test_a_streamed_body_of_known_length_is_received_straight_into_its_buffer(pooled_pair) -> None:
    """Its pieces land in the pool buffer the handler reads (no per-piece ``bytes`` copied in),
    and no view of that buffer outlives the request: the next body reuses it."""
    client, server, lent_buffers = pooled_pair
    on_frame = server._transport._on_frame
    in_place = [0, 0]  # bytes of BODY pieces received into the body's buffer, bytes copied in

    def watch(frame: ipc.Frame) -> None:
        if frame.type is ipc.FrameType.BODY and frame.payload:
            lent = isinstance(frame.payload, memoryview) and id(frame.payload.obj) in lent_buffers
            in_place[0 if lent else 1] += len(frame.payload)
        on_frame(frame)

    server._transport._on_frame = watch
    for i in range(3):
        body = _body(i, 3 * 1024 * 1024)
        reply = client.request({"op": "echo"}, timeout=10, body_stream=_pieces(body, 1 << 20), body_length=len(body))
        assert (b"".join(reply.stream) if reply.stream is not None else reply.body) == body
        until(lambda: server.receive_pool.lent == 0)
    # All but what was read with each BODY frame's header (at most one stage's worth: 3 frames a body).
    assert in_place[1] <= 3 * 3 * ipc._STAGE_BYTES and sum(in_place) == 3 * len(body)
    assert len(set(lent_buffers)) == 1 < len(lent_buffers)  # given back whole each time, lent again
