"""The engine dialects (``webapp.engines``): request mapping, reply mapping, and every malformed
reply field as a typed error naming it. The vLLM replies are real ones, captured from vLLM
0.32.0 (``vllm_replies/``); ``routed_experts`` follows vLLM's ``CompletionResponseChoice``
(base64 of ``np.save`` bytes as ``vllm/utils/serial_utils.py:numpy2base64`` writes them,
``(tokens - 1, layers, top_k)``, uint8/uint16/int32)."""

from __future__ import annotations

import base64
import copy
import io
import json
import pathlib
from typing import Any

import numpy as np
import pytest

from webapp.backend import BackendReply, payload_bytes
from webapp.core import SessionCore
from webapp.engines import EngineConfigError, ReplayRequest, dialect_for
from webapp.engines.base import CLIENT_ONLY_FIELDS, EngineRequest, dumps
from webapp.engines.sglang import FORCED_FIELDS
from webapp.engines.toolcalls import hermes
from webapp.engines.vllm import SAMPLING_FIELDS, decode_routed_experts
from webapp.images import ImageLimits, extract_images, wire_messages
from webapp.records import ids_json
from webapp.reference_backend import R3Shape, reference_completion
from webapp.session_errors import BackendMalformed, InvalidField, MalformedReplyField
from webapp.tokenizers import ByteChatTokenizer

from .vllm_standin import routed_experts_npy, vllm_completion

TOK = ByteChatTokenizer()
REPLIES = pathlib.Path(__file__).with_name("vllm_replies")
NO_IMAGES = extract_images([{"role": "user", "content": "hi"}], ImageLimits(), {})


def captured(name: str) -> dict[str, Any]:
    return json.loads((REPLIES / f"{name}.json").read_text())


def sent_for(prompt: list[int], top: int = 0) -> EngineRequest:
    return EngineRequest("/v1/completions", b"", b"", prompt, top)


def as_reply(obj: dict[str, Any]) -> BackendReply:
    return BackendReply.from_raw(json.dumps(obj).encode())


# --- sglang ----------------------------------------------------------------------------------

def test_sglang_request_is_miles_wire_with_replay_fields():
    dialect = dialect_for("sglang", ReplayRequest(routed_experts=True, indexer_topk=True))
    req = dialect.build_request({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                 "stream_options": {"include_usage": True}, "temperature": 0.5}, [1, 2, 3], NO_IMAGES)
    body = json.loads(req.body)
    assert req.path == "/v1/chat/completions" and req.body == req.recorded and req.prompt_ids == [1, 2, 3]
    assert body["input_ids"] == [1, 2, 3] and body["temperature"] == 0.5 and "stream_options" not in body
    assert {k: body[k] for k in FORCED_FIELDS} == FORCED_FIELDS
    assert body["return_routed_experts"] is True and body["return_indexer_topk"] is True


def test_sglang_images_are_sent_as_data_urls_and_recorded_as_references():
    png = base64.b64encode(_png()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                                             {"type": "text", "text": "what is it"}]}]
    images = extract_images(messages, ImageLimits(), {})
    req = dialect_for("sglang").build_request({"messages": messages}, [5, 6], images)
    sent, recorded = json.loads(req.body), json.loads(req.recorded)
    assert sent["image_data"] == [f"data:image/png;base64,{png}"]
    assert recorded["image_data"] == [images.images[0][0].ref] and recorded["image_data"][0].startswith("sha256:")


def _whole_payload(dialect: Any, request: dict[str, Any], ids: list[int], images: Any, urls: bool) -> bytes:
    """The request as one ``dumps`` of the payload dict (the form build_request writes in pieces)."""
    payload = {k: v for k, v in request.items() if k not in CLIENT_ONLY_FIELDS}
    payload.update(dialect.forced_fields)
    payload["input_ids"] = ids
    if images.images:
        payload["messages"] = wire_messages(images.messages)
        payload["image_data"] = [url.decode() if urls else image.ref for image, url in images.images]
    return dumps(payload)


