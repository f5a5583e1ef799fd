"""SessionCore: lifecycle, exact records, R3 handling, races and error mapping."""

from __future__ import annotations

import base64
import dataclasses
import json
import socket
import threading

import pytest
import safetensors.numpy

from webapp.backend import BackendReply, parse_backend_reply, payload_bytes
from webapp.core import CoreConfig, SessionCore, build_session_core
from webapp.filebody import B64Span, FileSpan
from webapp.reference_backend import R3Shape, reference_completion
from webapp.session_errors import BackendMalformed
from webapp.tokenizers import ByteChatTokenizer
from webapp.worker import SessionOps

TOK = ByteChatTokenizer()
R3 = R3Shape(layers=3, top_k=2)
WAIT = 10.0


class FakeBackend:
    """The reference backend's replies, in-process; optionally gated to hold a turn in flight."""

    def __init__(self, gated: bool = False) -> None:
        self.calls: list[dict] = []
        self.raws: list[bytes] = []
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.gated = gated
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        payload = payload_bytes(payload)  # an image turn sends pieces
        request = json.loads(payload)
        with self._lock:
            self.calls.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gated:
                self.entered.release()
                assert self.release.wait(WAIT)
            reply = reference_completion(request["input_ids"], TOK, want_r3=request.get("return_routed_experts"),
                                         r3=R3, max_tokens=request.get("max_tokens"))
            raw = json.dumps(reply).encode()
            self.raws.append(raw)
            return BackendReply.from_raw(raw)
        finally:
            with self._lock:
                self.in_flight -= 1

    def close(self) -> None:
        pass


def make_core(backend=None) -> SessionCore:
    return SessionCore(TOK, backend or FakeBackend(), turn_wait_timeout=WAIT, routing_replay_layers=R3.layers)


def body_of(reply) -> dict:
    return json.loads(reply.read())


def error_of(reply) -> str:
    """The message of either error shape: miles' ``{"error": text}`` or OpenAI's object."""
    error = body_of(reply)["error"]
    return error["message"] if isinstance(error, dict) else error


def new_session(core: SessionCore) -> str:
    return body_of(core.create_session())["session_id"]


def chat(core, sid, messages, **fields):
    return core.chat(sid, json.dumps({"model": "m", "messages": messages, **fields}).encode())


def test_lifecycle():
    core = make_core()
    created = core.create_session()
    assert created.status == 200
    sid = body_of(created)["session_id"]
    assert len(sid) == 32 and int(sid, 16) >= 0
    got = core.get_session(sid)
    assert got.status == 200
    assert body_of(got) == {"session_id": sid, "records": [], "metadata": {
        "accumulated_token_ids": [], "max_trim_tokens": 0, "num_records": 0, "num_rollbacks": 0,
        "num_messages": 0, "created_at": body_of(got)["metadata"]["created_at"]}}
    assert core.delete_session(sid).status == 204
    for reply in (core.get_session(sid), core.delete_session(sid),
                  chat(core, sid, [{"role": "user", "content": "x"}])):
        assert reply.status == 410  # deleted, not unknown (its tombstone)
        assert error_of(reply).startswith(f"session reclaimed: session_id={sid} ")  # miles' wording
    assert core.get_session("f" * 32).status == 404  # an id never seen
    health = body_of(core.health())
    assert core.health().status == 200 and health["status"] == "ok"
    assert health["session_server_instance_id"] == body_of(core.health())["session_server_instance_id"]


def test_given_ids_duplicates_and_bad_ids():
    core = make_core()
    assert body_of(core.create_session("abc123"))["session_id"] == "abc123"
    dup = core.create_session("abc123")
    assert dup.status == 409 and "already exists" in body_of(dup)["error"]
    assert core.create_session("../etc").status == 400
    assert core.create_session("x" * 129).status == 400


