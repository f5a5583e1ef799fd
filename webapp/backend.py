"""Client for the inference backend (SGLang/vLLM-style chat completions with ``input_ids``).

One pooled ``requests.Session`` per core; every call has explicit (connect, read) timeouts and
the body read is bounded by ``MAX_BACKEND_REPLY_BYTES`` and by the read timeout as a total
deadline. Failures are translated once, here:

- transport errors -> ``BackendUnreachable``; connect/read timeouts -> ``BackendTimeout``
- a 200 reply that is not a UTF-8 JSON object -> ``BackendMalformed``
- a non-200 reply -> ``UpstreamStatus`` carrying the backend's body, relayed untouched

R3 is kept where it costs least: ``parse_backend_reply`` never decodes the ``routed_experts``
strings (most of a big reply's bytes). It checks that they are plain base64 and parses the
rest; the raw bytes, R3 included, go into the record verbatim.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from webapp.session_errors import BackendMalformed, BackendTimeout, BackendUnreachable, UpstreamStatus

__all__ = ["CHAT_COMPLETIONS_PATH", "MAX_BACKEND_REPLY_BYTES", "BackendClient", "BackendReply",
           "parse_backend_reply"]

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
# A 50-turn computer-use session at production MoE shape accumulates ~64 MiB of R3 per reply
# (see the seed); 4 GiB leaves ample headroom while refusing a runaway body before it is read.
MAX_BACKEND_REPLY_BYTES = 4 << 30
_READ_CHUNK = 1 << 20
_R3_KEY = b'"routed_experts"'
_JSON_SPACE = b" \t\r\n"
_CHECK_SLICE = 256 << 10
_BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def _skip_space(raw: bytes, i: int) -> int:
    while i < len(raw) and raw[i] in _JSON_SPACE:
        i += 1
    return i


def _check_base64(raw: bytes, start: int, end: int) -> None:
    # Slices that stay in cache: about twice as fast as translating one 50 MB copy.
    for i in range(start, end, _CHECK_SLICE):
        if raw[i:min(i + _CHECK_SLICE, end)].translate(None, _BASE64_ALPHABET):
            raise BackendMalformed("routed_experts is not plain base64")


def parse_backend_reply(raw: bytes) -> dict[str, Any]:
    """``json.loads(raw)``, except that every ``"routed_experts": "<base64>"`` value parses as "".

    An unescaped ``"routed_experts"`` followed by ``:`` can only be an object key (inside a
    JSON string every quote is escaped), and base64 holds no quote, so the value ends at the
    next quote. Checking its alphabet (about 5x cheaper than decoding it) keeps ``raw`` safe to
    embed verbatim in records.
    """
    pieces: list[bytes] = []
    pos = 0
    while (k := raw.find(_R3_KEY, pos)) >= 0:
        i = _skip_space(raw, k + len(_R3_KEY))
        if raw[i:i + 1] != b":":
            pos = i
            continue
        i = _skip_space(raw, i + 1)
        if raw[i:i + 1] != b'"':  # null or another JSON value: parsed normally
            pos = i
            continue
        end = raw.find(b'"', i + 1)
        if end < 0:
            raise BackendMalformed("unterminated routed_experts string")
        _check_base64(raw, i + 1, end)
        pieces.append(raw[pos:i + 1])
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
    parsed: dict[str, Any]  # parse_backend_reply(raw): routed_experts values are ""


class BackendClient:
    def __init__(self, base_url: str, *, connect_timeout: float = 5.0, read_timeout: float = 600.0,
                 pool_maxsize: int = 64) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = (connect_timeout, read_timeout)
        self._http = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_maxsize, max_retries=0)
        self._http.mount("http://", adapter)
        self._http.mount("https://", adapter)

    def chat_completions(self, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        """POST ``payload`` (JSON bytes) to the chat completions endpoint.

        ``deadline`` (``time.monotonic()``) caps the connect and read timeouts: past it the
        call fails with :class:`BackendTimeout`.
        """
        url = self.base_url + CHAT_COMPLETIONS_PATH
        connect_timeout, read_timeout = self.timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendTimeout("backend timed out: the turn's time budget ran out before the call")
            connect_timeout, read_timeout = min(connect_timeout, left), min(read_timeout, left)
        try:
            resp = self._http.post(url, data=payload, timeout=(connect_timeout, read_timeout), stream=True,
                                   headers={"Content-Type": "application/json"})
            with resp:
                raw = self._read_body(resp, read_timeout)
        except requests.Timeout as exc:
            raise BackendTimeout(f"backend timed out: {exc}") from exc
        except requests.RequestException as exc:
            raise BackendUnreachable(f"backend unreachable: {exc}") from exc
        if resp.status_code != 200:
            raise UpstreamStatus(resp.status_code, raw,
                                 resp.headers.get("Content-Type", "application/octet-stream"))
        return BackendReply(raw, parse_backend_reply(raw))

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
