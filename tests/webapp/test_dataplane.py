"""The data plane end to end under real gunicorn: parity of workers=1 and workers=3, routing
spread, streamed records bodies, and (opt-in) a records body over 4 GiB."""

from __future__ import annotations

import json
import os
import re
import urllib.request

import psutil
import pytest
import requests

from webapp.sharding import shard_for

pytestmark = pytest.mark.integration

VOLATILE = {"id", "created", "created_at", "session_id", "timestamp", "request_timestamp",
            "session_server_instance_id"}
SESSION_ID = re.compile(r"\b[0-9a-f]{32}\b")
MALFORMED_MARKER = "please-answer-malformed"


def _normalize(value):
    if isinstance(value, dict):
        return {k: "<volatile>" if k in VOLATILE else _normalize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    if isinstance(value, str):  # error messages name the (random) session id
        return SESSION_ID.sub("<session id>", value)
    return value


def _normalize_body(content_type: str, body: bytes):
    if content_type.startswith("text/event-stream"):
        events = [e for e in body.decode().split("\n\n") if e]
        return [e if e == "data: [DONE]" else _normalize(json.loads(e.removeprefix("data: "))) for e in events]
    if content_type.startswith("application/json"):
        return _normalize(json.loads(body))
    return body


def client_script(base: str) -> list[dict]:
    """One fixed sequence of calls; returns what a client observes of each answer."""
    http = requests.Session()
    seen: list[dict] = []

    def record(label: str, resp: requests.Response) -> requests.Response:
        ctype = resp.headers.get("Content-Type", "")
        seen.append({
            "label": label, "status": resp.status_code, "content_type": ctype,
            "content_length": resp.headers.get("Content-Length"), "length": len(resp.content),
            "body": _normalize_body(ctype, resp.content),
        })
        return resp

    def chat(sid: str, body) -> requests.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return http.post(f"{base}/sessions/{sid}/v1/chat/completions", data=data,
                         headers={"Content-Type": "application/json"}, timeout=60)

    sids = [record(f"create {i}", http.post(f"{base}/sessions", timeout=30)).json()["session_id"]
            for i in range(6)]
    for i, sid in enumerate(sids):
        messages = [{"role": "user", "content": f"task {i}: " + "open the settings panel " * (60 + 40 * i)}]
        first = record(f"chat {i}.1", chat(sid, {"messages": messages, "max_tokens": 64})).json()
        messages += [first["choices"][0]["message"], {"role": "user", "content": "now press save"}]
        record(f"chat {i}.2", chat(sid, {"messages": messages, "stream": i % 2 == 1,
                                         "stream_options": {"include_usage": True}}))
    for i, sid in enumerate(sids):
        record(f"records {i}", http.get(f"{base}/sessions/{sid}", timeout=60))
    record("invalid json", chat(sids[0], b"{not json"))
    fresh = record("create fresh", http.post(f"{base}/sessions", timeout=30)).json()["session_id"]
    record("backend malformed", chat(fresh, {"messages": [{"role": "user", "content": MALFORMED_MARKER}]}))
    record("chat unknown session", chat("f" * 32, {"messages": [{"role": "user", "content": "x"}]}))
    record("get unknown session", http.get(f"{base}/sessions/{'e' * 32}", timeout=30))
    record("delete", http.delete(f"{base}/sessions/{sids[2]}", timeout=30))
    record("delete again", http.delete(f"{base}/sessions/{sids[2]}", timeout=30))
    record("get deleted", http.get(f"{base}/sessions/{sids[2]}", timeout=30))
    record("health", http.get(f"{base}/health", timeout=30))
    seen.append({"label": "session ids", "ids": sids})
    return seen


@pytest.fixture(scope="module")
def backend_url(reference_backend_factory, stub_backend_factory) -> str:
    """The reference backend (with R3, so records exceed one IPC chunk), behind a stub that
    answers a marked request with a malformed 200 (-> 502 from the core)."""
    reference = reference_backend_factory(r3_layers=16, r3_topk=8)

    def handler(request: dict):
        if MALFORMED_MARKER in json.dumps(request.get("messages", "")):
            return 200, b"this is not the backend contract"
        req = urllib.request.Request(f"{reference.url}/v1/chat/completions", data=json.dumps(request).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()

    return stub_backend_factory(handler)


def test_parity_workers_1_and_3(session_server_factory, backend_url) -> None:
    r3 = ("--routing-replay-layers", "16")
    one = session_server_factory.launch(1, backend_url, *r3)
    three = session_server_factory.launch(3, backend_url, *r3)
    got_one, got_three = client_script(one.url), client_script(three.url)
    ids_three = got_three.pop()["ids"]
    got_one.pop()
    assert [e["label"] for e in got_one] == [e["label"] for e in got_three]
    for a, b in zip(got_one, got_three):
        assert (a["label"], a["status"], a["content_type"]) == (b["label"], b["status"], b["content_type"])
        assert a["body"] == b["body"], a["label"]
        for entry in (a, b):
            if entry["content_length"] is not None:
                assert int(entry["content_length"]) == entry["length"], entry["label"]
        if not a["label"].startswith("records"):  # records carry float timestamps of varying width
            assert a["length"] == b["length"], a["label"]
    by_label = {e["label"]: e for e in got_three}
    assert by_label["delete"]["status"] == 204 and by_label["delete"]["length"] == 0
    assert by_label["delete"]["content_type"] == ""
    assert by_label["backend malformed"]["status"] == 502
    assert by_label["delete again"]["status"] == 410 and by_label["get deleted"]["status"] == 410
    assert by_label["chat 1.2"]["content_type"].startswith("text/event-stream")
    # records bodies big enough to cross as streamed chunks, and intact
    big = [e for e in got_three if e["label"].startswith("records") and e["length"] > 1024 * 1024]
    assert big and all(len(e["body"]["records"]) == 2 for e in big)
    # the router spread the sessions over several workers (each refuses a session it does not own);
    # six uuid4 ids all land on one of three shards once in 243 runs: then add sessions until not
    shards = {shard_for(sid, 3) for sid in ids_three}
    for _ in range(50):
        if len(shards) >= 2:
            break
        sid = requests.post(f"{three.url}/sessions", timeout=30).json()["session_id"]
        chat = requests.post(f"{three.url}/sessions/{sid}/v1/chat/completions", timeout=60,
                             json={"messages": [{"role": "user", "content": "spread"}]})
        assert chat.status_code == 200, chat.text[:300]
        shards.add(shard_for(sid, 3))
    assert len(shards) >= 2


@pytest.mark.skipif(os.environ.get("SHINKEN_SKIP_HUGE_RECORDS") == "1",
                    reason="SHINKEN_SKIP_HUGE_RECORDS=1: the >4 GiB records test builds a session in ~1 min")
@pytest.mark.timeout(600)
def test_records_body_over_4gib_crosses(reference_backend_factory, session_server_factory) -> None:
    # Runs wherever the memory is there (CI's machines have 24 GiB); the u64 length path is also
    # covered without allocation in test_ipc, for machines where this one skips.
    if psutil.virtual_memory().available < 14 * 1024**3:
        pytest.skip("needs ~14 GiB of free memory (worker records + backend reply + client)")
    layers, topk = 64, 8
    reference = reference_backend_factory(r3_layers=layers, r3_topk=topk)
    server = session_server_factory.launch(2, reference.url, "--read-timeout", "300",
                                           "--routing-replay-layers", str(layers))
    http = requests.Session()
    sid = http.post(f"{server.url}/sessions", timeout=30).json()["session_id"]
    # Byte tokenizer: ~1 token per byte. Each turn's record holds the backend's R3 for the whole
    # prompt (base64 of tokens x layers x top_k int32), so records grow quadratically with turns.
    messages: list[dict] = []
    expected = 0
    while expected <= 4 * 1024**3 + 64 * 1024**2:
        messages.append({"role": "user", "content": f"turn {len(messages)} " + "x" * 100_000})
        resp = http.post(f"{server.url}/sessions/{sid}/v1/chat/completions",
                         json={"messages": messages, "max_tokens": 4}, timeout=300)
        assert resp.status_code == 200, resp.text[:500]
        usage = resp.json()["usage"]
        expected += (usage["prompt_tokens"] + usage["completion_tokens"] - 1) * layers * topk * 4 * 4 // 3
        messages.append(resp.json()["choices"][0]["message"])
    with http.get(f"{server.url}/sessions/{sid}", stream=True, timeout=300) as resp:
        assert resp.status_code == 200
        length = int(resp.headers["Content-Length"])
        received = 0
        tail = b""
        for chunk in resp.iter_content(8 * 1024 * 1024):
            received += len(chunk)
            tail = (tail + chunk)[-4096:]
    assert length > 4 * 1024**3 and received == length
    assert tail.endswith(b"}") and b'"num_records"' in tail


def test_workers_0_serves_the_single_process_app(reference_backend_factory, session_server_factory) -> None:
    backend = reference_backend_factory()
    server = session_server_factory.launch(0, backend.url)
    sid = requests.post(f"{server.url}/sessions", timeout=10).json()["session_id"]
    chat = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "shinken-session-worker" in " ".join(p.cmdline())]
    assert workers == []  # no session worker processes in this mode


def test_workers_0_honours_the_read_timeout(stub_backend_factory, session_server_factory) -> None:
    silent = stub_backend_factory(lambda request: None)  # never answers
    server = session_server_factory.launch(0, silent, "--read-timeout", "0.3")
    sid = requests.post(f"{server.url}/sessions", timeout=10).json()["session_id"]
    chat = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", timeout=20,
                         json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 502 and "timed out" in chat.json()["error"]["message"]
