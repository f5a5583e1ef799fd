"""The session server speaks miles' wire contract, in both server modes (``--workers 0`` and the
router with workers), against a recording backend on loopback.

- Records validate as miles' pydantic models (a local copy of ``SessionRecord`` /
  ``GetSessionResponse``: field names and types only) and hold the body as sent to the backend.
- ``POST /sessions/{id}/samples`` decodes (with a decoder written from miles' codec rules) to
  exactly what miles' consumer rebuilds from our records (``compute_samples_from_openai_records``
  -> ``merge_samples``, re-implemented here from miles' code, not from ours).
- Forced backend fields, replay settings, rollback truncation, tools changing, the catch-all
  proxy and a backend ``content: null``.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests
import safetensors.numpy
from pydantic import BaseModel, Field

from webapp.reference_backend import R3Shape, reference_completion_json
from webapp.tokenizers import ByteChatTokenizer

from .vllm_standin import VllmStandIn

TOK = ByteChatTokenizer()
R3 = R3Shape(layers=3, top_k=2)
INDEXER_LAYERS, INDEXER_TOPK = 2, 4
NULL_CONTENT_MARKER = "please-answer-content-null"
TOOLS = [{"type": "function", "function": {"name": "computer", "parameters": {"type": "object"}}}]


# --- miles' two models (miles/rollout/session/types.py): field names and types only ----------------

class SessionRecord(BaseModel):
    timestamp: float
    request_timestamp: float | None = None
    method: str
    path: str
    request: dict
    response: dict
    status_code: int


class GetSessionResponse(BaseModel):
    session_id: str
    records: list[SessionRecord]
    metadata: dict = Field(default_factory=dict)


# --- a backend that records what it received ---------------------------------------------------

class RecordingBackend(ThreadingHTTPServer):
    """The reference backend's replies (byte tokenizer), with ``indexer_topk`` when asked, a
    ``content: null`` reply for :data:`NULL_CONTENT_MARKER`; every request is kept."""

    daemon_threads = True

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def chats(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r["json"] for r in self.received if r["path"] == "/v1/chat/completions"]


def _chat_reply(request: dict[str, Any]) -> bytes:
    ids = request["input_ids"]
    raw = reference_completion_json(ids, TOK, max_tokens=request.get("max_tokens"),
                                    want_r3=bool(request.get("return_routed_experts")), r3=R3)
    reply = json.loads(raw)
    choice = reply["choices"][0]
    if NULL_CONTENT_MARKER in json.dumps(request.get("messages")):
        choice["message"]["content"] = None
    if request.get("return_indexer_topk"):
        rows = len(ids) + len(choice["meta_info"]["output_token_logprobs"]) - 1
        values = (np.arange(rows * INDEXER_LAYERS * INDEXER_TOPK, dtype="<i4") % 97).tobytes()
        choice["meta_info"]["indexer_topk"] = base64.b64encode(values).decode()
        choice["meta_info"]["indexer_topk_num_layers"] = INDEXER_LAYERS
    return json.dumps(reply).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RecordingBackend

    def log_message(self, *args: object) -> None:
        pass

    def _any(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = urlsplit(self.path)
        seen = {"method": self.command, "path": parts.path, "query": parts.query,
                "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body.decode(errors="replace")}
        if self.command == "POST" and parts.path == "/v1/chat/completions":
            seen["json"] = json.loads(body)
            status, reply, ctype = 200, _chat_reply(seen["json"]), "application/json"
        elif parts.path == "/v1/models":
            status, reply, ctype = 200, b'{"object":"list","data":[{"id":"recorded","object":"model"}]}', \
                "application/json"
        else:  # echo, with a status of its own, so the relay of status and body shows
            status, reply, ctype = 418, json.dumps(seen).encode(), "application/x-echo"
        with self.server.lock:
            self.server.received.append(seen)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any


@pytest.fixture(scope="module")
def backend() -> Iterator[RecordingBackend]:
    server = RecordingBackend()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


REPLAY_FLAGS = ("--routing-replay-layers", str(R3.layers), "--indexer-replay")


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "router"])
def servers(request, backend, session_server_factory) -> dict[str, str]:
    """Two servers of one mode: replay settings on (the flags) and off (the defaults)."""
    workers = request.param

    def start(*flags: str) -> str:
        return session_server_factory.launch(workers, backend.url, *flags).url

    return {"on": start(*REPLAY_FLAGS), "off": start()}


# --- a miles consumer, written from miles' code -------------------------------------------------

def decode_payload(payload: bytes) -> tuple[list[dict[str, Any]], dict[str, Any], str | None]:
    """miles' ``decode_samples_and_merge_input_sample`` rules, without miles' Sample class."""
    wire = {"tokens": np.int64, "loss_mask": np.uint8, "rollout_log_probs": np.float64,
            "rollout_routed_experts": np.int32, "rollout_indexer_topk": np.int32}
    json_fields = ("response", "response_length", "status", "weight_versions", "prefix_cache_info", "metadata")
    tensors = safetensors.numpy.load(payload)
    meta_arr = tensors.pop("_samples_meta")
    assert meta_arr.ndim == 1 and meta_arr.dtype == np.uint8
    meta = json.loads(meta_arr.tobytes().decode("utf-8"))
    samples = []
    for i, sample_meta in enumerate(meta["samples"]):
        nulls = set(sample_meta["nulls"])
        assert nulls <= set(wire)
        sample: dict[str, Any] = {name: sample_meta[name] for name in json_fields}
        assert isinstance(sample["metadata"], dict)
        for name, dtype in wire.items():
            if name in nulls:
                sample[name] = None
                continue
            arr = tensors.pop(f"{name}.{i}")
            assert arr.dtype == np.dtype(dtype), (name, arr.dtype)
            sample[name] = arr if name.startswith("rollout_") and name != "rollout_log_probs" else arr.tolist()
        samples.append(sample)
    assert not tensors, f"unreferenced tensors {sorted(tensors)}"
    return samples, meta["session_metadata"], meta["empty_reason"]


def _topk_buffer(info: str, rows: int, layers: int) -> np.ndarray:
    x = np.frombuffer(base64.b64decode(info), dtype=np.int32)
    return x.reshape(rows, layers, len(x) // (rows * layers))


def consumer_samples(session: dict[str, Any], *, layers: int, max_seq_len: int | None,
                     tok: Any = TOK) -> list[dict[str, Any]]:
    """miles' compute_samples_from_openai_records -> truncate_samples_by_total_tokens -> merge_samples
    (``tok``: the model's tokenizer, for the decoded ``response`` texts)."""
    records = session["records"]
    accumulated = session["metadata"]["accumulated_token_ids"]
    max_trim = session["metadata"]["max_trim_tokens"]
    if not records:
        return []
    per_turn, cursor = [], 0
    for i, record in enumerate(records):
        prompt = record["request"]["input_ids"]
        choice = record["response"]["choices"][0]
        meta = choice["meta_info"]
        output = [t[1] for t in meta["output_token_logprobs"]]
        cursor = len(prompt)
        matched = 0
        for j, tid in enumerate(output):
            if cursor + j < len(accumulated) and accumulated[cursor + j] == tid:
                matched += 1
            else:
                break
        trim = len(output) - matched
        assert trim <= (0 if i == len(records) - 1 else max_trim)
        cursor += matched
        tokens = prompt + output
        s = {"tokens": tokens, "rollout_log_probs": [t[0] for t in meta["output_token_logprobs"]],
             "response": tok.decode(output), "response_length": len(output), "loss_mask": [1] * len(output),
             "rollout_routed_experts": None if meta.get("routed_experts") is None
             else _topk_buffer(meta["routed_experts"], len(tokens) - 1, layers),
             "rollout_indexer_topk": None if meta.get("indexer_topk") is None
             else _topk_buffer(meta["indexer_topk"], len(tokens) - 1, meta["indexer_topk_num_layers"]),
             "status": {"stop": "completed", "tool_calls": "completed", "length": "truncated",
                        "abort": "aborted"}.get(choice["finish_reason"], "pending"),
             "weight_versions": [meta["weight_version"]] if "weight_version" in meta else [],
             "prefix_cache_info": {"cached_tokens": meta.get("cached_tokens", 0),
                                   "total_prompt_tokens": meta.get("prompt_tokens", 0)}}
        latency = meta.get("e2e_latency")
        segment = {"t0": record["timestamp"] - latency if latency is not None else None,
                   "t1": record["timestamp"], "turn": i + 1, "req_ts": record["request_timestamp"]}
        if i:
            segment["prev_t1"] = records[i - 1]["timestamp"]
        s["metadata"] = {"lifecycle": segment}
        strip(s, trim, tok)
        per_turn.append(s)
    assert cursor == len(accumulated)
    if max_seq_len is not None:
        kept = []
        for s in per_turn:
            over = len(s["tokens"]) - max_seq_len
            if over <= 0:
                kept.append(s)
                continue
            if s["response_length"] - over > 0:
                strip(s, over, tok)
                s["status"] = "truncated"
                kept.append(s)
            break
        per_turn = kept
    if not per_turn:
        return []
    acc = per_turn[0]
    for b in per_turn[1:]:
        replay = ("rollout_routed_experts", "rollout_indexer_topk")
        if acc["status"] != "completed" or any(acc[k] is not None and b[k] is None for k in replay):
            break
        obs = len(b["tokens"]) - len(acc["tokens"]) - b["response_length"]
        assert obs > 0 and b["tokens"][:len(acc["tokens"])] == acc["tokens"]
        lifecycle = [acc["metadata"]["lifecycle"]] if isinstance(acc["metadata"]["lifecycle"], dict) \
            else acc["metadata"]["lifecycle"]
        acc = {**b,
               "response": acc["response"] + tok.decode(b["tokens"][len(acc["tokens"]):len(acc["tokens"]) + obs])
               + b["response"],
               "response_length": acc["response_length"] + obs + b["response_length"],
               "loss_mask": acc["loss_mask"] + [0] * obs + b["loss_mask"],
               "rollout_log_probs": acc["rollout_log_probs"] + [0.0] * obs + b["rollout_log_probs"],
               "weight_versions": acc["weight_versions"] + b["weight_versions"],
               "prefix_cache_info": {k: acc["prefix_cache_info"][k] + b["prefix_cache_info"][k]
                                     for k in acc["prefix_cache_info"]},
               "metadata": {"lifecycle": lifecycle + [b["metadata"]["lifecycle"]]}}
    return [acc]


def strip(s: dict[str, Any], n: int, tok: Any = TOK) -> None:
    """miles' ``Sample.strip_last_output_tokens``."""
    if n <= 0:
        return
    s["tokens"] = s["tokens"][:-n]
    s["response_length"] -= n
    s["rollout_log_probs"] = s["rollout_log_probs"][:-n]
    s["loss_mask"] = s["loss_mask"][:-n]
    s["response"] = tok.decode(s["tokens"][-s["response_length"]:]) if s["response_length"] > 0 else ""
    for key in ("rollout_routed_experts", "rollout_indexer_topk"):
        if s[key] is not None:
            s[key] = s[key][:-n]


def assert_same_samples(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(b[key], np.ndarray) or isinstance(a[key], np.ndarray):
                assert a[key] is not None and b[key] is not None, key
                assert a[key].shape == b[key].shape and np.array_equal(a[key], b[key]), key
            else:
                assert a[key] == b[key], key


# --- the session every test drives --------------------------------------------------------------

def chat(base: str, sid: str, messages: list[dict[str, Any]], **fields: Any) -> requests.Response:
    # miles' own rollout sends no_stop_trim: true; the server must override it.
    return requests.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=60,
                         json={"model": "m", "messages": messages, "no_stop_trim": True, **fields})


def agentic_session(base: str) -> tuple[str, list[dict[str, Any]]]:
    """Four turns: tool messages, tools [] -> [computer] -> absent, one rolled-back step.

    Returns the session id and the client replies of the turns that survive in the records.
    """
    sid = requests.post(f"{base}/sessions", timeout=30).json()["session_id"]
    msgs = [{"role": "system", "content": "You operate a 1920x1080 screen."},
            {"role": "user", "content": "Rename report.pdf"}]
    r1 = chat(base, sid, msgs, tools=[])
    assert r1.status_code == 200, r1.text
    a1 = r1.json()["choices"][0]["message"]
    msgs = msgs + [a1, {"role": "tool", "tool_call_id": "c1", "content": "clicked"}]
    r2 = chat(base, sid, msgs, tools=TOOLS)
    assert r2.status_code == 200, r2.text
    # The agent retries the tool step with another result: one assistant step rolled back.
    msgs = msgs[:-1] + [{"role": "tool", "tool_call_id": "c1", "content": "clicked twice"}]
    r2b = chat(base, sid, msgs, tools=TOOLS)
    assert r2b.status_code == 200, r2b.text
    msgs = msgs + [r2b.json()["choices"][0]["message"], {"role": "user", "content": "screenshot 2"}]
    r3 = chat(base, sid, msgs, max_tokens=5)  # tools absent again; cut by length: truncated
    assert r3.status_code == 200, r3.text
    return sid, [r1.json(), r2b.json(), r3.json()]


def test_records_validate_as_miles_models_and_hold_the_backend_request(servers, backend):
    base = servers["on"]
    sid, replies = agentic_session(base)
    got = requests.get(f"{base}/sessions/{sid}", timeout=30)
    assert got.status_code == 200
    session = GetSessionResponse.model_validate(got.json())  # miles' consumer's first step
    body = got.json()
    # Rollback as miles: the rolled-back record is gone, 3 records for 4 turns.
    assert len(session.records) == 3 and body["metadata"]["num_rollbacks"] == 1
    assert [r["rollback"] for r in body["records"]] == [False, True, False]
    received = backend.chats()
    for record, reply in zip(session.records, replies):
        assert record.method == "POST" and record.path == "/v1/chat/completions" and record.status_code == 200
        assert record.request_timestamp <= record.timestamp
        # the body exactly as the backend got it, but for the routed-expert rows it was asked to
        # skip (the session held them): the record is a full request's, as miles' consumer reads it
        assert record.request in [{k: v for k, v in r.items() if k != "routed_experts_start_len"} for r in received]
        assert record.request["no_stop_trim"] is False and record.request["logprobs"] is True
        assert record.request["return_meta_info"] is True and record.request["return_routed_experts"] is True
        assert record.request["return_indexer_topk"] is True and record.request["stream"] is False
        meta = record.response["choices"][0]["meta_info"]
        assert meta["routed_experts"] and meta["indexer_topk"]  # the backend's reply verbatim
        client_meta = reply["choices"][0]["meta_info"]
        assert "routed_experts" not in client_meta and "indexer_topk" not in client_meta
        assert client_meta["output_token_logprobs"] == meta["output_token_logprobs"]
    assert session.records[1].request["messages"][-1]["content"] == "clicked twice"
    assert session.records[0].request["tools"] == [] and session.records[1].request["tools"] == TOOLS
    assert "tools" not in session.records[2].request
    # No second copy of large payloads: each record holds one request and one response.
    assert all(set(r) == {"timestamp", "request_timestamp", "method", "path", "request", "response",
                          "status_code", "rollback"} for r in body["records"])
    metadata = body["metadata"]
    last = session.records[-1]
    output = [t[1] for t in last.response["choices"][0]["meta_info"]["output_token_logprobs"]]
    assert metadata["accumulated_token_ids"] == last.request["input_ids"] + output
    assert metadata["max_trim_tokens"] == 0 and isinstance(metadata["tito_session_mismatch"], list)
    # The last turn was cut by max_tokens: the template's rendering has an end-of-turn the ids lack.
    assert metadata["tito_session_mismatch"] and all(
        set(m) == {"type", "segment_index", "expected_text", "actual_text", "detail"}
        for m in metadata["tito_session_mismatch"])
    ids = {requests.get(f"{base}/health", timeout=10).json()["session_server_instance_id"] for _ in range(3)}
    assert len(ids) == 1 and len(ids.pop()) == 32


@pytest.mark.parametrize("max_seq_len", [None, 10_000, "mid", 3])
def test_samples_match_what_a_miles_consumer_rebuilds_from_the_records(servers, max_seq_len):
    base = servers["on"]
    sid, _ = agentic_session(base)
    session = requests.get(f"{base}/sessions/{sid}", timeout=30).json()
    if max_seq_len == "mid":  # cuts the second record's output: truncated there, the third dropped
        second = session["records"][1]
        max_seq_len = len(second["request"]["input_ids"]) + 3
    resp = requests.post(f"{base}/sessions/{sid}/samples", json={"max_seq_len": max_seq_len}, timeout=60)
    assert resp.status_code == 200 and resp.headers["Content-Type"] == "application/octet-stream"
    ours, session_metadata, empty_reason = decode_payload(resp.content)
    theirs = consumer_samples(session, layers=R3.layers, max_seq_len=max_seq_len)
    assert session_metadata["accumulated_token_ids"] == session["metadata"]["accumulated_token_ids"]
    if max_seq_len == 3:  # shorter than the first prompt: nothing survives
        assert ours == theirs == [] and empty_reason == "all_truncated"
        return
    assert empty_reason is None
    assert_same_samples(ours, theirs)
    (sample,) = ours
    tokens = sample["tokens"]
    assert sample["rollout_routed_experts"].shape == (len(tokens) - 1, R3.layers, R3.top_k)
    assert sample["rollout_indexer_topk"].shape == (len(tokens) - 1, INDEXER_LAYERS, INDEXER_TOPK)
    assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == sample["response_length"]
    assert set(sample["loss_mask"]) == {0, 1}  # 1 on sampled tokens, 0 on tool/user tokens
    if max_seq_len is None:
        assert tokens == session["metadata"]["accumulated_token_ids"]
        assert sample["status"] == "truncated"  # the last turn was cut by max_tokens
        assert len(sample["metadata"]["lifecycle"]) == 3
    else:
        assert len(tokens) <= max_seq_len


def test_samples_of_an_empty_session_and_bad_requests(servers):
    base = servers["on"]
    sid = requests.post(f"{base}/sessions", timeout=30).json()["session_id"]
    resp = requests.post(f"{base}/sessions/{sid}/samples", json={"max_seq_len": None}, timeout=30)
    assert resp.status_code == 200
    assert decode_payload(resp.content)[0::2] == ([], "no_records")
    empty_body = requests.post(f"{base}/sessions/{sid}/samples", timeout=30)
    assert empty_body.status_code == 200 and decode_payload(empty_body.content)[2] == "no_records"
    bad = requests.post(f"{base}/sessions/{sid}/samples", data=b"{nope", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"].startswith("invalid JSON body:")
    wrong = requests.post(f"{base}/sessions/{sid}/samples", json={"max_seq_len": "9"}, timeout=30)
    assert wrong.status_code == 400 and "max_seq_len" in wrong.json()["error"]
    missing = requests.post(f"{base}/sessions/{'a' * 32}/samples", json={}, timeout=30)
    assert missing.status_code == 404 and missing.json() == {"error": f"session not found: session_id={'a' * 32}"}


def test_replay_settings_are_off_by_default(servers, backend):
    base = servers["off"]
    sid = requests.post(f"{base}/sessions", timeout=30).json()["session_id"]
    before = len(backend.chats())
    assert chat(base, sid, [{"role": "user", "content": "defaults"}]).status_code == 200
    (sent,) = backend.chats()[before:]
    assert "return_routed_experts" not in sent and "return_indexer_topk" not in sent
    assert sent["no_stop_trim"] is False and sent["logprobs"] is True and sent["return_meta_info"] is True
    samples, _, _ = decode_payload(requests.post(f"{base}/sessions/{sid}/samples", json={}, timeout=30).content)
    assert samples[0]["rollout_routed_experts"] is None and samples[0]["rollout_indexer_topk"] is None


def test_the_catch_all_proxy_forwards_to_the_backend(servers, backend):
    base = servers["on"]
    sid = requests.post(f"{base}/sessions", timeout=30).json()["session_id"]
    models = requests.get(f"{base}/sessions/{sid}/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "recorded"
    for method in ("GET", "POST", "PUT", "DELETE", "PATCH"):
        resp = requests.request(method, f"{base}/sessions/{sid}/v1/some/thing?a=1&b=two", data=b"payload",
                                headers={"Content-Type": "text/plain", "Authorization": "Bearer secret"},
                                timeout=30)
        assert resp.status_code == 418 and resp.headers["Content-Type"] == "application/x-echo"
        seen = resp.json()
        assert (seen["method"], seen["path"], seen["query"]) == (method, "/v1/some/thing", "a=1&b=two")
        assert seen["body"] == "payload" and seen["headers"]["content-type"] == "text/plain"
        assert seen["headers"]["x-smg-routing-key"] == sid and "authorization" not in seen["headers"]
    unknown = requests.get(f"{base}/sessions/{'c' * 32}/v1/models", timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": f"session not found: session_id={'c' * 32}",
                                       "type": "not_found_error", "code": "session_not_found"}


def test_a_backend_content_null_is_502_and_stores_nothing(servers):
    base = servers["on"]
    sid = requests.post(f"{base}/sessions", timeout=30).json()["session_id"]
    resp = chat(base, sid, [{"role": "user", "content": NULL_CONTENT_MARKER}])
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "backend_malformed" and error["message"].startswith("assistant message content is None")
    assert requests.get(f"{base}/sessions/{sid}", timeout=30).json()["records"] == []


# --- the same records when a vLLM served the turns ----------------------------------------------

@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "router"])
def vllm_server(request, session_server_factory) -> Iterator[str]:
    """A server speaking the vllm dialect to a stand-in answering as vLLM 0.32 does, R3 on
    (``routed_experts`` as vLLM encodes it: base64 ``.npy``, uint16 here)."""
    engine = VllmStandIn()
    engine.r3 = (R3.layers, R3.top_k, np.uint16)
    yield session_server_factory.launch(request.param, engine.url, "--backend-kind", "vllm",
                                        "--routing-replay-layers", str(R3.layers)).url
    engine.close()


@pytest.mark.parametrize("max_seq_len", [None, "mid"])
def test_vllm_served_records_are_read_by_the_miles_consumer_unchanged(vllm_server, max_seq_len):
    sid, replies = agentic_session(vllm_server)
    session = requests.get(f"{vllm_server}/sessions/{sid}", timeout=30).json()
    parsed = GetSessionResponse.model_validate(session)
    assert [r.request["engine"]["path"] for r in parsed.records] == ["/v1/completions"] * 3
    assert all("routed_experts" not in json.dumps(reply) for reply in replies)  # never to the client
    if max_seq_len == "mid":
        max_seq_len = len(session["records"][1]["request"]["input_ids"]) + 3
    resp = requests.post(f"{vllm_server}/sessions/{sid}/samples", json={"max_seq_len": max_seq_len}, timeout=60)
    ours, _metadata, empty_reason = decode_payload(resp.content)
    theirs = consumer_samples(session, layers=R3.layers, max_seq_len=max_seq_len)
    assert empty_reason is None
    assert_same_samples(ours, theirs)
    (sample,) = ours
    assert sample["rollout_routed_experts"].shape == (len(sample["tokens"]) - 1, R3.layers, R3.top_k)
    assert sample["rollout_indexer_topk"] is None
