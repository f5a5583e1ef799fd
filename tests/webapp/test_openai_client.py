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
    return session_server_factory(backend_url=backend.url)


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
    assert session["metadata"]["accumulated_token_ids"] == last["prompt_token_ids"] + last["output_token_ids"]
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
    assert "only n=1" in bad.value.response.json()["error"]
    assert requests.delete(f"{server.url}/sessions/{sid}", timeout=10).status_code == 204
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
