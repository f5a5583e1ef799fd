"""A path no route serves answers a 404 that names the routes, in both server modes; an OpenAI
client whose base URL lacks ``/sessions/{id}`` gets OpenAI's error shape saying where the
endpoint is (the official client reads ``error.message`` from it)."""

from __future__ import annotations

import openai
import pytest
import requests

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=[0, 2], ids=["single-process", "router"])
def server(request, backend, session_server_factory, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    return session_server_factory.launch(request.param, backend.url, "--data-dir", str(data_dir))


def test_chat_without_the_session_prefix_says_where_the_route_is(server):
    reply = requests.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=10)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "not_found"
    assert "POST /sessions creates" in error["message"]
    assert "POST /sessions/<session_id>/v1/chat/completions" in error["message"]
    assert f"base_url={server.url}/sessions/<session_id>/v1" in error["message"]


def test_an_openai_client_without_the_session_in_its_base_url_is_told_the_route(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
    assert "/sessions/<session_id>/v1/chat/completions" in missing.value.message


def test_any_other_unknown_path_names_the_routes_in_miles_shape(server):
    reply = requests.get(f"{server.url}/no/such/route", timeout=10)
    assert reply.status_code == 404
    message = reply.json()["error"]
    assert isinstance(message, str) and "GET /no/such/route is not a route" in message
    assert "POST /sessions" in message and "GET /health" in message


def test_a_missing_session_keeps_its_own_404(server):
    reply = requests.get(f"{server.url}/sessions/{'0' * 32}", timeout=10)
    assert reply.status_code == 404 and "session not found" in reply.json()["error"]