@pytest.mark.parametrize("replay_from", [0, 7])
def test_sglang_bodies_are_the_dumps_of_the_whole_payload_with_or_without_the_ids_text(replay_from):
    """Byte for byte, however the ids text arrives; a client text equal to a placeholder the
    request was once built with stays text (it used to be taken for an image_data slot)."""
    dialect = dialect_for("sglang", ReplayRequest(routed_experts=True))
    png = base64.b64encode(_png()).decode()
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    messages = [{"role": "system", "content": "\u2063IMAGE\u2063"},
                {"role": "user", "content": [part, {"type": "text", "text": "\u2063IMAGE\u2063 \u00e9"}, part]}]
    request = {"temperature": 0.5, "messages": messages, "stream": True, "logprobs": True}
    ids = [3, 10, 200, 4000, 0]
    for images in [extract_images(messages, ImageLimits(), {}), NO_IMAGES]:
        whole = _whole_payload(dialect, request, ids, images, urls=True)
        sent = whole[:-1] + b',"routed_experts_start_len":7}' if replay_from else whole
        for ids_text in [None, ids_json(ids)]:
            req = dialect.build_request(request, ids, images, replay_from=replay_from, ids_text=ids_text)
            assert req.body == sent
            assert req.recorded == _whole_payload(dialect, request, ids, images, urls=False)


def test_vllm_bodies_are_the_same_with_or_without_the_ids_text():
    client = {"messages": [], "temperature": 0.5, "max_tokens": 9}
    dialect = dialect_for("vllm")
    ids = [4, 50, 600]
    req = dialect.build_request(client, ids, NO_IMAGES)
    again = dialect.build_request(client, ids, NO_IMAGES, ids_text=ids_json(ids))
    assert (again.body, again.recorded) == (req.body, req.recorded)
    assert json.loads(req.body)["prompt"] == ids


def test_sglang_reply_maps_to_the_turn_and_the_client_copy_has_no_replay_payloads():
    raw = json.dumps(reference_completion([7, 8, 9], TOK, want_r3=True, r3=R3Shape(layers=2, top_k=2))).encode()
    sent = EngineRequest("/v1/chat/completions", b"", b"", [7, 8, 9])
    turn = dialect_for("sglang").parse_reply(BackendReply.from_raw(raw), sent)
    pairs = json.loads(raw)["choices"][0]["meta_info"]["output_token_logprobs"]
    assert turn.output_ids == [t for _lp, t in pairs] and turn.logprobs == [lp for lp, _t in pairs]
    assert turn.record_response == raw and [k for k, _s, _e in turn.replay_spans] == ["routed_experts"]
    assert "routed_experts" not in turn.completion["choices"][0]["meta_info"]


# --- vllm: request -----------------------------------------------------------------------------

def test_vllm_request_is_a_token_id_completion_with_the_clients_sampling_fields():
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}],
              "max_completion_tokens": 12, "logprobs": True, "top_logprobs": 3, "stream": True,
              **{name: 1 for name in SAMPLING_FIELDS}}
    req = dialect_for("vllm").build_request(client, [4, 5, 6], NO_IMAGES)
    body = json.loads(req.body)
    assert req.path == "/v1/completions" and body["prompt"] == [4, 5, 6] and req.top_logprobs == 3
    assert body["max_tokens"] == 12 and body["logprobs"] == 3 and body["stream"] is False
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    assert body["skip_special_tokens"] is False
    assert all(body[name] == 1 for name in SAMPLING_FIELDS)
    assert not {"model", "messages", "tools", "top_logprobs", "max_completion_tokens"} & set(body)
    recorded = json.loads(req.recorded)
    assert recorded["input_ids"] == [4, 5, 6] and recorded["messages"] == client["messages"]
    assert recorded["engine"] == {"kind": "vllm", "path": "/v1/completions",
                                  "body": {k: v for k, v in body.items() if k != "prompt"}}


def test_vllm_request_defaults_ask_the_sampled_logprob_and_no_token_cap():
    body = json.loads(dialect_for("vllm").build_request({"messages": []}, [1], NO_IMAGES).body)
    assert body["logprobs"] == 0 and body["max_tokens"] is None  # not vLLM's completions default of 16