def test_ten_turns_with_tool_messages_exact_records_and_r3():
    backend = FakeBackend()
    core = make_core(backend)
    sid = new_session(core)
    msgs = [{"role": "system", "content": "You operate a 1920x1080 screen."},
            {"role": "user", "content": "Rename report.pdf ✓"}]
    bodies, replies = [], []
    for i in range(10):
        body = {"model": "m", "messages": msgs, "temperature": 0.0}
        bodies.append(body)
        reply = core.chat(sid, json.dumps(body).encode())
        assert reply.status == 200, reply.body
        parsed = body_of(reply)
        replies.append(parsed)
        meta = parsed["choices"][0]["meta_info"]
        assert "routed_experts" not in meta and meta["output_token_logprobs"]  # R3 stripped, rest kept
        assistant = parsed["choices"][0]["message"]
        action = json.loads(assistant["content"])["action"]
        conversation = msgs + [assistant]
        msgs = msgs + [assistant, {"role": "tool", "tool_call_id": f"call_{i}",
                                   "content": f"did {action['verb']}"}]
        if i % 2:
            msgs.append({"role": "user", "content": f"screenshot {i}"})
    session = body_of(core.get_session(sid))
    records = session["records"]
    assert len(records) == 10
    accumulated = session["metadata"]["accumulated_token_ids"]
    assert TOK.decode(accumulated) + "\n" == TOK.render(conversation, add_generation_prompt=False)
    def output_ids(record):
        return [t for _, t in record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]

    last = records[-1]
    assert accumulated == last["request"]["input_ids"] + output_ids(last)
    for i, (record, call, raw, body) in enumerate(zip(records, backend.calls, backend.raws, bodies)):
        assert record["rollback"] is False and record["method"] == "POST"
        assert record["path"] == "/v1/chat/completions" and record["status_code"] == 200
        assert record["request_timestamp"] <= record["timestamp"]
        # the body as sent to the backend, but for the rows it asked to skip (a full request's record)
        assert record["request"] == {k: v for k, v in call.items() if k != "routed_experts_start_len"}
        assert record["request"] == {k: v for k, v in body.items()} | {
            "stream": False, "logprobs": True, "return_meta_info": True, "no_stop_trim": False,
            "return_routed_experts": True, "input_ids": call["input_ids"]}
        assert record["response"] == json.loads(raw)
        r3 = record["response"]["choices"][0]["meta_info"]["routed_experts"]
        tokens = len(record["request"]["input_ids"]) + len(output_ids(record))
        assert len(base64.b64decode(r3, validate=True)) == (tokens - 1) * R3.layers * R3.top_k * 4
        if i:  # earlier turns are never re-tokenized
            prev = records[i - 1]
            prev_ids = prev["request"]["input_ids"] + output_ids(prev)
            assert record["request"]["input_ids"][: len(prev_ids)] == prev_ids


def test_records_get_names_journal_spans_holding_the_backend_bytes_verbatim():
    backend = FakeBackend()
    core = make_core(backend)
    sid = new_session(core)
    chat(core, sid, [{"role": "user", "content": "a"}])
    reply = core.get_session(sid)
    assert isinstance(reply.body, list)
    spans = [piece for piece in reply.body if isinstance(piece, (FileSpan, B64Span))]
    # The reply's bytes come from the journal (its text as spans, its R3 as a packed span sent
    # as base64), never from memory: only the GET's glue and the prompt-id text are inline.
    assert any(isinstance(p, B64Span) for p in spans)
    assert backend.raws[0] in b"".join(p.read() for p in spans)
    assert not any(len(piece) > 200 and piece in backend.raws[0] for piece in reply.body if isinstance(piece, bytes))
    assert reply.content_length == len(reply.read())


