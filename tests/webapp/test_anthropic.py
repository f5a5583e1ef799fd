"""``POST /sessions/{id}/v1/messages``: Anthropic's Messages API as the canonical OpenAI chat turn.

Unit tests of :mod:`webapp.anthropic` from the API's rules (and miles' Anthropic route: what
maps to what, what is refused), then the official ``anthropic`` SDK against real servers in
both modes (``--workers 0`` and ``--workers 2``) over the reference backend, and over a vLLM
stand-in whose text is a hermes tool call for the tool_use round trip.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import itertools
import json
from urllib.parse import urlsplit

import anthropic
import openai
import pytest
import requests
from PIL import Image

from webapp import anthropic as translate
from webapp.session_errors import GenerationAborted, InvalidField, UnknownField, UnmappableField
from webapp.settings import MAX_BODY_BYTES

from .vllm_standin import VllmStandIn

MODES = {"workers0": 0, "workers2": 2}
BASE = {"model": "m", "max_tokens": 64}


def png(seed: int = 0) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), ((seed * 37) % 256, 90, 128)).save(out, "PNG")
    return out.getvalue()


# --- the request -------------------------------------------------------------------------------

def test_system_blocks_text_image_and_tool_results_map_to_chat_messages_in_order():
    data = base64.b64encode(png()).decode()
    chat = translate.chat_request({**BASE, "system": [{"type": "text", "text": "a", "cache_control": {"type": "x"}},
                                                      {"type": "text", "text": "b"}],
                                   "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                                          {"type": "tool_use", "id": "t1", "name": "click", "input": {"x": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "done"}]},
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]},
    ]})
    assert chat["messages"] == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "click", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "done"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]},
    ]
    assert chat["max_tokens"] == 64 and chat["model"] == "m" and "stream" not in chat


def test_text_before_a_tool_result_stays_before_it_and_thinking_becomes_reasoning():
    chat = translate.chat_request({**BASE, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "text", "text": "before"},
                                     {"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]})
    assert chat["messages"][1] == {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert chat["messages"][2:] == [{"role": "user", "content": "before"},
                                    {"role": "tool", "tool_call_id": "t", "content": "r"}]


def test_tools_tool_choice_and_sampling_fields():
    tools = [{"name": "click", "description": "Click.", "input_schema": {"type": "object"}},
             {"name": "type", "input_schema": {"type": "object"}, "type": "custom"}]
    chat = translate.chat_request({**BASE, "messages": [{"role": "user", "content": "x"}], "tools": tools,
                                   "tool_choice": {"type": "tool", "name": "type", "disable_parallel_tool_use": True},
                                   "stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 5,
                                   "metadata": {"user_id": "u"}, "stream": True})
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "click", "description": "Click.", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "type", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "type"}}
    assert chat["parallel_tool_calls"] is False
    assert (chat["stop"], chat["temperature"], chat["top_p"], chat["top_k"]) == (["END"], 0.5, 0.9, 5)
    assert "metadata" not in chat and "stream" not in chat
    for kind, expected in (("auto", "auto"), ("any", "required"), ("none", "none")):
        got = translate.chat_request({**BASE, "messages": [{"role": "user", "content": "x"}], "tools": tools,
                                      "tool_choice": {"type": kind}})
        assert got["tool_choice"] == expected


@pytest.mark.parametrize(("change", "error", "field"), [
    ({"max_tokens": None}, InvalidField, "max_tokens"),
    ({"max_tokens": 0}, InvalidField, "max_tokens"),
    ({"model": None}, InvalidField, "model"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, UnmappableField, "thinking"),
    ({"mcp_servers": []}, UnmappableField, "mcp_servers"),
    ({"colour": 1}, UnknownField, "colour"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, UnmappableField,
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]}, UnmappableField,
     "messages[0].content[0].extra"),
    ({"messages": [{"role": "system", "content": "x"}]}, InvalidField, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     UnmappableField, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True}]}]},
     UnmappableField, "messages[0].content[0].is_error"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     UnmappableField, "messages[0].content[0].source.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, UnmappableField, "tools[0].type"),
    ({"tool_choice": {"type": "any"}}, InvalidField, "tool_choice"),
    ({"stop_sequences": "END"}, InvalidField, "stop_sequences"),
])
def test_what_cannot_be_mapped_is_refused_naming_the_field(change, error, field):
    request = {**BASE, "messages": [{"role": "user", "content": "x"}], **change}
    request = {k: v for k, v in request.items() if v is not None}
    with pytest.raises(error) as caught:
        translate.chat_request(request)
    assert type(caught.value) is error and caught.value.field == field and caught.value.status == 400


# --- the reply ---------------------------------------------------------------------------------

def completion(message, finish="stop", **choice):
    return {"id": "chatcmpl-1", "model": "engine", "usage": {"prompt_tokens": 7, "completion_tokens": 3},
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, **choice}]}


def test_reply_blocks_stop_reasons_and_usage():
    request = {**BASE, "messages": [], "stop_sequences": ["END"]}
    text = translate.message_reply(completion({"content": "hello"}), request)
    assert text == {"id": "msg_chatcmpl-1", "type": "message", "role": "assistant", "model": "engine",
                    "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
                    "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 3}}
    assert translate.message_reply(completion({"content": "he"}, "length"), request)["stop_reason"] == "max_tokens"
    matched = translate.message_reply(completion({"content": "x"}, matched_stop="END"), request)
    assert (matched["stop_reason"], matched["stop_sequence"]) == ("stop_sequence", "END")
    call = {"id": "c1", "type": "function", "function": {"name": "click", "arguments": '{"x": 3}'}}
    # a tool call is tool_use whatever the engine named the finish
    used = translate.message_reply(completion({"content": "", "tool_calls": [call]}, "stop"), request)
    assert used["content"] == [{"type": "tool_use", "id": "c1", "name": "click", "input": {"x": 3}}]
    assert used["stop_reason"] == "tool_use"
    empty = translate.message_reply(completion({"content": None}), request)
    assert empty["content"] == [{"type": "text", "text": ""}]
    with pytest.raises(GenerationAborted) as aborted:
        translate.message_reply(completion({"content": "x"}, "abort"), request)
    assert aborted.value.status == 529


def test_events_carry_the_whole_message_in_anthropics_order():
    call = {"id": "c1", "function": {"name": "f", "arguments": '{"a": [1]}'}}
    message = translate.message_reply(completion({"content": "hi", "tool_calls": [call]}, "tool_calls"), BASE)
    events = [chunk.decode() for chunk in translate.message_events(message)]
    names = [e.split("\n", 1)[0].removeprefix("event: ") for e in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    data = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert all(d["type"] == n for d, n in zip(data, names))
    assert data[0]["message"]["content"] == [] and data[0]["message"]["usage"] == {"input_tokens": 7,
                                                                                  "output_tokens": 0}
    assert data[2]["delta"] == {"type": "text_delta", "text": "hi"}
    assert json.loads(data[5]["delta"]["partial_json"]) == {"a": [1]}
    assert data[7]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert data[7]["usage"] == {"output_tokens": 3}


def test_replayed_tool_calls_keep_the_stored_spelling():
    stored = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1,  "y": 2}'}}]}]
    spelled = translate.stored_tool_arguments(stored)
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": 2}'}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    translate.restore_tool_arguments(messages, spelled)
    assert [c["function"]["arguments"] for c in messages[0]["tool_calls"]] == ['{"x":1,  "y": 2}', '{"x": 1}']
    changed = [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"x": 9}'}}]}]
    translate.restore_tool_arguments(changed, spelled)
    assert changed[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 9}'  # another value: kept


# --- the official SDK against real servers -----------------------------------------------------

@pytest.fixture(scope="module", params=sorted(MODES))
def server_url(request, backend, session_server_factory) -> str:
    return session_server_factory.launch(MODES[request.param], backend.url).url


def new_session(url: str) -> tuple[str, anthropic.Anthropic]:
    sid = requests.post(url + "/sessions", timeout=30).json()["session_id"]
    return sid, anthropic.Anthropic(base_url=f"{url}/sessions/{sid}", api_key="unused", max_retries=0, timeout=60)


def records(url: str, sid: str) -> dict:
    return requests.get(f"{url}/sessions/{sid}", timeout=30).json()


def test_multi_turn_records_the_same_prompt_ids_as_the_openai_conversation(server_url):
    sid, client = new_session(server_url)
    osid = requests.post(server_url + "/sessions", timeout=30).json()["session_id"]
    oai = openai.OpenAI(base_url=f"{server_url}/sessions/{osid}/v1", api_key="unused", max_retries=0, timeout=60)
    system, a_messages, o_messages = "You control a desktop.", [], [{"role": "system", "content": "You control a desktop."}]
    for i in range(3):
        a_messages.append({"role": "user", "content": f"step {i}"})
        o_messages.append({"role": "user", "content": f"step {i}"})
        reply = client.messages.create(model="m", max_tokens=200, system=system, messages=a_messages)
        assert reply.type == "message" and reply.role == "assistant" and reply.stop_reason == "end_turn"
        (block,) = reply.content
        assert json.loads(block.text)["action"]["verb"] in ("click", "type", "key", "scroll")
        chat = oai.chat.completions.create(model="m", max_tokens=200, messages=o_messages)
        assert chat.choices[0].message.content == block.text
        assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                       chat.usage.completion_tokens)
        a_messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        o_messages.append({"role": "assistant", "content": chat.choices[0].message.content})
    mine, theirs = records(server_url, sid), records(server_url, osid)
    prompts = [r["request"]["input_ids"] for r in mine["records"]]
    assert prompts == [r["request"]["input_ids"] for r in theirs["records"]]
    assert all(later[:len(earlier)] == earlier for earlier, later in itertools.pairwise(prompts))  # append-only
    assert mine["metadata"]["accumulated_token_ids"] == theirs["metadata"]["accumulated_token_ids"]
    assert [r["path"] for r in mine["records"]] == ["/v1/chat/completions"] * 3  # the canonical chat record
    assert [r["request"]["max_tokens"] for r in mine["records"]] == [200] * 3
    assert reply.id == "msg_" + mine["records"][-1]["response"]["id"]
    samples = requests.post(f"{server_url}/sessions/{sid}/samples", json={}, timeout=30)
    assert samples.status_code == 200


def test_streaming_with_the_sdk_stream_helper(server_url):
    sid, client = new_session(server_url)
    with client.messages.stream(model="m", max_tokens=200, messages=[{"role": "user", "content": "Type."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert json.loads(text)["action"] and final.content[0].text == text and final.stop_reason == "end_turn"
    (record,) = records(server_url, sid)["records"]
    assert record["response"]["choices"][0]["message"]["content"] == text
    assert final.usage.output_tokens == record["response"]["usage"]["completion_tokens"]
    cut = client.messages.create(model="m", max_tokens=3, messages=[
        {"role": "user", "content": "Type."}, {"role": "assistant", "content": text},
        {"role": "user", "content": "again"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_image_block_is_recorded_as_the_chat_route_records_it(server_url):
    sid, client = new_session(server_url)
    image = png(5)
    reply = client.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is on the screen?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(image).decode()}}]}])
    assert reply.content[0].type == "text"
    session = requests.get(f"{server_url}/sessions/{sid}?images=1", timeout=30).json()
    ((sha, stored),) = session["images"].items()
    assert sha == hashlib.sha256(image).hexdigest() and base64.b64decode(stored["data"]) == image
    (record,) = session["records"]
    assert record["request"]["image_data"] == [f"sha256:{sha}"]  # the data URL, by reference (the chat rule)


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     "messages[0].content[0].type"),
])
def test_bad_input_is_a_typed_400_in_anthropics_shape_and_nothing_is_recorded(server_url, body, field):
    sid, client = new_session(server_url)
    with pytest.raises(anthropic.BadRequestError) as bad:  # the SDK's own post: messages.create checks max_tokens
        client.post("/v1/messages", body=body, cast_to=object)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert repr(field) in bad.value.body["error"]["message"]
    assert records(server_url, sid)["records"] == []
    raw = requests.post(f"{server_url}/sessions/{sid}/v1/messages", data=b"{", timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    missing = requests.post(f"{server_url}/sessions/nope/v1/messages", json={**BASE, "messages": [
        {"role": "user", "content": "x"}]}, timeout=30)
    assert missing.status_code == 404 and missing.json() == {
        "type": "error", "error": {"type": "not_found_error", "message": "session not found: session_id=nope"}}
    # the router's own refusals on this route take the same shape
    # announced over the body cap: refused before a byte of it is read
    conn = http.client.HTTPConnection(urlsplit(server_url).hostname, urlsplit(server_url).port, timeout=30)
    try:
        conn.putrequest("POST", f"/sessions/{sid}/v1/messages")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        conn.endheaders()
        huge = conn.getresponse()
        assert huge.status == 413
        assert json.loads(huge.read())["error"]["type"] == "request_too_large"
    finally:
        conn.close()
    assert records(server_url, sid)["records"] == []


# --- tool_use / tool_result round trip (a vLLM stand-in answering a hermes tool call) --------

@pytest.fixture(scope="module", params=sorted(MODES))
def tool_server(request, session_server_factory):
    engine = VllmStandIn()
    server = session_server_factory.launch(MODES[request.param], engine.url, "--backend-kind", "vllm")
    yield engine, server.url
    engine.close()


CLICK = {"name": "click", "description": "Click at a point.",
         "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}


def test_tool_use_and_tool_result_round_trip(tool_server):
    engine, url = tool_server
    sid, client = new_session(url)
    # the model's own spelling (no spaces): the replayed call must keep it for the prompt to extend
    # (arguments as JSON text: the hermes parser keeps it as written)
    engine.reply_text = ('Clicking.\n<tool_call>\n{"name": "click", "arguments": "{\\"x\\":812,\\"y\\":440}"}'
                         '\n</tool_call>')
    messages = [{"role": "user", "content": "Press OK."}]
    first = client.messages.create(model="m", max_tokens=200, tools=[CLICK], messages=messages)
    assert first.stop_reason == "tool_use"
    text, use = first.content
    assert text.text == "Clicking." and use.type == "tool_use" and use.name == "click"
    assert use.input == {"x": 812, "y": 440}
    engine.reply_text = "Done."
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "clicked"}]}]}]
    with client.messages.stream(model="m", max_tokens=200, tools=[CLICK], messages=messages) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "Done." and final.stop_reason == "end_turn"
    session = records(url, sid)
    one, two = session["records"]
    assert two["rollback"] is False
    assert one["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"x":812,"y":440}'
    assert two["request"]["input_ids"][:len(one["request"]["input_ids"])] == one["request"]["input_ids"]
    assert session["metadata"]["accumulated_token_ids"][:len(two["request"]["input_ids"])] == two["request"]["input_ids"]
    # a streamed tool call: the SDK assembles the input from the input_json_delta
    engine.reply_text = '<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}\n</tool_call>'
    messages += [{"role": "assistant", "content": [b.model_dump() for b in final.content]},
                 {"role": "user", "content": "once more"}]
    with client.messages.stream(model="m", max_tokens=200, tools=[CLICK], messages=messages) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == {"x": 1, "y": 2}
