"""The reference backend: deterministic replies in the ACTION FORMAT, R3 shape, and its HTTP server."""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from webapp.reference_backend import (
    ACTION_VERBS,
    SCREEN_HEIGHT,
    SCREEN_WIDTH,
    R3Shape,
    reference_completion,
    reference_completion_json,
)
from webapp.tokenizers import ByteChatTokenizer, load_tokenizer

TOK = ByteChatTokenizer()


def check_action(content: str) -> dict:
    action = json.loads(content)["action"]
    assert action["verb"] in ACTION_VERBS
    if action["verb"] in ("click", "scroll"):
        assert 0 <= action["x"] < SCREEN_WIDTH and 0 <= action["y"] < SCREEN_HEIGHT
    if action["verb"] == "type":
        assert isinstance(action["text"], str) and action["text"]
    if action["verb"] == "key":
        assert isinstance(action["combo"], str) and action["combo"]
    return action


def test_replies_are_deterministic_actions_over_the_tokenizer():
    verbs = set()
    for n in range(64):
        ids = TOK.encode(f"<|im_start|>user\nprompt {n}<|im_end|>\n<|im_start|>assistant\n")
        reply = reference_completion(ids, TOK)
        again = reference_completion(ids, TOK)
        reply.pop("created"), again.pop("created")
        assert reply == again
        choice = reply["choices"][0]
        pairs = choice["meta_info"]["output_token_logprobs"]
        out_ids = [t for _, t in pairs]
        assert out_ids[-1] == TOK.eos_token_id and choice["finish_reason"] == "stop"
        assert TOK.decode(out_ids[:-1]) == choice["message"]["content"]
        assert all(lp <= 0 for lp, _ in pairs)
        assert choice["meta_info"]["completion_tokens"] == len(pairs) == reply["usage"]["completion_tokens"]
        verbs.add(check_action(choice["message"]["content"])["verb"])
    assert verbs == set(ACTION_VERBS)


def test_max_tokens_truncates_without_end_of_turn():
    reply = reference_completion([1, 2, 3], TOK, max_tokens=5)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length"
    assert [t for _, t in choice["meta_info"]["output_token_logprobs"]] == TOK.encode(choice["message"]["content"])
    assert len(choice["meta_info"]["output_token_logprobs"]) == 5


@pytest.mark.parametrize("layers, top_k, n_prompt", [(2, 4, 10), (48, 8, 1000), (1, 1, 1)])
def test_routed_experts_shape_and_range(layers, top_k, n_prompt):
    shape = R3Shape(layers=layers, top_k=top_k, num_experts=64)
    reply = reference_completion(list(range(n_prompt)), TOK, want_r3=True, r3=shape)
    meta = reply["choices"][0]["meta_info"]
    raw = base64.b64decode(meta["routed_experts"], validate=True)
    tokens = n_prompt + meta["completion_tokens"]
    assert len(raw) == (tokens - 1) * layers * top_k * 4
    values = struct.unpack(f"<{len(raw) // 4}i", raw)
    assert all(0 <= v < 64 for v in values)
    assert "routed_experts" not in reference_completion([1], TOK, want_r3=False, r3=shape)["choices"][0]["meta_info"]


@pytest.mark.parametrize("want_r3", [False, True])
def test_json_bytes_path_equals_the_dict(want_r3):
    shape = R3Shape(layers=5, top_k=3)
    as_dict = reference_completion(list(range(40)), TOK, want_r3=want_r3, r3=shape)
    as_bytes = json.loads(reference_completion_json(list(range(40)), TOK, want_r3=want_r3, r3=shape))
    as_dict.pop("created"), as_bytes.pop("created")
    assert as_bytes == as_dict


@pytest.mark.integration
def test_http_server_contract_and_concurrency(reference_backend_factory):
    backend = reference_backend_factory(r3_layers=2, r3_topk=2)
    assert backend.url.startswith("http://127.0.0.1:") and not backend.url.endswith(":0")
    assert requests.get(backend.url + "/health", timeout=5).json() == {"status": "ok"}
    messages = [{"role": "user", "content": "open the browser"}]
    ids = TOK.encode(TOK.render(messages, add_generation_prompt=True))

    def post(i: int) -> dict:
        body = {"messages": messages, "input_ids": ids, "return_routed_experts": True}
        resp = requests.post(backend.url + "/v1/chat/completions", json=body, timeout=10)
        assert resp.status_code == 200
        return resp.json()

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(post, range(16)))
    for reply in replies:
        reply.pop("created")
        assert reply == replies[0]
    assert "routed_experts" in replies[0]["choices"][0]["meta_info"]
    # without input_ids it renders messages with the same template: the same reply
    resp = requests.post(backend.url + "/v1/chat/completions", json={"messages": messages}, timeout=10).json()
    assert resp["choices"][0]["message"] == replies[0]["choices"][0]["message"]
    bad = requests.post(backend.url + "/v1/chat/completions", json={"input_ids": ["x"]}, timeout=10)
    assert bad.status_code == 400 and "input_ids" in bad.json()["error"]


@pytest.mark.integration
def test_http_server_decodes_through_a_given_tokenizer(reference_backend_factory, hf_tokenizer_dir):
    backend = reference_backend_factory(tokenizer=hf_tokenizer_dir)
    tok = load_tokenizer(hf_tokenizer_dir)
    ids = tok.encode(tok.render([{"role": "user", "content": "click the button"}], add_generation_prompt=True))
    reply = requests.post(backend.url + "/v1/chat/completions", json={"input_ids": ids}, timeout=10).json()
    choice = reply["choices"][0]
    out_ids = [t for _, t in choice["meta_info"]["output_token_logprobs"]]
    assert out_ids[-1] == tok.eos_token_id
    assert tok.decode(out_ids[:-1]) == choice["message"]["content"]
    check_action(choice["message"]["content"])


class _CountingWriter:
    """Stands in for a handler's ``wfile``: counts the writes one reply takes."""

    def __init__(self, inner, writes: list[int]) -> None:
        self._inner, self._writes = inner, writes

    def write(self, data: bytes) -> int:
        self._writes.append(len(data))
        return self._inner.write(data)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


@pytest.mark.parametrize("r3_layers", [0, 4])
def test_each_reply_is_one_write_on_a_no_delay_socket(r3_layers):
    """Headers and body in two writes on a Nagle socket: a keep-alive client's delayed ACK held
    the body back ~40 ms on every call (the demo's chat p50 was mostly that)."""
    from webapp import reference_backend as rb

    writes: list[int] = []
    nodelay: list[int] = []

    class Recording(rb._Handler):
        def setup(self) -> None:
            super().setup()
            nodelay.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            self.wfile = _CountingWriter(self.wfile, writes)

    server = rb._Server(("127.0.0.1", 0), TOK, R3Shape(r3_layers, 8))
    server.RequestHandlerClass = Recording
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with requests.Session() as http:  # one keep-alive connection
            for n in range(3):
                writes.clear()
                reply = http.post(url + "/v1/chat/completions", timeout=30,
                                  json={"input_ids": TOK.encode(f"turn {n}"), "return_routed_experts": True})
                assert reply.status_code == 200
                assert len(writes) == 1, writes
                assert writes[0] > len(reply.content)  # the headers went with the body
            assert http.get(url + "/health", timeout=30).json() == {"status": "ok"} and len(writes) == 2
    finally:
        server.shutdown()
        server.server_close()
    assert nodelay and all(nodelay), nodelay
