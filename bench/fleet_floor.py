"""The raw-recv floor: the fleet round loop over plain sockets, no SDK, no WebSocket library.

What one process on this machine must spend, at least, to run the same
rounds against the same fleet host: per sandbox, one hand-written WebSocket
handshake; per step, the same calls (unmasked with a zero mask key, which the
protocol allows) written with one ``send``, and the replies read with
``recv_into`` a preallocated per-connection buffer and split on frame
headers, nothing decoded. Every step's replies are awaited before the round
ends, rounds paced on the same grid. The client's CPU per step here is the
floor the SDK's figure is compared with, in the same run on the same host.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import socket
import struct
import time
from typing import Any
from urllib.parse import urlsplit

BUFFER_BYTES = 1 << 20  # one reply (~72 KiB) and change; a frame never exceeds it here


class RawConnection:
    __slots__ = ("buffer", "call_id", "filled", "pending", "sock", "view")

    def __init__(self, url: str, token: str) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"{url}: closed during the handshake")
            head += chunk
        status, rest = head.split(b"\r\n\r\n", 1)
        if not status.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"{url}: handshake refused: {status[:80]!r}")
        self.buffer = bytearray(BUFFER_BYTES)
        self.view = memoryview(self.buffer)
        self.view[: len(rest)] = rest
        self.filled = len(rest)
        self.call_id = 0
        self.pending = 1  # the hello
        self.sock.setblocking(False)

    def send_step(self, actions: list[dict[str, Any]], observe: dict[str, Any]) -> None:
        frames = []
        for verb, args in [*((a["verb"], {k: v for k, v in a.items() if k != "verb"}) for a in actions),
                           ("screenshot", observe)]:  # fmt: skip
            self.call_id += 1
            payload = json.dumps({"type": "call", "call_id": self.call_id, "verb": verb, "args": args}).encode()
            frames.append(_client_frame(payload))
        self.pending += len(frames)
        self.sock.setblocking(True)
        self.sock.sendall(b"".join(frames))
        self.sock.setblocking(False)

    def pong(self, payload: bytes) -> None:
        self.sock.setblocking(True)
        self.sock.sendall(_client_frame(payload, opcode=0xA))
        self.sock.setblocking(False)

    def on_readable(self) -> int:
        """Read what arrived; return the number of complete messages it finished."""
        try:
            n = self.sock.recv_into(self.view[self.filled :])
        except BlockingIOError:
            return 0
        if not n:
            raise ConnectionError("the fleet host closed a connection")
        self.filled += n
        done, start = 0, 0
        while True:
            size = _frame_size(self.view, start, self.filled)
            if size is None:
                break
            opcode = self.view[start] & 0x0F
            if opcode == 0x9:  # the host's keepalive ping: answer, or it closes us after 20 s
                header = size - _payload_length(self.view, start)
                self.pong(bytes(self.view[start + header : start + size]))
            elif opcode in (0x1, 0x2):
                done += 1
            start += size
        if start:  # keep the partial frame at the front
            self.view[: self.filled - start] = self.view[start : self.filled]
            self.filled -= start
        self.pending -= done
        return done


def _payload_length(view: memoryview, start: int) -> int:
    length = view[start + 1] & 0x7F
    if length == 126:
        return struct.unpack_from("!H", view, start + 2)[0]
    if length == 127:
        return struct.unpack_from("!Q", view, start + 2)[0]
    return length


def _client_frame(payload: bytes, opcode: int = 1) -> bytes:
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + b"\0\0\0\0" + payload  # a zero mask key: the payload goes as is


def _frame_size(view: memoryview, start: int, end: int) -> int | None:
    """Bytes of the complete (unmasked, server) frame at ``start``, or None if incomplete."""
    if end - start < 2:
        return None
    length = view[start + 1] & 0x7F
    header = 2
    if length == 126:
        if end - start < 4:
            return None
        length = struct.unpack_from("!H", view, start + 2)[0]
        header = 4
    elif length == 127:
        if end - start < 10:
            return None
        length = struct.unpack_from("!Q", view, start + 2)[0]
        header = 10
    return header + length if end - start >= header + length else None


def run_floor(spec: dict[str, Any], actions_of: Any, observe: dict[str, Any], cpu_seconds: Any) -> dict[str, Any]:
    """Dial every sandbox raw, run warm-up + ``rounds`` paced rounds, report CPU per step."""
    conns = [RawConnection(url, spec["token"]) for url in spec["urls"]]
    selector = selectors.DefaultSelector()
    for conn in conns:
        selector.register(conn.sock, selectors.EVENT_READ, conn)

    def drain() -> None:
        while any(c.pending for c in conns):
            for key, _ in selector.select(30):
                key.data.on_readable()

    drain()  # the hellos
    period, rounds = spec["period"], spec["rounds"]
    walls: list[float] = []
    cpu0 = 0.0
    t0 = time.monotonic()
    for k in range(1 + rounds):
        time.sleep(max(0.0, t0 + k * period - time.monotonic()))
        if k == 1:
            cpu0 = cpu_seconds()
        started = time.monotonic()
        actions = actions_of(k)
        for conn in conns:
            conn.send_step(actions, observe)
        drain()
        if k >= 1:
            walls.append(time.monotonic() - started)
    cpu = cpu_seconds() - cpu0
    for conn in conns:
        conn.sock.close()
    steps = len(conns) * rounds
    walls.sort()
    return {
        "n": spec["n"], "face": "floor", "connected": len(conns), "rounds": rounds,
        "actions_per_step": spec.get("actions", 1),
        "client_cpu_ms_per_step": 1000 * cpu / max(1, steps),
        "round_wall_p50_s": walls[len(walls) // 2] if walls else None,
    }  # fmt: skip
