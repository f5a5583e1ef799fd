"""Client for the inference backend: the HTTP half of an engine dialect (:mod:`webapp.engines`).

One pooled ``requests.Session`` per core; every call has explicit (connect, read) timeouts and
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

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from requests.utils import get_environ_proxies

from webapp.session_errors import BackendMalformed, BackendTimeout, BackendUnreachable, UpstreamStatus
from webapp.settings import default

__all__ = ["MAX_BACKEND_REPLY_BYTES", "REPLAY_KEYS", "BackendClient", "BackendReply",
           "ProxyReply", "parse_backend_reply", "replay_spans"]

# A 50-turn computer-use session at production MoE shape accumulates ~64 MiB of R3 per reply
# (see the seed); 4 GiB leaves ample headroom while refusing a runaway body before it is read.
MAX_BACKEND_REPLY_BYTES = 4 << 30
_READ_CHUNK = 1 << 20
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


class BackendClient:
    def __init__(self, base_url: str, *, connect_timeout: float = default("connect_timeout"),
                 read_timeout: float = default("read_timeout"), pool_maxsize: int = default("pool_maxsize"),
                 name: str = "backend") -> None:
        """``name`` starts every error message (the dialect's: ``vllm engine``, ``sglang engine``)."""
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.timeout = (connect_timeout, read_timeout)
        self._http = requests.Session()
        # What requests takes from the environment (HTTP_PROXY/NO_PROXY for the engine's URL, a
        # CA bundle), read once here: it would otherwise read and match the whole environment on
        # every call (~5 % of a chat's server CPU, measured). Set after start, they are not seen;
        # ~/.netrc credentials are not used for the engine.
        self._http.proxies = get_environ_proxies(self.base_url)
        self._http.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
        self._http.trust_env = False
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_maxsize, max_retries=0)
        self._http.mount("http://", adapter)
        self._http.mount("https://", adapter)

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        """POST ``payload`` (JSON bytes) to the engine endpoint ``path`` (the dialect's).

        ``deadline`` (``time.monotonic()``) caps the connect and read timeouts: past it the
        call fails with :class:`BackendTimeout`.
        """
        url = self.base_url + path
        connect_timeout, read_timeout = self.timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendTimeout(f"{self.name} timed out: the turn's time budget ran out before the call")
            connect_timeout, read_timeout = min(connect_timeout, left), min(read_timeout, left)
        try:
            resp = self._http.post(url, data=payload, timeout=(connect_timeout, read_timeout), stream=True,
                                   headers={"Content-Type": "application/json"})
            with resp:
                raw = self._read_body(resp, read_timeout)
        except requests.Timeout as exc:
            raise BackendTimeout(f"{self.name} at {self.base_url} timed out: {exc}") from exc
        except requests.RequestException as exc:
            raise BackendUnreachable(f"{self.name} at {self.base_url} unreachable: {exc}") from exc
        if resp.status_code != 200:
            raise UpstreamStatus(resp.status_code, raw,
                                 resp.headers.get("Content-Type", "application/octet-stream"))
        return BackendReply.from_raw(raw)

    def proxy(self, method: str, path: str, query: str, body: bytes, headers: dict[str, str], *,
              routing_key: str) -> ProxyReply:
        """Forward one request to ``<backend>/<path>?<query>``; any status is returned as is.

        ``routing_key`` goes out as ``X-SMG-Routing-Key`` (as miles sends it), so a router in
        front of the engines keeps a session on one engine.
        """
        url = f"{self.base_url}/{path.lstrip('/')}" + (f"?{query}" if query else "")
        try:
            resp = self._http.request(method, url, data=body or None, timeout=self.timeout, stream=True,
                                      headers={**headers, "X-SMG-Routing-Key": routing_key})
            with resp:
                raw = self._read_body(resp, self.timeout[1])
        except requests.Timeout as exc:
            raise BackendTimeout(f"backend timed out: {exc}") from exc
        except requests.RequestException as exc:
            raise BackendUnreachable(f"backend unreachable: {exc}") from exc
        return ProxyReply(resp.status_code, resp.headers.get("Content-Type", ""), raw)

    def _read_body(self, resp: requests.Response, read_timeout: float) -> bytes:
        declared = resp.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BACKEND_REPLY_BYTES:
            raise BackendMalformed(f"backend reply of {declared} bytes exceeds {MAX_BACKEND_REPLY_BYTES}")
        # requests' read timeout bounds each socket read; the deadline bounds the whole body.
        deadline = time.monotonic() + read_timeout
        chunks: list[bytes] = []
        size = 0
        for chunk in resp.iter_content(_READ_CHUNK):
            size += len(chunk)
            if size > MAX_BACKEND_REPLY_BYTES:
                raise BackendMalformed(f"backend reply exceeds {MAX_BACKEND_REPLY_BYTES} bytes")
            if time.monotonic() > deadline:
                raise requests.Timeout(f"reply body not complete after {read_timeout:.3g} s")
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self._http.close()