def test_rollback_in_core_and_too_deep_is_400():
    core = make_core()
    sid = new_session(core)
    first = [{"role": "user", "content": "a"}]
    r1 = body_of(chat(core, sid, first))["choices"][0]["message"]
    second = first + [r1, {"role": "user", "content": "b"}]
    assert chat(core, sid, second).status == 200
    assert chat(core, sid, second).status == 200  # regenerate: one step back
    deep = chat(core, sid, [{"role": "user", "content": "other"}])
    assert deep.status == 400 and "rolled back" in error_of(deep)
    session = body_of(core.get_session(sid))
    # As miles: the rolled-back record is gone, the records match the checkpoints.
    assert [r["rollback"] for r in session["records"]] == [False, True]
    assert session["metadata"]["num_rollbacks"] == 1


def test_delete_racing_a_chat_answers_but_commits_nothing():
    backend = FakeBackend(gated=True)
    core = make_core(backend)
    sid = new_session(core)
    session = core.registry.get(sid)
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=chat(core, sid, [{"role": "user", "content": "a"}])))
    worker.start()
    assert backend.entered.acquire(timeout=WAIT)
    assert core.delete_session(sid).status == 204
    assert core.get_session(sid).status == 410
    assert chat(core, sid, [{"role": "user", "content": "b"}]).status == 410  # closing: no new turn
    assert core.delete_session(sid).status == 410  # already closing
    backend.release.set()
    worker.join(WAIT)
    assert result["r"].status == 200 and body_of(result["r"])["choices"][0]["message"]["content"]
    assert session.records == [] and session.state.token_ids == ()


def test_turns_of_one_session_are_serialized_but_other_sessions_proceed():
    backend = FakeBackend(gated=True)
    core = make_core(backend)
    a, b = new_session(core), new_session(core)
    results = []
    threads = [threading.Thread(target=lambda: results.append(chat(core, a, [{"role": "user", "content": "a"}])))
               for _ in range(2)]
    for t in threads:
        t.start()
    assert backend.entered.acquire(timeout=WAIT)
    assert not backend.entered.acquire(timeout=0.2)  # the second turn of `a` waits for the first
    other = threading.Thread(target=lambda: results.append(chat(core, b, [{"role": "user", "content": "b"}])))
    other.start()
    assert backend.entered.acquire(timeout=WAIT)  # session b is not held up by a's turn in flight
    assert backend.in_flight == 2
    backend.release.set()
    for t in (*threads, other):
        t.join(WAIT)
    assert [r.status for r in results] == [200, 200, 200]
    assert backend.max_in_flight == 2
    assert [r["rollback"] for r in body_of(core.get_session(a))["records"]] == [True]  # the retry replaced it


def test_a_turn_waiting_too_long_for_the_previous_one_is_503():
    backend = FakeBackend(gated=True)
    core = SessionCore(TOK, backend, turn_wait_timeout=0.1)
    sid = new_session(core)
    first = threading.Thread(target=chat, args=(core, sid, [{"role": "user", "content": "a"}]))
    first.start()
    assert backend.entered.acquire(timeout=WAIT)
    busy = chat(core, sid, [{"role": "user", "content": "a"}])
    assert busy.status == 503 and "previous turn" in error_of(busy)
    backend.release.set()
    first.join(WAIT)
    assert len(body_of(core.get_session(sid))["records"]) == 1


def test_a_budget_caps_the_wait_for_the_previous_turn():
    backend = FakeBackend(gated=True)
    core = SessionCore(TOK, backend, turn_wait_timeout=600.0)
    sid = new_session(core)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}]}).encode()
    first = threading.Thread(target=core.chat, args=(sid, body))
    first.start()
    assert backend.entered.acquire(timeout=WAIT)
    busy = core.chat(sid, body, budget=0.1)  # without the budget: 600 s
    assert busy.status == 503 and "previous turn" in error_of(busy)
    backend.release.set()
    first.join(WAIT)
    assert len(body_of(core.get_session(sid))["records"]) == 1


