"""Client for the inference backend: the HTTP half of an engine dialect (:mod:`webapp.engines`).

One urllib3 connection pool per core (requests' own transport, driven directly: requests'
per-call session merging, hooks and cookies were ~12 % of a chat's server CPU); every call has explicit (connect, read) timeouts and
the body read is bounded by ``MAX_BACKEND_REPLY_BYTES`` and by the read timeout as a total
deadline. Failures are translated once, here:

- transport errors -> ``BackendUnreachable``; connect/read timeouts -> ``BackendTimeout``
- a 200 reply that is not a UTF-8 JSON object -> ``BackendMalformed``
- a non-200 reply -> ``UpstreamStatus`` carrying the backend's body, relayed untouched

R3 is kept where it costs least: ``parse_backend_reply`` never decodes the replay payloads
(``routed_experts``, ``indexer_topk``: most of a big reply's bytes). It checks that they are
plain base64 and parses the rest; the raw bytes, R3 included, go into the record verbatim.

``proxy`` forwards any other request (the session server's catch-all route, e.g.
``GET /v1/models``) and returns the backend's status, content type and body untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import certifi
import urllib3
from requests.utils import get_auth_from_url, get_environ_proxies, select_proxy

from webapp.bulk import bulk_io
from webapp.ipc import Buffer
from webapp.session_errors import BackendMalformed, BackendTimeout, BackendUnreachable, UpstreamStatus
from webapp.settings import default
from webapp.sockets import readable_now, send_gathered, send_small

__all__ = ["MAX_BACKEND_REPLY_BYTES", "REPLAY_KEYS", "BackendClient", "BackendReply",
           "ProxyReply", "parse_backend_reply", "payload_bytes", "replay_spans"]

# A 50-turn computer-use session at production MoE shape accumulates ~64 MiB of R3 per reply
# (see the seed); 4 GiB leaves ample headroom while refusing a runaway body before it is read.
MAX_BACKEND_REPLY_BYTES = 4 << 30
_READ_CHUNK = 1 << 20
_JSON_HEADERS = {"Content-Type": "application/json"}
# The replay payloads (routing replay R3, indexer replay): base64 strings, most of a big
# reply's bytes, kept verbatim and never decoded on the turn path.
REPLAY_KEYS = ("routed_experts", "indexer_topk")
_REPLAY_KEY_RE = re.compile(rb'"(' + b"|".join(k.encode() for k in REPLAY_KEYS) + rb')"[ \t\r\n]*:[ \t\r\n]*"')
_CHECK_SLICE = 256 << 10
_BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def _check_base64(raw: bytes, start: int, end: int, key: str) -> None:
    # Slices that stay in cache: about twice as fast as translating one 50 MB copy.
    for i in range(start, end, _CHECK_SLICE):
        if raw[i:min(i + _CHECK_SLICE, end)].translate(None, _BASE64_ALPHABET):
            raise BackendMalformed(f"{key} is not plain base64")


def replay_spans(raw: bytes) -> Iterator[tuple[str, int, int]]:
    """``(key, start, end)`` of every ``"<replay key>": "<base64>"`` string value in ``raw``,
    in order; ``raw[start:end]`` is the base64 text, checked to be plain base64.

    An unescaped ``"routed_experts"`` followed by ``:`` can only be an object key (inside a
    JSON string every quote is escaped), and base64 holds no quote, so the value ends at the
    next quote. Checking its alphabet (about 5x cheaper than decoding it) keeps ``raw`` safe to
    embed verbatim in records. A null or non-string value is not a span (it parses normally).
    """
    pos = 0
    while (match := _REPLAY_KEY_RE.search(raw, pos)) is not None:
        key, start = match.group(1).decode(), match.end()
        end = raw.find(b'"', start)
        if end < 0:
            raise BackendMalformed(f"unterminated {key} string")
        _check_base64(raw, start, end, key)
        yield key, start, end
        pos = end + 1


def parse_backend_reply(raw: bytes, spans: list[tuple[str, int, int]] | None = None) -> dict[str, Any]:
    """``json.loads(raw)``, except that every replay payload (``"routed_experts"`` /
    ``"indexer_topk"``: ``"<base64>"``) parses as "" — see :func:`replay_spans` (``spans``:
    its result, when the caller has it already)."""
    pieces: list[bytes] = []
    pos = 0
    for _key, start, end in (replay_spans(raw) if spans is None else spans):
        pieces.append(raw[pos:start])
        pos = end
    text = raw if not pieces else b"".join([*pieces, raw[pos:]])
    try:
        parsed = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BackendMalformed(f"backend reply is not UTF-8 JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise BackendMalformed("backend reply is not a JSON object")
    return parsed


@dataclass
class BackendReply:
    raw: bytes  # the body exactly as received: records embed it verbatim (R3 included)
    parsed: dict[str, Any]  # parse_backend_reply(raw): replay payload values are ""
    replay_spans: list[tuple[str, int, int]]  # replay_spans(raw), found once

    @classmethod
    def from_raw(cls, raw: bytes) -> BackendReply:
        """Raises ``BackendMalformed`` if ``raw`` is not a JSON object with plain-base64 replay payloads."""
        spans = list(replay_spans(raw))
        return cls(raw, parse_backend_reply(raw, spans), spans)


@dataclass
class ProxyReply:
    status: int
    content_type: str
    body: bytes


# A request body up to this size goes out in the same send as the request's head: urllib3
# sends them apart (two syscalls, and two segments the engine may wake up for); a larger body
# is sent as urllib3 sends it rather than copied into one buffer.
_JOIN_BODY_MAX = 64 << 10
# A request body past this size (image turns) waits for the hub's pending small work first.
_BULK_BODY_BYTES = 1 << 20
# What urllib3 sends as a body's first header: kept first when the length is given by us.
_USER_AGENT = f"python-urllib3/{urllib3.__version__}"  # type: ignore[attr-defined]


def payload_bytes(payload: bytes | Sequence[Buffer]) -> bytes:
    """The bytes a request payload stands for: itself, or its pieces joined (a copy: for a
    test or an inspection, never the turn's send)."""
    return payload if isinstance(payload, bytes) else b"".join(payload)


class _Pieces:
    """A request body kept as pieces (an image turn's engine request: the data URLs are views
    of the client's body). urllib3 hands it to the connection's ``send`` as one chunk (it is
    neither bytes-like nor a file); :class:`_HeadWithBodyConnection` sends it after the head by
    ``sendmsg`` from the pieces (no joined copy of the megabytes), any other connection piece
    by piece (``http.client`` iterates what ``sendall`` does not take)."""

    def __init__(self, pieces: Sequence[Buffer]) -> None:
        self.pieces = pieces
        self.size = sum(map(len, pieces))

    def __iter__(self) -> Iterator[Buffer]:
        return iter(self.pieces)

    def headers(self) -> dict[str, str]:
        """The request's headers in the order urllib3 writes them for a bytes body (its
        ``Content-Length``, then ``User-Agent``, then ours): the same bytes on the wire."""
        return {"Content-Length": str(self.size), "User-Agent": _USER_AGENT, **_JSON_HEADERS}


class _HeadWithBodyConnection(urllib3.connection.HTTPConnection):
    """urllib3's connection, except that a small bytes body is sent joined to the head (one
    ``send`` when the socket takes it whole), a body in pieces (:class:`_Pieces`) gathered
    behind the head by ``sendmsg``, and the check of a kept-alive connection before its reuse
    is one real ``poll`` (:mod:`webapp.sockets`)."""

    _join: bytes | _Pieces | None = None
    _held: bytes | None = None

    def request(self, method: str, url: str, body: Any = None,
                headers: Any = None, **kwargs: Any) -> None:
        framed = not kwargs.get("chunked") and not any(k.lower() == "transfer-encoding" for k in headers or ())
        if isinstance(body, bytes) and 0 < len(body) <= _JOIN_BODY_MAX and framed:
            self._join = body
        elif isinstance(body, tuple) and len(body) == 1 and isinstance(body[0], _Pieces) and framed:
            self._join = body[0]
        try:
            super().request(method, url, body, headers, **kwargs)
        finally:
            held, self._held, self._join = self._held, None, None
        if held is not None:  # the body never followed (not expected): the head still goes out
            super().send(held)

    def send(self, data: Any) -> None:
        if self._join is not None:
            if self._held is None:  # http.client's one send of the whole head
                self._held = bytes(data)
                return
            if data is self._join:  # urllib3's send of the body: head and body in one
                head, self._held, self._join = self._held, None, None
                if self.sock is None:  # a new connection: opened here, as http.client's send does
                    self.connect()
                if isinstance(data, _Pieces):
                    send_gathered(self.sock, [head, *data.pieces])
                else:
                    send_small(self.sock, head + data)
                return
        super().send(data)

    @property
    def is_connected(self) -> bool:
        return self.sock is not None and not readable_now(self.sock)


_TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, OSError)


