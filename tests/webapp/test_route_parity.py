"""Route parity: the single-process server (``--workers 0``) and the router over worker
processes (``--workers 2``) answer every route of the route table the same way.

Each mode runs under its real launcher (``shinken-session-server``, gunicorn's gevent worker),
with and without an API key, with small limits (message bytes, bytes in flight) so the limit
answers are reachable, and an instance tag. One scripted sequence of requests (every route of
:data:`webapp.routes.ROUTES`, good and bad input, missing and wrong keys, over-limit bodies,
the viewer's reads) runs against each server; statuses, headers (but ``Date`` and
``Content-Length``, checked against the body) and bodies must be equal once the values that
are per server by design (minted session ids, the data directory's instance id, times, the
ETag of a body holding times) are replaced by placeholders. Each answer is also checked on its own, so
two modes wrong the same way fail too.
"""

from __future__ import annotations

import http.client
import json
import re
from typing import Any
from urllib.parse import urlsplit

import pytest
import safetensors.numpy

from webapp.routes import ROUTES

KEY = "parity-test-key-0123456789"
INSTANCE = "p7"
MAX_MESSAGE_BYTES = 4096
MAX_INFLIGHT_BYTES = 256 << 10
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}
MESSAGES = {"model": "m", **CHAT}  # Anthropic's Messages API: model and max_tokens required

Answer = tuple[int, dict[str, str], Any]


@pytest.fixture(scope="module")
def backend(reference_backend_factory):
    return reference_backend_factory(r3_layers=2, r3_topk=2)


@pytest.fixture(scope="module")
def servers(session_server_factory, backend):
    """(workers, auth) -> the server's base URL; four servers, one data directory each."""
    started = {}
    for workers in (0, 2):
        for auth in (False, True):
            flags = ["--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-inflight-bytes", str(MAX_INFLIGHT_BYTES),
                     "--instance", INSTANCE, "--routing-replay-layers", "2"]
            if auth:
                flags += ["--api-key", KEY]
            started[(workers, auth)] = session_server_factory.launch(workers, backend.url, *flags).url
    return started