def test_the_worker_passes_a_chat_budget_and_refuses_a_bad_one():
    core = make_core()
    ops = SessionOps(core, 0, 1)
    sid = new_session(core)
    body = memoryview(json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}]}).encode())
    for bad in ("soon", True, 0, -1.0):
        assert ops({"op": "chat", "session_id": sid, "budget": bad}, body).status == 400
    assert ops({"op": "chat", "session_id": sid, "budget": 30}, body).status == 200
    assert len(body_of(core.get_session(sid))["records"]) == 1


@pytest.mark.parametrize("body", [
    b"{not json", b"\xff\xfe", b"[1, 2]", b'"str"',
    json.dumps({"messages": "hi"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "model": 5}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}).encode(),
    json.dumps({"messages": [{"role": "user", "content": ["x"]}]}).encode(),
])
def test_bad_json_and_wrong_types_are_400_and_store_nothing(body):
    backend = FakeBackend()
    core = make_core(backend)
    sid = new_session(core)
    reply = core.chat(sid, body)
    assert reply.status == 400
    assert isinstance(error_of(reply), str) and body_of(reply)["error"]["type"] == "invalid_request_error"
    assert backend.calls == [] and body_of(core.get_session(sid))["records"] == []


def test_stream_answers_sse():
    core = make_core()
    sid = new_session(core)
    reply = chat(core, sid, [{"role": "user", "content": "a"}], stream=True, stream_options={"include_usage": True})
    assert reply.status == 200 and reply.content_type == "text/event-stream"
    events = reply.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert json.loads(content)["action"]["verb"] in ("click", "type", "key", "scroll")
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    record = body_of(core.get_session(sid))["records"][0]
    assert record["request"]["stream"] is False and "routed_experts" in record["response"]["choices"][0]["meta_info"]


@pytest.mark.parametrize("raw, expected", [
    (b'{"a": {"routed_experts": "QUJD+/=="}, "b": 1}', {"a": {"routed_experts": ""}, "b": 1}),
    (b'{"routed_experts"\n :\t"QUJD","x":[{"routed_experts":"AA=="}]}', {"routed_experts": "", "x": [{"routed_experts": ""}]}),
    (b'{"routed_experts": null}', {"routed_experts": None}),
    (b'{"routed_experts": [1, 2]}', {"routed_experts": [1, 2]}),
    # inside a string every quote is escaped: the key pattern cannot match there
    (json.dumps({"content": '"routed_experts": "not R3"', "routed_experts": "QQ=="}).encode(),
     {"content": '"routed_experts": "not R3"', "routed_experts": ""}),
    (json.dumps({"c": "routed_experts", "d": ["routed_experts"]}).encode(), {"c": "routed_experts", "d": ["routed_experts"]}),
])
def test_parse_backend_reply_skips_r3_strings_only(raw, expected):
    assert parse_backend_reply(raw) == expected


@pytest.mark.parametrize("at", [0, (256 << 10) - 1, 256 << 10, (600 << 10) - 1])
def test_parse_backend_reply_checks_every_r3_byte(at):
    r3 = bytearray(b"A" * (600 << 10))
    r3[at] = ord("\\")
    with pytest.raises(BackendMalformed, match="base64"):
        parse_backend_reply(b'{"routed_experts": "' + bytes(r3) + b'"}')


# --- through the real backend client --------------------------------------------------------------

def core_for(url: str, read_timeout: float = 5.0) -> SessionCore:
    return build_session_core(CoreConfig(backend_url=url, connect_timeout=1.0, read_timeout=read_timeout))


def free_closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_502(core: SessionCore, fragment: str) -> None:
    sid = new_session(core)
    reply = chat(core, sid, [{"role": "user", "content": "a"}])
    assert reply.status == 502, reply.body
    assert fragment in error_of(reply)
    assert body_of(core.get_session(sid))["records"] == []
    core.close()


def test_backend_down_is_502():
    assert_502(core_for(f"http://127.0.0.1:{free_closed_port()}"), "unreachable")


