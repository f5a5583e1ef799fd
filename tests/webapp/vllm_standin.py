"""A tiny HTTP server on loopback that answers like vLLM 0.32's OpenAI server, for the session
server's vLLM dialect and start-up checks where a real engine cannot run (the real one runs in
the engine tier).

Shapes follow the replies captured from a real vLLM 0.32.0 (``tests/webapp/vllm_replies/``) and
vLLM's own models (``vllm/entrypoints/openai/completion/protocol.py``: ``CompletionResponseChoice``;
``routed_experts`` = base64 of ``np.save`` bytes, shape ``(tokens - 1, layers, top_k)``). The
output is the reference backend's deterministic action for the prompt (byte tokenizer), so a
test can predict it; ``routed_experts`` is an ``np.save`` of ``rows x layers x top_k`` ids in a
dtype of the test's choice.

Knobs (attributes, changed by a test between calls): ``tokenize_shift`` (added to every id
``/tokenize`` answers: a tokenizer that is not ours), ``drop_fields`` (choice fields left out of
every completion), ``r3`` (``(layers, top_k, dtype)`` or None), ``silent`` (accept, never answer),
``reply_text`` (answer this text, then EOS, instead of the reference action).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from webapp.reference_backend import reference_completion
from webapp.tokenizers import ByteChatTokenizer

TOK = ByteChatTokenizer()
VERSION = "0.32.0"
MODEL = "/tmp/standin/qwen2"


def routed_experts_npy(rows: int, layers: int, top_k: int, dtype: Any = np.uint8) -> tuple[str, np.ndarray]:
    """(vLLM's base64 ``.npy`` string, the array) for ``rows`` tokens: deterministic ids."""
    array = (np.arange(rows * layers * top_k, dtype=np.int64) % 61).astype(dtype).reshape(rows, layers, top_k)
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii"), array


def vllm_completion(prompt: list[int], body: dict[str, Any], r3: tuple[int, int, Any] | None = None,
                    text: str | None = None) -> dict[str, Any]:
    """A vLLM ``/v1/completions`` reply (with ``return_token_ids``) for a token-id prompt: the
    reference backend's action, or ``text`` then EOS (what a model that answers no action says)."""
    if text is None:
        ref = reference_completion(prompt, TOK, max_tokens=body.get("max_tokens"))
        choice = ref["choices"][0]
        pairs = choice["meta_info"]["output_token_logprobs"]
    else:
        pairs = [[-1.0, t] for t in [*TOK.encode(text), TOK.eos_token_id]]
        choice = {"finish_reason": "stop"}
    ids = [t for _lp, t in pairs]
    top = body.get("logprobs") or 0
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    def key(t: int) -> str:
        return f"token_id:{t}" if as_ids else TOK.decode([t])

    routed = None
    if r3 is not None:
        routed, _ = routed_experts_npy(len(prompt) + len(ids) - 1, *r3)
    # vLLM leaves the stop token's text out of ``text`` and keeps its id in ``token_ids``.
    text_ids = ids[:-1] if choice["finish_reason"] == "stop" else ids
    return {
        "id": "cmpl-standin", "object": "text_completion", "created": 1796193580, "model": MODEL,
        "choices": [{
            "index": 0, "text": TOK.decode(text_ids),
            "logprobs": {"text_offset": list(range(len(ids))), "token_logprobs": [lp for lp, _t in pairs],
                         "tokens": [key(t) for t in ids],
                         "top_logprobs": [{key(t): lp, **({key((t + 1) % 256): lp - 1.0} if top else {})}
                                          for lp, t in pairs]},
            "finish_reason": choice["finish_reason"],
            "stop_reason": TOK.eos_token_id if choice["finish_reason"] == "stop" else None,
            "token_ids": ids, "prompt_logprobs": None, "prompt_token_ids": list(prompt), "routed_experts": routed,
        }],
        "service_tier": None, "system_fingerprint": f"vllm-{VERSION}-standin",
        "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids), "completion_tokens": len(ids),
                  "prompt_tokens_details": None, "completion_tokens_details": None},
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


class VllmStandIn(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int = 0) -> None:
        self.tokenize_shift = 0
        self.drop_fields: tuple[str, ...] = ()
        self.r3: tuple[int, int, Any] | None = None
        self.silent = False
        self.reply_text: str | None = None
        self.requests: list[dict[str, Any]] = []
        self._release = threading.Event()
        self._open: set[Any] = set()
        super().__init__(("127.0.0.1", port), _Handler)
        self.port = self.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self._open.discard(request)
        super().shutdown_request(request)

    def close(self) -> None:
        """Stop as a killed engine does: the kept-alive connections die too."""
        self._release.set()
        self.shutdown()
        self.server_close()
        for sock in list(self._open):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: VllmStandIn

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _hold(self) -> bool:
        if self.server.silent:
            self.server._release.wait(60)
            return True
        return False

    def do_GET(self) -> None:
        if self._hold():
            return
        if self.path == "/version":
            self._send(200, {"version": VERSION})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm",
                                                         "root": MODEL, "max_model_len": 2048}]})
        elif self.path == "/health":
            self._send(200, None)
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self._hold():
            return
        if self.path == "/tokenize":
            ids = [t + self.server.tokenize_shift for t in TOK.encode(body["prompt"])]
            self._send(200, {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None})
        elif self.path == "/detokenize":
            if any(t >= TOK.vocab_size for t in body["tokens"]):
                self._send(400, {"error": {"message": "Token id out of vocabulary", "type": "BadRequestError",
                                           "param": None, "code": 400}})
            else:
                self._send(200, {"prompt": TOK.decode(body["tokens"])})
        elif self.path == "/v1/completions":
            self.server.requests.append(body)
            reply = vllm_completion(body["prompt"], body, self.server.r3, self.server.reply_text)
            for name in self.server.drop_fields:
                reply["choices"][0].pop(name, None)
            self._send(200, reply)
        else:
            self._send(404, {"detail": "Not Found"})