def test_vllm_refuses_images_and_indexer_replay():
    png = base64.b64encode(_png()).decode()
    images = extract_images([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}], ImageLimits(), {})
    with pytest.raises(InvalidField, match="images are not supported"):
        dialect_for("vllm").build_request({"messages": []}, [1], images)
    with pytest.raises(EngineConfigError, match="indexer replay"):
        dialect_for("vllm", ReplayRequest(indexer_topk=True))
    with pytest.raises(EngineConfigError, match="unknown backend kind"):
        dialect_for("tgi")


# --- vllm: reply -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["completions_length", "completions_eos", "completions_stop_token",
                                  "completions_logprobs0"])
def test_vllm_real_replies_map_token_exact(name):
    capture = captured(name)
    prompt, reply = capture["request"]["body"]["prompt"], capture["reply"]
    choice = reply["choices"][0]
    turn = dialect_for("vllm").parse_reply(as_reply(reply), sent_for(prompt))
    assert turn.output_ids == choice["token_ids"] and turn.logprobs == choice["logprobs"]["token_logprobs"]
    assert turn.finish_reason == choice["finish_reason"]
    assert turn.assistant_message == {"role": "assistant", "content": choice["text"]}
    assert turn.meta == {"prompt_tokens": len(prompt), "completion_tokens": len(choice["token_ids"]),
                         "cached_tokens": 0}
    record = json.loads(turn.record_response)  # miles' shape: what its consumer reads
    meta = record["choices"][0]["meta_info"]
    assert meta["output_token_logprobs"] == [[lp, t] for lp, t in zip(choice["logprobs"]["token_logprobs"],
                                                                      choice["token_ids"])]
    assert record["choices"][0]["finish_reason"] == choice["finish_reason"] and "routed_experts" not in meta
    engine = record["engine_reply"]  # the engine's reply, less the two fields held once
    assert engine["choices"][0] == {k: v for k, v in choice.items() if k not in ("prompt_token_ids", "routed_experts")}
    assert engine["usage"] == reply["usage"] == record["usage"]
    completion = turn.completion
    assert completion["object"] == "chat.completion" and completion["choices"][0]["message"]["content"] == choice["text"]
    assert turn.replay_spans == [] and turn.top_logprobs is None