def test_backend_timeout_is_502(stub_backend_factory):
    assert_502(core_for(stub_backend_factory(lambda request: None), read_timeout=0.3), "timed out")


def test_a_budget_caps_the_backend_read(stub_backend_factory):
    core = core_for(stub_backend_factory(lambda request: None), read_timeout=600.0)
    sid = new_session(core)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}]}).encode()
    reply = core.chat(sid, body, budget=0.3)  # without the budget: 600 s
    assert reply.status == 502 and "timed out" in error_of(reply)
    assert body_of(core.get_session(sid))["records"] == []
    core.close()


def _valid(request: dict) -> dict:
    return reference_completion(request["input_ids"], TOK)


@pytest.mark.parametrize("make_body, fragment", [
    (lambda r: b"<html>oops", "not UTF-8 JSON"),
    (lambda r: b"[]", "not a JSON object"),
    (lambda r: json.dumps({**_valid(r), "choices": []}).encode(), "exactly one choice"),
    (lambda r: json.dumps({"choices": [{"message": {"role": "assistant", "content": "x"}}]}).encode(), "meta_info"),
    (lambda r: json.dumps({"choices": [{"message": {"role": "assistant", "content": "x"},
                                        "meta_info": {"output_token_logprobs": [[0.0]]}}]}).encode(), "[logprob"),
    (lambda r: json.dumps({"choices": [{"message": {"role": "assistant", "content": "x"},
                                        "meta_info": {"output_token_logprobs": [[0.0, "7"]]}}]}).encode(), "integers"),
    (lambda r: json.dumps({"choices": [{"message": {"role": "assistant", "content": "x"}, "meta_info": {
        "output_token_logprobs": [[0.0, 7]], "completion_tokens": 3}}]}).encode(), "completion_tokens"),
    (lambda r: json.dumps({"choices": [{"message": {"role": "user", "content": "x"}, "meta_info": {
        "output_token_logprobs": [[0.0, 7]]}}]}).encode(), "role"),
    (lambda r: json.dumps({"choices": [{"message": {"role": "assistant", "content": "x"}, "meta_info": {
        "output_token_logprobs": [[0.0, 7]], "routed_experts": "AAAA\n"}}]}).encode(), "base64"),
    (lambda r: b'{"choices": [], "routed_experts": "AAAA', "unterminated"),
])
def test_malformed_backend_reply_is_502(stub_backend_factory, make_body, fragment):
    assert_502(core_for(stub_backend_factory(lambda request: (200, make_body(request)))), fragment)


def test_upstream_non_200_is_passed_through_and_not_recorded(stub_backend_factory):
    upstream = json.dumps({"object": "error", "message": "overloaded", "code": 429}).encode()
    core = core_for(stub_backend_factory(lambda request: (429, upstream)))
    sid = new_session(core)
    reply = chat(core, sid, [{"role": "user", "content": "a"}])
    assert (reply.status, reply.body, reply.content_type) == (429, upstream, "application/json")
    session = body_of(core.get_session(sid))
    assert session["records"] == [] and session["metadata"]["accumulated_token_ids"] == []
    core.close()


# --- miles' contract in the core: metadata, samples errors, the worker's new ops -------------------

def test_a_clean_session_reports_no_tito_mismatch():
    core = make_core()
    sid = new_session(core)
    first = [{"role": "user", "content": "a"}]
    r1 = body_of(chat(core, sid, first))["choices"][0]["message"]
    chat(core, sid, first + [r1, {"role": "tool", "tool_call_id": "t", "content": "done"}])
    metadata = body_of(core.get_session(sid))["metadata"]
    assert metadata["tito_session_mismatch"] == [] and metadata["max_trim_tokens"] == 0


