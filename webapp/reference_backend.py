"""A deterministic stand-in for SGLang that speaks its dialect (:mod:`webapp.engines.sglang`).

``python -m webapp.reference_backend --bind 127.0.0.1:0 [--tokenizer DIR] [--r3-layers L --r3-topk K]``
serves (threaded, HTTP/1.1 keep-alive):

- ``GET /health`` -> ``{"status": "ok"}``
- ``GET /get_model_info`` -> ``{"model_path", "tokenizer_path", "is_generation"}`` and
  ``GET /get_server_info`` -> ``{"version"}``: SGLang's native answers, which the session
  server's start-up asks to tell an SGLang engine (``--backend-kind auto``)
- ``POST /v1/chat/completions``: an OpenAI chat completion for ``input_ids`` (or, without
  them, for ``messages`` rendered with the chat template). Each choice carries
  ``meta_info.output_token_logprobs`` ``[[logprob, token_id], ...]``, ``completion_tokens``,
  ``prompt_tokens`` and, when the request asks ``return_routed_experts`` and ``--r3-layers``
  is set, ``routed_experts``: base64 of (prompt + completion - 1) x layers x top_k int32 LE.

The assistant text is one computer-use action in the documented ACTION FORMAT, chosen by a
hash of the input ids, then tokenized; the token ids are followed by the end-of-turn token
(unless ``max_tokens`` cuts the output, then ``finish_reason`` is ``length``)::

    {"action": {"verb": "click", "x": 812, "y": 440, "button": "left"}}
    {"action": {"verb": "type", "text": "hello world"}}
    {"action": {"verb": "key", "combo": "ctrl+s"}}
    {"action": {"verb": "scroll", "x": 960, "y": 540, "dx": 0, "dy": -3}}

Coordinates lie inside a 1920x1080 screen. Everything except ``created`` is a deterministic
function of the input ids and the images (and the knobs), so records can be checked exactly.

Images: ``image_data`` (SGLang's field) is a list of images in order of appearance, each a
``data:image/...;base64,`` URL or bare base64. The prompt must hold as many image pad runs
(``<|vision_start|>`` then pads) as there are images, else 400; the BLAKE3 digest of each
image's bytes enters the reply's digest, so one changed pixel changes the reply. Its cost per
turn is what an engine's request handling is at least: the body's JSON
(``webapp.limits.loads_strict``, which cuts the data URLs out before decoding), each image's
base64 decoded (``pybase64``, validating) and its bytes hashed. The hash is BLAKE3, not
sha256: sha256 of a 20-screenshot history (~2.7 MB) took ~5 ms here, more than the rest of
the request, and made this stand-in the largest CPU cost of the screenshot benchmark beside
the server it measures.

When bound, it prints one JSON line on stdout: ``{"ready": true, "url": "http://HOST:PORT"}``.
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pybase64
from blake3 import blake3

from shinken_sync.childproc import ReadyLineError, ReadyLineTimeout, parse_ready_line, read_ready_line
from shinken_sync.lifetime import watch_parent
from webapp.limits import loads_strict
from webapp.session_errors import SessionError
from webapp.settings import MAX_BODY_BYTES, parse_bind
from webapp.tokenizers import ChatTokenizer, load_tokenizer

__all__ = [
    "ACTION_VERBS",
    "SCREEN_HEIGHT",
    "SCREEN_WIDTH",
    "R3Shape",
    "ReferenceBackendProcess",
    "choose_action",
    "main",
    "reference_completion",
    "reference_completion_json",
    "routed_experts_b64",
    "start_reference_backend",
]

SCREEN_WIDTH, SCREEN_HEIGHT = 1920, 1080
ACTION_VERBS = ("click", "type", "key", "scroll")
_WORDS = ("hello world", "shinken", "report.pdf", "quarterly numbers", "search terms", "ok")
_KEYS = ("Return", "Tab", "Escape", "ctrl+s", "ctrl+l", "alt+F4", "BackSpace")
REFERENCE_VERSION = "reference"  # /get_server_info: not a real SGLang version
MODEL_NAME = "shinken-reference"
MAX_REQUEST_BYTES = MAX_BODY_BYTES
# 3 * 4096 int32 values: a multiple of 3 bytes, so base64 of the tiled block is the tiled base64.
_R3_BLOCK_INTS = 3 * 4096
READY_TIMEOUT = 30.0


@dataclass(frozen=True)
class R3Shape:
    layers: int = 0  # 0: never return routed_experts
    top_k: int = 8
    num_experts: int = 128


def _digest(input_ids: Sequence[int], images: Sequence[bytes] = ()) -> bytes:
    h = hashlib.blake2b(array("q", input_ids).tobytes(), digest_size=16)
    for image in images:
        h.update(blake3(image).digest())
    return h.digest()


def choose_action(digest: bytes) -> dict[str, Any]:
    """The action for a prompt digest, in the ACTION FORMAT."""
    n = int.from_bytes(digest, "big")
    verb = ACTION_VERBS[n % len(ACTION_VERBS)]
    x, y = (n >> 8) % SCREEN_WIDTH, (n >> 24) % SCREEN_HEIGHT
    if verb == "click":
        action = {"verb": "click", "x": x, "y": y, "button": "left"}
    elif verb == "type":
        action = {"verb": "type", "text": _WORDS[(n >> 40) % len(_WORDS)]}
    elif verb == "key":
        action = {"verb": "key", "combo": _KEYS[(n >> 40) % len(_KEYS)]}
    else:
        action = {"verb": "scroll", "x": x, "y": y, "dx": 0, "dy": (n >> 40) % 11 - 5}
    return {"action": action}


@functools.lru_cache(maxsize=8)
def _expert_block(num_experts: int) -> bytes:
    block = array("i", [((j * 2654435761) >> 7) % num_experts for j in range(_R3_BLOCK_INTS)])
    if sys.byteorder != "little":
        block.byteswap()
    return block.tobytes()


def _routed_experts_base64(token_ids: Sequence[int], num_tokens: int, shape: R3Shape, start: int = 0) -> bytes:
    """Rows ``[start, num_tokens)``; row ``i`` is a function of ``i`` and ``token_ids[i]`` alone,
    so, as in a causal model, a prefix's rows do not change when tokens follow it."""
    fixed = _expert_block(shape.num_experts)
    row = shape.layers * shape.top_k
    doubled = fixed + fixed[:4 * row]  # any rotation offset has a whole row after it
    rows = []
    for i in range(max(start, 0), max(num_tokens, 0)):
        at = 4 * ((token_ids[i] * 2654435761 + i * 40503) % _R3_BLOCK_INTS)
        rows.append(doubled[at:at + 4 * row])
    return base64.b64encode(b"".join(rows))