def _translated(exc: BaseException, who: str) -> BackendTimeout | BackendUnreachable:
    """A transport error as the session's: a connect or read timeout is ``BackendTimeout``,
    anything else (refused, reset, cut short, a proxy that failed) ``BackendUnreachable``.
    urllib3 makes a refused connection a ``ConnectTimeoutError`` too (``NewConnectionError``):
    it is not a timeout, as requests did not count it one."""
    if isinstance(exc, urllib3.exceptions.TimeoutError) and not isinstance(exc, urllib3.exceptions.NewConnectionError):
        return BackendTimeout(f"{who} timed out: {exc}")
    return BackendUnreachable(f"{who} unreachable: {exc}")


class BackendClient:
    def __init__(self, base_url: str, *, connect_timeout: float = default("connect_timeout"),
                 read_timeout: float = default("read_timeout"), pool_maxsize: int = default("pool_maxsize"),
                 name: str = "backend") -> None:
        """``name`` starts every error message (the dialect's: ``vllm engine``, ``sglang engine``)."""
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.timeout = (connect_timeout, read_timeout)
        # What the environment says for the engine's URL (HTTP_PROXY/NO_PROXY, a CA bundle) is
        # read once here, with requests' own rules so the choice is the one requests made when
        # it carried these calls. Set after start, it is not seen; ~/.netrc is not used.
        proxy = select_proxy(self.base_url, get_environ_proxies(self.base_url))
        verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or certifi.where()
        tls: dict[str, Any] = {"cert_reqs": "CERT_REQUIRED",
                               ("ca_cert_dir" if os.path.isdir(verify) else "ca_certs"): verify}
        pool: dict[str, Any] = {"maxsize": pool_maxsize, "block": False, "retries": False}
        self._manager: urllib3.PoolManager | None = None
        if proxy:
            # urllib3 itself, as requests' HTTPAdapter drives it: the proxy sees absolute URLs
            # (http) or a CONNECT tunnel (https); credentials in the proxy's URL go out as
            # Proxy-Authorization.
            user, password = get_auth_from_url(proxy)
            headers = urllib3.make_headers(proxy_basic_auth=f"{user}:{password}") if user else None
            self._manager = urllib3.ProxyManager(proxy, proxy_headers=headers, num_pools=1, **pool, **tls)
            self._prefix = self.base_url
        else:
            https = self.base_url.lower().startswith("https:")
            self._pool = urllib3.connection_from_url(self.base_url, **pool, **(tls if https else {}))
            if not https:
                self._pool.ConnectionCls = _HeadWithBodyConnection
            self._prefix = urllib3.util.parse_url(self.base_url).path or ""

    def _open(self, method: str, target: str, body: Any, headers: dict[str, str],
              timeout: urllib3.Timeout) -> urllib3.BaseHTTPResponse:
        # No retries, no redirects followed: a 3xx is the engine's answer, relayed like any
        # other status; the body is read by _read_body, bounded.
        if self._manager is not None:
            return self._manager.urlopen(method, self._prefix + target, body=body, headers=headers,
                                         timeout=timeout, retries=False, redirect=False,
                                         preload_content=False)
        return self._pool.urlopen(method, self._prefix + target, body=body, headers=headers, timeout=timeout,
                                  retries=False, redirect=False, preload_content=False,
                                  assert_same_host=False)

    def send(self, path: str, payload: bytes | Sequence[Buffer], *, deadline: float | None = None) -> BackendReply:
        """POST ``payload`` (JSON bytes, or its pieces in order: sent without joining them) to
        the engine endpoint ``path`` (the dialect's).

        ``deadline`` (``time.monotonic()``) caps the connect and read timeouts: past it the
        call fails with :class:`BackendTimeout`.
        """
        connect_timeout, read_timeout = self.timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendTimeout(f"{self.name} timed out: the turn's time budget ran out before the call")
            connect_timeout, read_timeout = min(connect_timeout, left), min(read_timeout, left)
        # An image turn's body: the process's small requests first, and its bulk lane left while
        # the engine works (webapp.bulk).
        body: Any = payload
        headers = _JSON_HEADERS
        if not isinstance(payload, bytes):
            pieces = _Pieces(payload)
            # (a one-item tuple: urllib3 sends each item of an iterable body as it is)
            body, headers, size = (pieces,), pieces.headers(), pieces.size
        else:
            size = len(payload)
        waiting = bulk_io() if size > _BULK_BODY_BYTES else contextlib.nullcontext()
        try:
            with waiting:
                resp = self._open("POST", path, body, headers,
                                  urllib3.Timeout(connect=connect_timeout, read=read_timeout))
                raw = self._read_body(resp, read_timeout)
        except _TRANSPORT_ERRORS as exc:
            raise _translated(exc, f"{self.name} at {self.base_url}") from exc
        if resp.status != 200:
            raise UpstreamStatus(resp.status, raw, resp.headers.get("Content-Type", "application/octet-stream"))
        return BackendReply.from_raw(raw)

    def proxy(self, method: str, path: str, query: str, body: bytes, headers: dict[str, str], *,
              routing_key: str) -> ProxyReply:
        """Forward one request to ``<backend>/<path>?<query>``; any status is returned as is.

        ``routing_key`` goes out as ``X-SMG-Routing-Key`` (as miles sends it), so a router in
        front of the engines keeps a session on one engine.
        """
        target = f"/{path.lstrip('/')}" + (f"?{query}" if query else "")
        try:
            resp = self._open(method, target, body or None, {**headers, "X-SMG-Routing-Key": routing_key},
                              urllib3.Timeout(connect=self.timeout[0], read=self.timeout[1]))
            raw = self._read_body(resp, self.timeout[1])
        except _TRANSPORT_ERRORS as exc:
            raise _translated(exc, "backend") from exc
        return ProxyReply(resp.status, resp.headers.get("Content-Type", ""), raw)

    def _read_body(self, resp: urllib3.BaseHTTPResponse, read_timeout: float) -> bytes:
        """The whole body, then the connection back to the pool; on any failure the connection
        is closed (a half-read reply must not be reused)."""
        done = False
        try:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > MAX_BACKEND_REPLY_BYTES:
                raise BackendMalformed(f"backend reply of {declared} bytes exceeds {MAX_BACKEND_REPLY_BYTES}")
            # The read timeout bounds each socket read; the deadline bounds the whole body.
            deadline = time.monotonic() + read_timeout
            chunks: list[bytes] = []
            size = 0
            while chunk := resp.read(_READ_CHUNK):
                size += len(chunk)
                if size > MAX_BACKEND_REPLY_BYTES:
                    raise BackendMalformed(f"backend reply exceeds {MAX_BACKEND_REPLY_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise BackendTimeout(f"{self.name} at {self.base_url} timed out: "
                                         f"reply body not complete after {read_timeout:.3g} s")
                chunks.append(chunk)
                if resp.length_remaining == 0:  # the declared length read: no read to see the end
                    break
            done = True
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        finally:
            if not done:
                resp.close()
            resp.release_conn()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.clear()
        else:
            self._pool.close()