def test_a_tampered_accumulation_is_reported_as_a_mismatch():
    core = make_core()
    sid = new_session(core)
    chat(core, sid, [{"role": "user", "content": "a"}])
    session = core.registry.get(sid)
    ids = list(session.state.token_ids)
    ids[3] = ord("Z")  # inside the user text: a TITO bug would look like this
    session.state = dataclasses.replace(session.state, token_ids=tuple(ids))
    (mismatch,) = body_of(core.get_session(sid))["metadata"]["tito_session_mismatch"]
    assert mismatch["type"] == "non_assistant_text" and mismatch["segment_index"] == 1
    assert (mismatch["expected_text"], mismatch["actual_text"]) == ("user\na", "usZr\na")


class AlwaysR3Backend(FakeBackend):
    """Returns R3 whether or not it was asked for (a backend with routing replay always on)."""

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        payload = payload_bytes(payload)  # an image turn sends pieces
        request = json.loads(payload)
        return BackendReply.from_raw(json.dumps(reference_completion(request["input_ids"], TOK, want_r3=True,
                                                                     r3=R3)).encode())


def test_samples_refuse_r3_they_cannot_shape_with_422():
    core = SessionCore(TOK, AlwaysR3Backend(), turn_wait_timeout=WAIT)  # routing replay off: no layer count
    sid = new_session(core)
    chat(core, sid, [{"role": "user", "content": "a"}])
    reply = core.samples(sid, b"{}")
    assert reply.status == 422 and "--routing-replay-layers" in body_of(reply)["error"]
    wrong = SessionCore(TOK, AlwaysR3Backend(), turn_wait_timeout=WAIT, routing_replay_layers=5)  # 3 is right
    sid = new_session(wrong)
    chat(wrong, sid, [{"role": "user", "content": "a"}])
    reply = wrong.samples(sid, b"{}")
    assert reply.status == 422 and "not a multiple" in body_of(reply)["error"]
    assert wrong.get_session(sid).status == 200  # the session is untouched


def test_the_worker_serves_samples_and_proxy_ops():
    core = make_core()
    ops = SessionOps(core, 0, 1)
    sid = new_session(core)
    chat(core, sid, [{"role": "user", "content": "a"}])
    reply = ops({"op": "samples", "session_id": sid}, memoryview(b'{"max_seq_len": null}'))
    assert reply.status == 200 and reply.content_type == "application/octet-stream"
    bad = ops({"op": "proxy", "session_id": sid, "method": "GET", "path": 5}, memoryview(b""))
    assert bad.status == 400 and "proxy" in body_of(bad)["error"]


class CutCharacterBackend(FakeBackend):
    """Output cut by max_tokens in the middle of a multi-byte character (byte tokenizer)."""

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        payload = payload_bytes(payload)  # an image turn sends pieces
        output = TOK.encode("ok ☃")[:-1]
        reply = {"choices": [{"index": 0, "finish_reason": "length",
                              "message": {"role": "assistant", "content": "ok \ufffd"},
                              "meta_info": {"output_token_logprobs": [[-0.5, t] for t in output],
                                            "completion_tokens": len(output)}}]}
        return BackendReply.from_raw(json.dumps(reply).encode())


def test_samples_and_logprobs_survive_an_output_cut_mid_character():
    core = SessionCore(TOK, CutCharacterBackend(), turn_wait_timeout=WAIT)
    sid = new_session(core)
    reply = chat(core, sid, [{"role": "user", "content": "a"}], logprobs=True)
    content = body_of(reply)["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content[:3]] == ["o", "k", " "] and content[-1]["bytes"] is None
    samples = core.samples(sid, b"{}")
    assert samples.status == 200
    meta = json.loads(bytes(safetensors.numpy.load(samples.body)["_samples_meta"]))
    assert meta["samples"][0]["response"] == "ok \ufffd\ufffd" and meta["samples"][0]["status"] == "truncated"
    assert "tito_session_mismatch" in body_of(core.get_session(sid))["metadata"]