def routed_experts_b64(token_ids: Sequence[int], num_tokens: int, shape: R3Shape, start: int = 0) -> str:
    """Base64 of rows ``[start, num_tokens)`` of ``num_tokens x layers x top_k`` little-endian
    int32 expert ids for the sequence ``token_ids`` (prompt + output), deterministic."""
    return _routed_experts_base64(token_ids, num_tokens, shape, start).decode("ascii")


def reference_completion(input_ids: Sequence[int], tokenizer: ChatTokenizer, *, max_tokens: int | None = None,
                         want_r3: bool = False, r3: R3Shape = R3Shape(),
                         images: Sequence[bytes] = (), r3_start: int = 0) -> dict[str, Any]:
    """The full backend reply for ``input_ids`` and the image bytes (pure, except ``created``);
    ``r3_start``: SGLang's ``routed_experts_start_len``, the first R3 row returned."""
    digest = _digest(input_ids, images)
    text = json.dumps(choose_action(digest), separators=(", ", ": "))
    output_ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    finish_reason = "stop"
    if max_tokens is not None and len(output_ids) > max_tokens:
        output_ids, finish_reason = output_ids[:max_tokens], "length"
    content_ids = output_ids[:-1] if finish_reason == "stop" else output_ids
    n = int.from_bytes(digest, "big")
    pairs = [[-(((n >> (i % 64)) + i * 7919 + tid) % 5000) / 1000.0, tid] for i, tid in enumerate(output_ids)]
    meta: dict[str, Any] = {
        "output_token_logprobs": pairs,
        "completion_tokens": len(output_ids),
        "prompt_tokens": len(input_ids),
        "finish_reason": {"type": finish_reason},
    }
    if want_r3 and r3.layers > 0:
        meta["routed_experts"] = routed_experts_b64([*input_ids, *output_ids], len(input_ids) + len(output_ids) - 1,
                                                    r3, r3_start)
    return {
        "id": "chatcmpl-" + digest.hex(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": tokenizer.decode(content_ids)},
            "finish_reason": finish_reason,
            "meta_info": meta,
        }],
        "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(output_ids),
                  "total_tokens": len(input_ids) + len(output_ids)},
    }