def _request(url: str, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> Answer:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        got = {k.title(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    if "Content-Length" in got:
        assert int(got.pop("Content-Length")) == len(raw), (method, path)
    got.pop("Date", None)
    if "Etag" in got:  # of the body's bytes, which hold wall-clock times: its shape, not its value
        assert re.fullmatch(r'"[0-9a-f]+-[0-9a-f]+(-i)?"', got["Etag"]), got["Etag"]
        got["Etag"] = "<etag>"
    kind = got.get("Content-Type", "")
    parsed: Any = raw
    if kind.startswith("application/json") and raw:
        parsed = json.loads(raw)
    elif kind == "application/octet-stream" and resp.status == 200:  # miles' /samples: safetensors
        tensors = safetensors.numpy.load(raw)
        parsed = {name: (json.loads(bytes(array)) if name == "_samples_meta" else array.tolist())
                  for name, array in tensors.items()}
    return resp.status, got, parsed


def _scenario(url: str, auth: bool) -> list[tuple[str, Answer]]:
    """Every route of the table, good and bad, in one fixed order; (what, answer) each."""
    bearer = {"Authorization": f"Bearer {KEY}"} if auth else {}
    as_json = {"Content-Type": "application/json", **bearer}
    seen: list[tuple[str, Answer]] = []

    def ask(what: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Answer:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        answer = _request(url, method, path, data, as_json if headers is None else headers)
        seen.append((what, answer))
        return answer

    status, _, health = ask("health", "GET", "/health", headers={})
    assert status == 200 and health["status"] == "ok" and health["instance"] == INSTANCE
    status, _, created = ask("create", "POST", "/sessions")
    assert status == 200 and created["session_id"].startswith(INSTANCE)
    sid = created["session_id"]
    base = f"/sessions/{sid}"
    status, _, turn = ask("chat", "POST", f"{base}/v1/chat/completions", CHAT)
    assert status == 200 and turn["choices"][0]["message"]["role"] == "assistant"
    follow = {**CHAT, "messages": [*CHAT["messages"], turn["choices"][0]["message"], {"role": "user", "content": "and?"}]}
    status, _, turn2 = ask("chat again", "POST", f"{base}/v1/chat/completions", follow)
    assert status == 200
    # the Messages route goes on with the same conversation (it is the same turn, asked in Anthropic's API)
    history = [*follow["messages"], {"role": "assistant", "content": turn2["choices"][0]["message"]["content"]},
               {"role": "user", "content": "more"}]
    assert ask("chat: bad json", "POST", f"{base}/v1/chat/completions", b"{")[0] == 400
    assert ask("chat: wrong type", "POST", f"{base}/v1/chat/completions", {**CHAT, "stream": 1})[0] == 400
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_MESSAGE_BYTES * 2)}]}
    assert ask("chat: message over the limit", "POST", f"{base}/v1/chat/completions", big)[0] in (400, 413)
    huge = b'{"messages": [{"role": "user", "content": "' + b"y" * MAX_INFLIGHT_BYTES + b'"}]}'
    # bigger than the whole budget of bytes in flight: it could never be admitted
    assert ask("chat: over the bytes in flight", "POST", f"{base}/v1/chat/completions", huge)[0] == 413
    assert ask("chat: no such session", "POST", "/sessions/nope/v1/chat/completions", CHAT)[0] == 404
    status, _, message = ask("messages", "POST", f"{base}/v1/messages", {**MESSAGES, "messages": history})
    assert status == 200 and message["type"] == "message" and message["content"][0]["type"] == "text"
    status, headers, events = ask("messages: stream", "POST", f"{base}/v1/messages", {
        **MESSAGES, "stream": True, "messages": [*history, {"role": "assistant", "content": message["content"]},
                                                 {"role": "user", "content": "and?"}]})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert events.startswith(b"event: message_start") and events.endswith(b'{"type":"message_stop"}\n\n')
    status, _, bad = ask("messages: no max_tokens", "POST", f"{base}/v1/messages", {"model": "m",
                                                                                  "messages": CHAT["messages"]})
    assert status == 400 and bad["type"] == "error" and bad["error"]["type"] == "invalid_request_error"
    assert ask("messages: no such session", "POST", "/sessions/nope/v1/messages", MESSAGES)[0] == 404
    status, _, over = ask("messages: over the bytes in flight", "POST", f"{base}/v1/messages", huge)
    assert status == 413 and over["error"]["type"] == "request_too_large"
    status, _, records = ask("get", "GET", base)
    assert status == 200 and len(records["records"]) == 4
    assert ask("get with images", "GET", f"{base}?images=1")[0] == 200
    assert ask("get: no such session", "GET", "/sessions/nope")[0] == 404
    status, _, samples = ask("samples", "POST", f"{base}/samples", {})
    assert status == 200, samples
    assert ask("samples: bad json", "POST", f"{base}/samples", b"[")[0] == 400
    assert ask("samples with images", "POST", f"{base}/samples?images=1", {})[0] == 200
    assert ask("proxy: models", "GET", f"{base}/v1/models")[0] == 200
    assert ask("proxy: no such session", "GET", "/sessions/nope/v1/models")[0] == 404
    status, headers, _ = ask("wrong method", "PUT", "/sessions")
    assert status == 405 and "POST" in headers.get("Allow", "")
    status, _, miss = ask("no route", "GET", "/no/such/route")
    assert status == 404 and "is not a route" in miss["error"]
    status, _, miss = ask("no route, OpenAI path", "POST", "/v1/chat/completions", CHAT)
    assert status == 404 and isinstance(miss["error"], dict)
    assert ask("viewer: sessions", "GET", "/ui/api/sessions")[0] == 200
    assert ask("viewer: summary", "GET", f"/ui/api/sessions/{sid}")[0] == 200
    assert ask("viewer: timeline", "GET", f"/ui/api/sessions/{sid}/timeline")[0] == 200
    if auth:
        for what, method, path in (("create", "POST", "/sessions"), ("chat", "POST", f"{base}/v1/chat/completions"),
                                   ("messages", "POST", f"{base}/v1/messages"),
                                   ("get", "GET", base), ("samples", "POST", f"{base}/samples"),
                                   ("proxy", "GET", f"{base}/v1/models"), ("delete", "DELETE", base),
                                   ("viewer", "GET", "/ui/api/sessions")):
            status, headers, _ = ask(f"{what}: no key", method, path, CHAT, headers={"Content-Type": "application/json"})
            assert status == 401, (what, status)
            wrong = {"Content-Type": "application/json", "Authorization": "Bearer wrong-key-0123456789"}
            assert ask(f"{what}: wrong key", method, path, CHAT, headers=wrong)[0] == 401
        status, _, open_health = ask("health: no key", "GET", "/health", headers={})
        assert status == 200 and "sessions" not in open_health
    status, headers, stale = ask("delete: stale If-Match", "DELETE", base, headers={**bearer, "If-Match": '"999"'})
    assert status == 412 and "nothing was deleted" in stale["error"]
    generation = headers["X-Miles-Session-Generation"]
    assert ask("get after a refused delete", "GET", base)[0] == 200
    status, headers, _ = ask("delete", "DELETE", base, headers={**bearer, "If-Match": f'"{generation}"'})
    assert status == 204 and headers["X-Miles-Session-Generation"] == generation
    assert ask("delete again", "DELETE", base)[0] == 410  # gone: its tombstone
    assert ask("get after delete", "GET", base)[0] == 410
    return seen


