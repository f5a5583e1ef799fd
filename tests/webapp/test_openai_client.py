"""The official ``openai`` client against the session server under real gunicorn (gevent worker)."""

from __future__ import annotations

import json

import openai
import pytest
import requests

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(reference_backend_factory, session_server_factory):
    backend = reference_backend_factory(r3_layers=4, r3_topk=2)
    return session_server_factory(backend_url=backend.url, env={"SHINKEN_ROUTING_REPLAY_LAYERS": "4"})


def new_client(server) -> tuple[str, openai.OpenAI]:
    sid = requests.post(server.url + "/sessions", timeout=10).json()["session_id"]
    return sid, openai.OpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key="unused", max_retries=0,
                              timeout=30)


def test_multi_turn_sync_non_streaming(server):
    sid, client = new_client(server)
    messages = [{"role": "system", "content": "You control a desktop."},
                {"role": "user", "content": "Open the settings."}]
    for i in range(3):
        completion = client.chat.completions.create(model="any", messages=messages)
        message = completion.choices[0].message
        assert json.loads(message.content)["action"]["verb"] in ("click", "type", "key", "scroll")
        assert "routed_experts" not in completion.choices[0].model_extra["meta_info"]
        # the echo of the pydantic model (None fields included) still counts as append-only
        messages = messages + [message.model_dump(), {"role": "user", "content": f"observation {i}"}]
    session = requests.get(f"{server.url}/sessions/{sid}", timeout=10).json()
    assert [r["rollback"] for r in session["records"]] == [False, False, False]
    last = session["records"][-1]
    output_ids = [t for _, t in last["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]
    assert session["metadata"]["accumulated_token_ids"] == last["request"]["input_ids"] + output_ids
    assert all("routed_experts" in r["response"]["choices"][0]["meta_info"] for r in session["records"])


def test_streaming(server):
    sid, client = new_client(server)
    messages = [{"role": "user", "content": "Type hello."}]
    for _ in range(2):
        stream = client.chat.completions.create(model="any", messages=messages, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert json.loads(content)["action"]
        messages = messages + [{"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
    records = requests.get(f"{server.url}/sessions/{sid}", timeout=10).json()["records"]
    assert len(records) == 2 and records[1]["rollback"] is False
    assert json.loads(records[1]["response"]["choices"][0]["message"]["content"]) == json.loads(content)


def test_errors_surface_as_openai_exceptions(server):
    sid, client = new_client(server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}], n=2)
    # OpenAI's error shape: the client's exception carries the message and the code.
    assert "only n=1" in bad.value.message and bad.value.code == "invalid_field"
    assert bad.value.response.json()["error"]["type"] == "invalid_request_error"
    assert requests.delete(f"{server.url}/sessions/{sid}", timeout=10).status_code == 204
    with pytest.raises(openai.APIStatusError) as gone:  # a deleted session is gone, not unknown
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
    assert gone.value.status_code == 410 and gone.value.code == "session_gone"
    assert f"session reclaimed: session_id={sid}" in gone.value.message
    never = "0" * 32
    unknown = openai.OpenAI(base_url=f"{server.url}/sessions/{never}/v1", api_key="unused", max_retries=0,
                            timeout=30)
    with pytest.raises(openai.NotFoundError) as missing:
        unknown.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
    assert f"session not found: session_id={never}" in missing.value.message  # was "Error code: 404" alone
    assert missing.value.code == "session_not_found"
    # The session-management routes keep miles' shape.
    assert requests.get(f"{server.url}/sessions/{never}", timeout=10).json() == {
        "error": f"session not found: session_id={never}"}
    assert requests.get(f"{server.url}/sessions/{sid}", timeout=10).json()["error"].startswith(
        f"session reclaimed: session_id={sid}")


def test_logprobs_in_openai_shape_when_asked(server):
    sid, client = new_client(server)
    messages = [{"role": "user", "content": "Click it."}]
    plain = client.chat.completions.create(model="any", messages=messages)
    assert plain.choices[0].logprobs is None  # forced on for the records, not asked for here
    messages = messages + [plain.choices[0].message.model_dump(), {"role": "user", "content": "again"}]
    asked = client.chat.completions.create(model="any", messages=messages, logprobs=True)
    content = asked.choices[0].logprobs.content
    record = requests.get(f"{server.url}/sessions/{sid}", timeout=10).json()["records"][-1]
    pairs = record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
    assert [c.logprob for c in content] == [lp for lp, _ in pairs]
    # The byte tokenizer: one token per byte, the end-of-turn token last.
    assert "".join(c.token for c in content) == asked.choices[0].message.content + "<|im_end|>"
    assert all(c.bytes == list(c.token.encode()) and c.top_logprobs == [] for c in content)
    streamed = client.chat.completions.create(model="any", messages=messages, logprobs=True, stream=True)
    first = next(iter(streamed))
    assert [c.logprob for c in first.choices[0].logprobs.content] == [lp for lp, _ in pairs]
