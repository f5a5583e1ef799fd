"""A raw WebSocket client over a plain socket, for hostile-input tests.

websockets' own client refuses to send what these tests must send (bad frames,
invalid UTF-8 in text frames, half a handshake) and cannot reset a connection
(RST) on purpose. This one writes frames byte by byte and reads the daemon's
replies just well enough to check them.
"""

from __future__ import annotations

import base64
import os
import socket
import struct
import urllib.parse
from dataclasses import dataclass

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


@dataclass(frozen=True)
class Closed:
    """The daemon's close frame (``code`` None for a close without a code, or a
    connection that ended without any close frame: ``clean`` False)."""

    code: int | None
    clean: bool


class RawWs:
    def __init__(self, url: str, token: str, *, timeout: float = 20.0, handshake: bool = True):
        parts = urllib.parse.urlsplit(url)
        self.path = parts.path
        self.token = token
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        self._buffer = b""
        if handshake:
            self.handshake()

    def request(self) -> bytes:
        key = base64.b64encode(os.urandom(16)).decode()
        return (
            f"GET {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer {self.token}\r\n\r\n"
        ).encode()

    def handshake(self) -> int:
        """Upgrade; returns the HTTP status (101 on success)."""
        self.sock.sendall(self.request())
        while b"\r\n\r\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the daemon closed during the handshake")
            self._buffer += chunk
        head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        return int(head.split(b" ", 2)[1])

    # -- sending -------------------------------------------------------------

    def send_frame(self, opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0, mask: bool = True) -> None:
        self.sock.sendall(frame(opcode, payload, fin=fin, rsv=rsv, mask=mask))

    def send_text(self, text: str | bytes) -> None:
        """A text frame; ``bytes`` go out as they are (invalid UTF-8 included)."""
        self.send_frame(OP_TEXT, text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))

    # -- receiving -----------------------------------------------------------

    def _read(self, n: int) -> bytes | None:
        while len(self._buffer) < n:
            try:
                chunk = self.sock.recv(max(65536, n - len(self._buffer)))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            self._buffer += chunk
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    def recv(self) -> str | bytes | Closed:
        """The next data message (pings are answered, pongs skipped) or :class:`Closed`."""
        parts: list[bytes] = []
        first_op = None
        while True:
            head = self._read(2)
            if head is None:
                return Closed(None, clean=False)
            fin, opcode, length = head[0] & 0x80, head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                (length,) = struct.unpack(">H", self._read(2) or b"\0\0")
            elif length == 127:
                (length,) = struct.unpack(">Q", self._read(8) or b"\0" * 8)
            payload = self._read(length)
            if payload is None:
                return Closed(None, clean=False)
            if opcode == OP_CLOSE:
                return Closed(struct.unpack(">H", payload[:2])[0] if len(payload) >= 2 else None, clean=True)
            if opcode == OP_PING:
                self.send_frame(OP_PONG, payload)
                continue
            if opcode == OP_PONG:
                continue
            if first_op is None:
                first_op = opcode
            parts.append(payload)
            if fin:
                data = b"".join(parts)
                return data.decode() if first_op == OP_TEXT else data

    # -- ending --------------------------------------------------------------

    def reset(self) -> None:
        """Drop the connection with a TCP RST (SO_LINGER 0), as a crashed client would."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


def frame(opcode: int, payload: bytes, *, fin: bool = True, rsv: int = 0, mask: bool = True) -> bytes:
    """One client frame, masked unless told otherwise (RFC 6455 section 5.2)."""
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    n = len(payload)
    bit = 0x80 if mask else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 65536:
        head += bytes([bit | 126]) + struct.pack(">H", n)
    else:
        head += bytes([bit | 127]) + struct.pack(">Q", n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + _xor(payload, key)


def _xor(data: bytes, key: bytes) -> bytes:
    if not data:
        return b""
    repeated = (key * (len(data) // 4 + 1))[: len(data)]
    return (int.from_bytes(data, "big") ^ int.from_bytes(repeated, "big")).to_bytes(len(data), "big")