def _placeholders(value: Any, names: dict[str, str]) -> Any:
    """``value`` with every per-server string replaced by its placeholder."""
    if isinstance(value, dict):
        return {k: _placeholders(v, names) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_placeholders(v, names) for v in value]
    if isinstance(value, (str, bytes)):
        text = value if isinstance(value, str) else value.decode("utf-8", "replace")
        for real, placeholder in names.items():
            text = text.replace(real, placeholder)
        text = re.sub(r"\b\d{10}(\.\d+)?\b", "<time>", text)  # timestamps in a page or a record
        return text if isinstance(value, str) else text.encode()
    return value


def _volatile(answers: list[tuple[str, Answer]], url: str) -> dict[str, str]:
    """This server's own values: the session it minted and its data directory's id."""
    created = dict(answers)["create"][2]["session_id"]
    instance_id = dict(answers)["health"][2]["session_server_instance_id"]
    return {created: "<session>", instance_id: "<instance-id>", url: "<url>", urlsplit(url).netloc: "<netloc>"}


def _without_times(value: Any) -> Any:
    """Records and completions carry wall-clock times and completion ids by design."""
    if isinstance(value, dict):
        return {k: ("<volatile>" if k in {"created", "id", "request_timestamp", "response_timestamp", "timestamp",
                                          "created_at", "updated_at", "last_active", "latency"} else _without_times(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_times(v) for v in value]
    if isinstance(value, float) and 1.5e9 < value < 2.5e9:  # an epoch time (lifecycle stamps)
        return "<time>"
    return value


def _first_difference(a: Any, b: Any, where: str = "answer") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{where}[{key!r}]")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{where}[{i}]")
    return f"{where}: --workers 0 {a!r:.300}, --workers 2 {b!r:.300}"


@pytest.mark.parametrize("auth", [False, True], ids=["open", "api-key"])
def test_both_modes_answer_every_route_the_same(servers, auth):
    single, multi = servers[(0, auth)], servers[(2, auth)]
    one, two = _scenario(single, auth), _scenario(multi, auth)
    assert [what for what, _ in one] == [what for what, _ in two]
    one_names, two_names = _volatile(one, single), _volatile(two, multi)
    for (what, a), (_, b) in zip(one, two, strict=True):
        a_norm = _without_times(_placeholders(a, one_names))
        b_norm = _without_times(_placeholders(b, two_names))
        assert a_norm == b_norm, f"{what}: the modes differ at {_first_difference(a_norm, b_norm)}"


def test_the_scenario_covers_every_route_of_the_table():
    """A route added to the table without a parity case fails here."""
    covered = {("POST", "/sessions"), ("GET", "/sessions/<session_id>"), ("DELETE", "/sessions/<session_id>"),
               ("POST", "/sessions/<session_id>/v1/chat/completions"), ("POST", "/sessions/<session_id>/v1/messages"),
               ("POST", "/sessions/<session_id>/samples"),
               ("GET", "/sessions/<session_id>/<path:path>"), ("GET", "/health")}
    declared = {(route.methods[0], route.path) for route in ROUTES}
    assert declared == covered