def test_vllm_tool_calls_are_parsed_from_the_text_and_finish_as_tool_calls():
    prompt = [1, 2, 3]
    reply = vllm_completion(prompt, {})
    call = '{"name": "computer", "arguments": {"action": "click", "x": 3}}'
    reply["choices"][0]["text"] = f"Clicking.\n<tool_call>\n{call}\n</tool_call>"
    turn = dialect_for("vllm").parse_reply(as_reply(reply), sent_for(prompt))
    (tool,) = turn.assistant_message["tool_calls"]
    assert turn.assistant_message["content"] == "Clicking." and turn.finish_reason == "tool_calls"
    assert tool["function"] == {"name": "computer", "arguments": json.dumps({"action": "click", "x": 3})}
    assert turn.completion["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "computer"
    plain = dialect_for("vllm", tool_call_parser="none").parse_reply(as_reply(reply), sent_for(prompt))
    assert "tool_calls" not in plain.assistant_message and plain.finish_reason == "stop"


@pytest.mark.parametrize("text", ["<tool_call>{not json}</tool_call>", "<tool_call>[1, 2]</tool_call>",
                                  '<tool_call>{"name": "x"', "no call at all"])
def test_hermes_leaves_a_text_that_is_no_valid_call_as_content(text):
    assert hermes(text) == (text, [])


def test_vllm_top_logprobs_keyed_by_token_id_give_exact_alternatives():
    prompt = [1, 2, 3]
    body = {"logprobs": 1, "return_tokens_as_token_ids": True}
    reply = vllm_completion(prompt, body)
    turn = dialect_for("vllm").parse_reply(as_reply(reply), sent_for(prompt, top=1))
    assert turn.top_logprobs is not None and len(turn.top_logprobs) == len(turn.output_ids)
    first = reply["choices"][0]["logprobs"]["top_logprobs"][0]
    assert sorted(turn.top_logprobs[0]) == sorted((lp, int(k.split(":")[1])) for k, lp in first.items())


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_vllm_routed_experts_become_miles_r3_int32(dtype):
    prompt = [1, 2, 3, 4]
    reply = vllm_completion(prompt, {}, r3=(3, 2, dtype))
    rows = len(prompt) + len(reply["choices"][0]["token_ids"]) - 1
    _b64, array = routed_experts_npy(rows, 3, 2, dtype)
    turn = dialect_for("vllm", ReplayRequest(routed_experts=True)).parse_reply(as_reply(reply), sent_for(prompt))
    ((key, start, end),) = turn.replay_spans
    r3 = np.frombuffer(base64.b64decode(turn.record_response[start:end]), dtype="<i4")
    assert key == "routed_experts" and np.array_equal(r3.reshape(rows, 3, 2), array.astype(np.int32))
    record = json.loads(turn.record_response)
    assert record["choices"][0]["meta_info"]["routed_experts"] == turn.record_response[start:end].decode()
    assert "routed_experts" not in record["engine_reply"]["choices"][0]
    assert "routed_experts" not in json.dumps(turn.completion)


def test_vllm_routed_experts_of_another_shape_or_kind_are_refused():
    with pytest.raises(MalformedReplyField, match=r"shape \(5, layers, top_k\)") as err:
        decode_routed_experts(routed_experts_npy(4, 2, 2)[0].encode(), 5)
    assert err.value.field == "choices[0].routed_experts"
    buf = io.BytesIO()
    np.save(buf, np.zeros((5, 2, 2), dtype=np.float32))
    with pytest.raises(MalformedReplyField, match="float32"):
        decode_routed_experts(base64.b64encode(buf.getvalue()), 5)
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(MalformedReplyField, match="not base64 .npy"):  # never unpickled
        decode_routed_experts(base64.b64encode(buf.getvalue()), 1)


def _set(path: str, value: Any) -> Any:
    def change(reply: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = reply
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DROP:
            del node[last]
        else:
            node[last] = value
    return change


_DROP = object()
_MALFORMED = [
    ("choices", [], "choices"),
    ("choices.0.token_ids", _DROP, "choices[0].token_ids"),
    ("choices.0.token_ids", None, "choices[0].token_ids"),
    ("choices.0.token_ids", ["7"], "choices[0].token_ids"),
    ("choices.0.prompt_token_ids", _DROP, "choices[0].prompt_token_ids"),
    ("choices.0.prompt_token_ids", [9, 9, 9], "choices[0].prompt_token_ids"),
    ("choices.0.logprobs", None, "choices[0].logprobs"),
    ("choices.0.logprobs.token_logprobs", [-1.0], "choices[0].logprobs.token_logprobs"),
    ("choices.0.logprobs.token_logprobs", _DROP, "choices[0].logprobs.token_logprobs"),
    ("choices.0.text", None, "choices[0].text"),
    ("choices.0.finish_reason", 3, "choices[0].finish_reason"),
    ("choices.0.routed_experts", 5, "choices[0].routed_experts"),
    ("choices.0.routed_experts", "AAAA", "choices[0].routed_experts"),
    ("usage", None, "usage"),
    ("usage.completion_tokens", 999, "usage.completion_tokens"),
]


@pytest.mark.parametrize("path, value, field", _MALFORMED, ids=[f"{p}={v!r:.10}" for p, v, _f in _MALFORMED])
def test_every_malformed_vllm_reply_field_is_a_typed_error_naming_it(path, value, field):
    capture = captured("completions_length")
    reply = copy.deepcopy(capture["reply"])
    _set(path, value)(reply)
    with pytest.raises(MalformedReplyField) as err:
        dialect_for("vllm").parse_reply(as_reply(reply), sent_for(capture["request"]["body"]["prompt"]))
    assert err.value.field == field and field in str(err.value)
    assert isinstance(err.value, BackendMalformed) and err.value.status == 502 and err.value.code == "backend_malformed"


def test_vllm_top_logprobs_not_keyed_by_token_id_are_refused_when_asked_for():
    capture = captured("completions_length")  # captured without return_tokens_as_token_ids
    with pytest.raises(MalformedReplyField, match="token_id:N") as err:
        dialect_for("vllm").parse_reply(as_reply(capture["reply"]), sent_for(capture["request"]["body"]["prompt"], 1))
    assert err.value.field == "choices[0].logprobs.top_logprobs"


# --- through the session core ------------------------------------------------------------------

class StandInBackend:
    """vLLM's completions replies, in process (the HTTP stand-in is in the server tests)."""

    def __init__(self, r3: tuple[int, int, Any] | None = None) -> None:
        self.r3 = r3
        self.paths: list[str] = []

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        payload = payload_bytes(payload)  # an image turn sends pieces
        self.paths.append(path)
        body = json.loads(payload)
        return as_reply(vllm_completion(body["prompt"], body, self.r3))

    def close(self) -> None:
        pass


def test_a_vllm_served_session_answers_openai_and_its_samples_carry_the_r3_tensor():
    backend = StandInBackend(r3=(3, 2, np.uint8))
    core = SessionCore(TOK, backend, routing_replay_layers=3,  # type: ignore[arg-type]
                       dialect=dialect_for("vllm", ReplayRequest(routed_experts=True)))
    sid = json.loads(core.create_session().body)["session_id"]
    history: list[dict[str, Any]] = []
    for text in ("open the file", "now save it"):
        messages = [*history, {"role": "user", "content": text}]
        reply = core.chat(sid, json.dumps({"messages": messages, "logprobs": True}).encode())
        assert reply.status == 200, reply.read()
        completion = json.loads(reply.read())
        history = [*messages, completion["choices"][0]["message"]]
        content = completion["choices"][0]["logprobs"]["content"]
        assert [c["logprob"] for c in content] and completion["usage"]["completion_tokens"] == len(content)
    assert backend.paths == ["/v1/completions"] * 2
    session = json.loads(core.get_session(sid).read())
    tokens = session["metadata"]["accumulated_token_ids"]
    last = session["records"][-1]
    assert last["request"]["input_ids"] == tokens[:len(last["request"]["input_ids"])]
    import safetensors.numpy

    from webapp.samples import META_KEY
    tensors = safetensors.numpy.load(core.samples(sid, b"{}").read())
    r3 = tensors["rollout_routed_experts.0"]
    assert r3.shape == (len(tokens) - 1, 3, 2) and r3.dtype == np.int32
    rows = len(last["request"]["input_ids"]) + len(last["response"]["choices"][0]["meta_info"]
                                                   ["output_token_logprobs"]) - 1
    assert np.array_equal(r3, routed_experts_npy(rows, 3, 2)[1].astype(np.int32))
    assert json.loads(bytes(tensors[META_KEY]))["samples"][0]["status"] == "completed"
    core.close()


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def test_the_session_core_names_no_engine_field():
    import webapp.core

    source = pathlib.Path(webapp.core.__file__).read_text()
    for name in ("meta_info", "output_token_logprobs", "input_ids", "image_data", "return_routed_experts",
                 "return_meta_info", "no_stop_trim", "prompt_token_ids", "/v1/completions"):
        assert name not in source, name


def test_a_turn_turns_only_its_new_prompt_ids_into_text(monkeypatch):
    """The engine request and the journal share one ids text, extended per turn by the ids the
    turn added (the earlier ones are never turned into text again, the new ones once: the
    journal takes the request's text); the bodies are unchanged."""
    import webapp.journal as journal_module

    texts: list[int] = []  # lengths of the id runs turned into JSON text
    monkeypatch.setattr(journal_module, "ids_json", lambda ids: texts.append(len(ids)) or ids_json(ids))

    class Backend:
        def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
            payload = payload_bytes(payload)  # an image turn sends pieces
            request = json.loads(payload)
            assert payload == dumps(request)  # the whole body, byte for byte, as one dumps of it
            return as_reply(reference_completion(request["input_ids"], TOK))

        def close(self) -> None:
            pass

    core = SessionCore(TOK, Backend())  # type: ignore[arg-type]
    sid = json.loads(core.create_session().body)["session_id"]
    messages: list[dict[str, Any]] = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"observation {turn} " + "x" * 300})
        texts.clear()
        reply = core.chat(sid, json.dumps({"messages": messages}).encode())
        assert reply.status == 200, reply.read()
        messages.append(json.loads(reply.read())["choices"][0]["message"])
        assert len(texts) == 2, texts  # the prompt's new ids (once, for both) and the reply's
        if turn:
            assert max(texts) < 400, texts  # the new user message and the reply, not the history
    core.close()
