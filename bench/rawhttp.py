"""A minimal HTTP/1.1 keep-alive client on a raw socket, so a bench measures the server.

Blocking; cooperative under gevent once the process is patched. Importing it patches nothing.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence

from webapp.sockets import send_gathered

MiB = 1024**2


def url_addr(url: str) -> tuple[str, int]:
    match = re.match(r"http://([^:/]+):(\d+)", url)
    if match is None:
        raise ValueError(f"not an http://HOST:PORT URL: {url}")
    return match.group(1), int(match.group(2))


class Http:
    def __init__(self, url: str, timeout: float = 600.0) -> None:
        self.addr = url_addr(url)
        self.sock = socket.create_connection(self.addr, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle/delayed-ACK stalls
        self.rfile = self.sock.makefile("rb", buffering=256 * 1024)

    def request(self, method: str, path: str, body: bytes | Sequence[bytes] = b"",
                sink: bool = False) -> tuple[int, bytes | int]:
        """(status, body); ``body`` may be pieces, sent gathered (a multi-MiB screenshot body
        joined into one buffer cost the load generator a copy per turn); ``sink``: (status,
        body length), the body read and discarded in 4 MiB pieces (a records GET can be GiBs)."""
        pieces = [body] if isinstance(body, bytes) else list(body)
        head = (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nContent-Length: {sum(map(len, pieces))}\r\n"
                f"Content-Type: application/json\r\n\r\n").encode()
        send_gathered(self.sock, [head, *pieces])
        status_line = self.rfile.readline()
        if not status_line:
            raise ConnectionError(f"{method} {path}: connection closed before the reply")
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = self.rfile.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        if not sink:
            return status, self.rfile.read(length)
        left = length
        while left:
            left -= len(self.rfile.read1(min(left, 4 * MiB)))
        return status, length

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()