_R3_MARK = "\u2063R3\u2063"  # placeholder, spliced with the base64 bytes after encoding


def reference_completion_json(input_ids: Sequence[int], tokenizer: ChatTokenizer, *,
                              max_tokens: int | None = None, want_r3: bool = False,
                              r3: R3Shape = R3Shape(), images: Sequence[bytes] = (), r3_start: int = 0) -> bytes:
    """``json.dumps(reference_completion(...))`` without running the encoder over the R3 string."""
    reply = reference_completion(input_ids, tokenizer, max_tokens=max_tokens, want_r3=False, r3=r3, images=images)
    if not (want_r3 and r3.layers > 0):
        return json.dumps(reply).encode()
    meta = reply["choices"][0]["meta_info"]
    meta["routed_experts"] = _R3_MARK
    head, tail = json.dumps(reply).encode().split(json.dumps(_R3_MARK).encode())
    tokens = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    ids = [*input_ids, *(tid for _lp, tid in meta["output_token_logprobs"])]
    return b"".join((head, b'"', _routed_experts_base64(ids, tokens, r3, r3_start), b'"', tail))


class _BadRequest(Exception):
    pass


def _input_ids(request: dict[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    ids = request.get("input_ids")
    if ids is None:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("need input_ids or messages")
        return tokenizer.encode(tokenizer.render(messages, add_generation_prompt=True, tools=request.get("tools")))
    if not isinstance(ids, list) or not ids or set(map(type, ids)) != {int} or min(ids) < 0:
        raise _BadRequest("input_ids must be a non-empty list of non-negative integers")
    return ids


def _images(request: dict[str, Any], ids: Sequence[int], tokenizer: ChatTokenizer) -> list[bytes]:
    """``image_data`` decoded, checked against the image pad runs of ``ids``."""
    data = request.get("image_data")
    if data is None:
        data = []
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise _BadRequest("image_data must be a list of base64 strings or data URLs")
    vision = tokenizer.vision
    runs = vision.pad_runs(ids) if vision is not None else 0
    if runs != len(data):
        raise _BadRequest(f"input_ids hold {runs} image pad runs for {len(data)} image_data entries")
    images = []
    for k, item in enumerate(data):
        encoded = item.split(",", 1)[1] if item.startswith("data:") else item
        try:
            images.append(pybase64.b64decode(encoded, validate=True))
        except ValueError:
            raise _BadRequest(f"image_data[{k}] is not base64") from None
    return images


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY on every connection: with Nagle on, a reply's last small segment waits for
    # the client's delayed ACK (~40 ms per call on a keep-alive connection).
    disable_nagle_algorithm = True
    server: _Server
    _headers_buffer: list[bytes]  # BaseHTTPRequestHandler's: send_header appends the header lines here

    def log_message(self, format: str, *args: Any) -> None:  # quiet: stdout carries the ready line
        pass

    def _send(self, status: int, obj: Any) -> None:
        self._send_bytes(status, json.dumps(obj, separators=(",", ":")).encode())

    def _send_bytes(self, status: int, body: bytes) -> None:
        """The whole reply in one write: headers and body in one buffer (``end_headers`` would
        send the headers alone, leaving the body to wait on the peer's ACK)."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self._headers_buffer.append(b"\r\n")
        self._headers_buffer.append(body)
        self.flush_headers()

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})
        elif self.path == "/get_model_info":
            self._send(200, {"model_path": MODEL_NAME, "tokenizer_path": MODEL_NAME, "is_generation": True})
        elif self.path == "/get_server_info":
            self._send(200, {"version": REFERENCE_VERSION})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_REQUEST_BYTES:
            self.close_connection = True
            self._send(413, {"error": "request too large"})
            return
        body = self.rfile.read(length)
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": f"no route {self.path}"})
            return
        try:
            request = loads_strict(body)
            if not isinstance(request, dict):
                raise _BadRequest("body must be a JSON object")
            ids = _input_ids(request, self.server.tokenizer)
            images = _images(request, ids, self.server.tokenizer)
            max_tokens = request.get("max_tokens") or request.get("max_completion_tokens")
            start = request.get("routed_experts_start_len", 0)
            if type(start) is not int or start < 0:
                raise _BadRequest("routed_experts_start_len must be a non-negative integer")
            reply = reference_completion_json(ids, self.server.tokenizer, max_tokens=max_tokens,
                                              want_r3=bool(request.get("return_routed_experts")),
                                              r3=self.server.r3, images=images, r3_start=start)
        except (ValueError, _BadRequest, SessionError) as exc:
            self._send(400, {"error": str(exc)})
            return
        self._send_bytes(200, reply)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
    # Once bound: the socket's own name (getsockname), whose host is a str.
    server_address: tuple[str, int] | tuple[str, int, int, int]

    def __init__(self, address: tuple[str, int], tokenizer: ChatTokenizer, r3: R3Shape) -> None:
        self.tokenizer = tokenizer
        self.r3 = r3
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m webapp.reference_backend", description=__doc__.split("\n")[0])
    parser.add_argument("--bind", default="127.0.0.1:0", type=parse_bind,
                        help="HOST:PORT (port 0: pick a free one)")
    parser.add_argument("--tokenizer", default=None, help="dir with tokenizer.json + chat template (default: bytes)")
    parser.add_argument("--r3-layers", type=int, default=0, help="routed_experts layers (0: no R3)")
    parser.add_argument("--r3-topk", type=int, default=8, help="routed_experts top_k")
    parser.add_argument("--r3-experts", type=int, default=128, help="number of experts (id range)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="exit when the parent process dies (no orphan after a killed server)")
    args = parser.parse_args(argv)
    if args.exit_with_parent:
        watch_parent()  # polled, not PR_SET_PDEATHSIG: a launcher may start this from any thread
    server = _Server(args.bind, load_tokenizer(args.tokenizer),
                     R3Shape(args.r3_layers, args.r3_topk, args.r3_experts))
    host, port = server.server_address[:2]
    url_host = f"[{host}]" if ":" in host else host
    print(json.dumps({"ready": True, "url": f"http://{url_host}:{port}", "pid": os.getpid()}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class ReferenceBackendProcess:
    """A running ``python -m webapp.reference_backend`` subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc = proc
        self.url = url

    def close(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_reference_backend(*, tokenizer: str | None = None, r3_layers: int = 0, r3_topk: int = 8,
                            bind: str = "127.0.0.1:0", timeout: float = READY_TIMEOUT,
                            env: dict[str, str] | None = None) -> ReferenceBackendProcess:
    """Start the reference backend as a subprocess and wait (at most ``timeout``) for its ready
    line; ``env``: its environment (None: this process's)."""
    argv = [sys.executable, "-m", "webapp.reference_backend", "--bind", bind, "--exit-with-parent",
            "--r3-layers", str(r3_layers), "--r3-topk", str(r3_topk)]
    if tokenizer is not None:
        argv += ["--tokenizer", tokenizer]
    # Its own session: a terminal's Ctrl-C reaches its launcher only, which stops it (a SIGINT'd
    # backend exits 0 and a supervisor would restart it, saying so, on every Ctrl-C).
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    assert proc.stdout is not None
    try:
        ready = parse_ready_line(read_ready_line(proc.stdout.fileno(), timeout))
    except ReadyLineTimeout:
        proc.kill()
        proc.wait()
        raise TimeoutError(f"reference backend not ready after {timeout} s") from None
    except ReadyLineError:
        proc.wait()
        raise RuntimeError(f"reference backend exited with {proc.returncode} before ready") from None
    if ready is None or "url" not in ready:
        proc.kill()
        proc.wait()
        raise RuntimeError("reference backend printed no ready line")
    return ReferenceBackendProcess(proc, str(ready["url"]))


if __name__ == "__main__":
    main()
