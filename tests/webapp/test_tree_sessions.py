"""Tree sessions (miles' v2, ``--session-mode v2``), black-box over HTTP on real servers.

The rules are miles' (``miles/rollout/session/v2/{session_state,tree_trajectory}.py`` and
``tests/fast/router/test_sessions_v2.py`` at 31f1ca96): a request attaches at the deepest node
whose path of messages prefixes it (ties: the latest), else it is a new root; its unmatched
suffix and the reply are the new node's delta; its prompt ids are the attach node's ids plus the
append of the suffix; GET serves the active path (root -> last committed node) with
``metadata.tree``. Expected token ids are computed here from the tokenizer and the reference
backend's pure reply function, not read back from the server.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest
import requests

from webapp.journal import FILE_HEADER, FORMAT_VERSION, MAGIC, TREE_FORMAT_VERSION
from webapp.reference_backend import reference_completion
from webapp.tokenizers import load_tokenizer
from webapp.tree import MAX_NODES

U1 = {"role": "user", "content": "What is 1+2?"}
T1 = {"role": "tool", "content": "tool-result-1", "tool_call_id": "t0"}
T1_DIFF = {"role": "tool", "content": "tool-result-DIFFERENT", "tool_call_id": "t0"}
T2 = {"role": "tool", "content": "tool-result-2", "tool_call_id": "t1"}
TOKENIZER = load_tokenizer(None)  # the servers' (no --tokenizer): the byte tokenizer
RECOVERY_LIMIT = 60.0  # a worker restart on a loaded 2-core machine (a bound, not a target)


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "workers2"])
def server(request, session_server_factory, backend):
    return session_server_factory.launch(request.param, backend.url, "--session-mode", "v2")


def new_session(url: str) -> str:
    reply = requests.post(f"{url}/sessions", timeout=10)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["session_id"])


def post(url: str, sid: str, messages: list[dict[str, Any]], **fields: Any) -> requests.Response:
    return requests.post(f"{url}/sessions/{sid}/v1/chat/completions", json={"messages": messages, **fields},
                         timeout=60)


def turn(url: str, sid: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    reply = post(url, sid, messages, **fields)
    assert reply.status_code == 200, reply.text
    message: dict[str, Any] = reply.json()["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


def get(url: str, sid: str) -> dict[str, Any]:
    reply = requests.get(f"{url}/sessions/{sid}", timeout=10)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def shape(body: dict[str, Any]) -> tuple[list[int | None], list[list[int]]]:
    """(each node's parent, each leaf's path) of ``metadata.tree``."""
    tree = body["metadata"]["tree"]
    assert [n["id"] for n in tree["nodes"]] == list(range(len(tree["nodes"])))
    return [n["parent"] for n in tree["nodes"]], [leaf["path_node_ids"] for leaf in tree["leaves"]]


def canonical_prompt(messages: list[dict[str, Any]]) -> list[int]:
    return TOKENIZER.encode(TOKENIZER.render(messages, add_generation_prompt=True))


def expected_ids(prompt_ids: list[int]) -> list[int]:
    """prompt + the reference backend's output ids for it."""
    reply = reference_completion(prompt_ids, TOKENIZER)
    return prompt_ids + [tid for _lp, tid in reply["choices"][0]["meta_info"]["output_token_logprobs"]]


def check_path(body: dict[str, Any], requests_sent: list[list[dict[str, Any]]]) -> None:
    """The GET serves exactly the active path: one record per request sent along it, each
    prompt the canonical render extending its parent's ids, the accumulated ids the last one's."""
    records = body["records"]
    assert [r["request"]["messages"] for r in records] == requests_sent
    parent_ids: list[int] = []
    for record, messages in zip(records, requests_sent):
        prompt = record["request"]["input_ids"]
        assert prompt == canonical_prompt(messages)
        assert prompt[:len(parent_ids)] == parent_ids  # the attach node's ids, never re-rendered
        assert "rollback" not in record  # miles' v2 SessionRecord has none
        parent_ids = expected_ids(prompt)
    assert body["metadata"]["accumulated_token_ids"] == parent_ids
    assert body["metadata"]["tito_session_mismatch"] == []
    assert body["metadata"]["num_records"] == len(records)


def two_turns(url: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    sid = new_session(url)
    a1 = turn(url, sid, [U1])
    a2 = turn(url, sid, [U1, a1, T1])
    return sid, a1, a2


def test_a_line_grows_one_path(server):
    sid, a1, _a2 = two_turns(server.url)
    body = get(server.url, sid)
    assert shape(body) == ([None, 0], [[0, 1]])
    check_path(body, [[U1], [U1, a1, T1]])
    nodes = body["metadata"]["tree"]["nodes"]
    assert [n["num_tokens"] for n in nodes] == [len(expected_ids(canonical_prompt([U1]))),
                                                len(body["metadata"]["accumulated_token_ids"])]
    assert [n["truncated"] for n in nodes] == [False, False]


def test_pure_retry_is_a_sibling_and_get_follows_the_latest(server):
    sid, a1, _a2 = two_turns(server.url)
    turn(server.url, sid, [U1, a1, T1])  # the same request again
    body = get(server.url, sid)
    assert shape(body) == ([None, 0, 0], [[0, 1], [0, 2]])
    check_path(body, [[U1], [U1, a1, T1]])
    # Both siblings carry the same (deterministic) ids; the GET serves node 2's record.
    tree = body["metadata"]["tree"]["nodes"]
    assert tree[1]["num_tokens"] == tree[2]["num_tokens"]


def test_divergent_retry_branches_at_the_shared_node(server):
    sid, a1, _a2 = two_turns(server.url)
    turn(server.url, sid, [U1, a1, T1_DIFF])
    body = get(server.url, sid)
    assert shape(body) == ([None, 0, 0], [[0, 1], [0, 2]])
    check_path(body, [[U1], [U1, a1, T1_DIFF]])


def test_deep_divergence_keeps_both_lines(server):
    sid, a1, a2 = two_turns(server.url)
    a3 = turn(server.url, sid, [U1, a1, T1, a2, T2])
    assert shape(get(server.url, sid)) == ([None, 0, 1], [[0, 1, 2]])
    turn(server.url, sid, [U1, a1, T1_DIFF])
    body = get(server.url, sid)
    assert shape(body) == ([None, 0, 1, 0], [[0, 1, 2], [0, 3]])
    check_path(body, [[U1], [U1, a1, T1_DIFF]])
    # Going back down the first line extends node 2 (the deepest match), not a new branch.
    turn(server.url, sid, [U1, a1, T1, a2, T2, a3, T1])
    body = get(server.url, sid)
    assert shape(body) == ([None, 0, 1, 0, 2], [[0, 3], [0, 1, 2, 4]])
    check_path(body, [[U1], [U1, a1, T1], [U1, a1, T1, a2, T2], [U1, a1, T1, a2, T2, a3, T1]])


def test_a_different_opening_is_a_new_root(server):
    sid = new_session(server.url)
    turn(server.url, sid, [U1])
    opening = {"role": "user", "content": "a different opening"}
    turn(server.url, sid, [opening])
    body = get(server.url, sid)
    assert shape(body) == ([None, None], [[0], [1]])
    check_path(body, [[opening]])


def test_few_shot_first_turn_assistants_are_prompt(server):
    few_shot = [{"role": "user", "content": "Q-few-shot"}, {"role": "assistant", "content": "A-few-shot"},
                {"role": "user", "content": "Q-real"}]
    sid = new_session(server.url)
    a1 = turn(server.url, sid, few_shot)
    turn(server.url, sid, [*few_shot, a1, T1])
    turn(server.url, sid, [*few_shot, a1, T1_DIFF])
    body = get(server.url, sid)
    assert shape(body) == ([None, 0, 0], [[0, 1], [0, 2]])
    check_path(body, [few_shot, [*few_shot, a1, T1_DIFF]])


def test_compaction_with_a_carried_assistant_is_a_child(server):
    sid = new_session(server.url)
    a1 = turn(server.url, sid, [U1])
    carried = {"role": "assistant", "content": "compacted summary of earlier work"}
    go = {"role": "tool", "content": "go", "tool_call_id": "t1"}
    turn(server.url, sid, [U1, a1, T1, carried, go])
    body = get(server.url, sid)
    assert shape(body) == ([None, 0], [[0, 1]])
    check_path(body, [[U1], [U1, a1, T1, carried, go]])


def test_extending_a_truncated_node_is_409_and_records_nothing(server, backend):
    sid = new_session(server.url)
    reply = post(server.url, sid, [U1], max_tokens=3)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
    a1 = {k: v for k, v in reply.json()["choices"][0]["message"].items() if v is not None}
    before = requests.get(f"{server.url}/sessions/{sid}", timeout=10).content
    refused = post(server.url, sid, [U1, a1, T1])
    assert refused.status_code == 409
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "finish_reason 'length'" in refused.json()["error"]["message"]
    assert requests.get(f"{server.url}/sessions/{sid}", timeout=10).content == before
    body = json.loads(before)
    assert body["metadata"]["tree"]["nodes"][0]["truncated"] is True
    # Branching before the cut still works: a retry of the first turn is a new root.
    turn(server.url, sid, [U1])
    assert shape(get(server.url, sid)) == ([None, None], [[0], [1]])


def test_a_full_tree_refuses_the_next_node_with_409(server):
    sid = new_session(server.url)
    opening = [{"role": "user", "content": "x"}]
    with requests.Session() as http:  # retries of one opening: 1,024 roots, over one connection
        statuses = [http.post(f"{server.url}/sessions/{sid}/v1/chat/completions", timeout=60,
                              json={"messages": opening, "max_tokens": 1}).status_code for _ in range(MAX_NODES)]
    assert statuses == [200] * MAX_NODES
    body = get(server.url, sid)
    parents, leaves = shape(body)
    assert parents == [None] * MAX_NODES and len(leaves) == MAX_NODES
    refused = post(server.url, sid, opening)
    assert refused.status_code == 409 and "maximum of 1024 nodes" in refused.json()["error"]["message"]
    assert len(get(server.url, sid)["metadata"]["tree"]["nodes"]) == MAX_NODES


def test_two_in_flight_from_one_spot_become_siblings(session_server_factory, stub_backend_factory, backend):
    """Both generations are at the engine at once (the stub answers neither until both came)."""
    import threading

    arrived = threading.Barrier(2, timeout=20)

    def handler(request: dict[str, Any]) -> tuple[int, bytes]:
        if len(request["input_ids"]) > len(canonical_prompt([U1])):
            arrived.wait()  # the second turn's pair: both in flight before either answers
        reply = reference_completion(request["input_ids"], TOKENIZER)
        return 200, json.dumps(reply).encode()

    for workers in (0, 2):
        server = session_server_factory.launch(workers, stub_backend_factory(handler), "--session-mode", "v2")
        sid = new_session(server.url)
        a1 = turn(server.url, sid, [U1])
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(post, server.url, sid, m) for m in ([U1, a1, T1], [U1, a1, T1_DIFF])]
            replies = [f.result() for f in futures]
        assert [r.status_code for r in replies] == [200, 200]
        body = get(server.url, sid)
        assert shape(body)[0] == [None, 0, 0]
        ids = {n["response_id"] for n in body["metadata"]["tree"]["nodes"][1:]}
        assert ids == {r.json()["id"] for r in replies}
        arrived.reset()
        server.close()


def _worker(server) -> psutil.Process:
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "shinken-session-worker[" in " ".join(proc.cmdline()):
                return proc
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no session worker")


def _build_tree(url: str) -> tuple[str, bytes]:
    sid, a1, a2 = two_turns(url)
    turn(url, sid, [U1, a1, T1, a2, T2])
    turn(url, sid, [U1, a1, T1_DIFF])
    turn(url, sid, [{"role": "user", "content": "another root"}])
    turn(url, sid, [U1, a1, T1_DIFF])  # the active leaf is node 5 (a sibling of 3), not the last root
    return sid, requests.get(f"{url}/sessions/{sid}", timeout=10).content


def _wait_get(url: str, sid: str) -> bytes:
    deadline = time.monotonic() + RECOVERY_LIMIT
    while True:
        try:
            reply = requests.get(f"{url}/sessions/{sid}", timeout=10)
            if reply.status_code == 200:
                return reply.content
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "the session did not come back"
        time.sleep(0.2)


def test_a_killed_worker_restores_the_tree(session_server_factory, backend):
    server = session_server_factory.launch(1, backend.url, "--session-mode", "v2")
    sid, before = _build_tree(server.url)
    assert shape(json.loads(before)) == ([None, 0, 1, 0, None, 0], [[0, 1, 2], [0, 3], [4], [0, 5]])
    worker = _worker(server)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    assert _wait_get(server.url, sid) == before
    assert _worker(server).pid != worker.pid
    # And it goes on from the restored active leaf and forest.
    body = json.loads(before)
    a3 = body["records"][-1]["response"]["choices"][0]["message"]
    turn(server.url, sid, [*body["records"][-1]["request"]["messages"], {k: v for k, v in a3.items() if v},
                           T2])
    assert shape(get(server.url, sid))[0] == [None, 0, 1, 0, None, 0, 5]


def test_a_server_restart_restores_the_tree_and_keeps_each_sessions_mode(session_server_factory, backend,
                                                                         tmp_path):
    env = {"SHINKEN_DATA_DIR": str(tmp_path)}
    first = session_server_factory.launch(2, backend.url, "--session-mode", "v2", env=env)
    sid, before = _build_tree(first.url)
    first.close()
    # Restarted as a v1 server: the tree session stays a tree; new sessions are lines.
    second = session_server_factory.launch(0, backend.url, env=env)
    assert _wait_get(second.url, sid) == before
    line = new_session(second.url)
    a1 = turn(second.url, line, [U1])
    turn(second.url, line, [U1, a1, T1])
    turn(second.url, line, [U1, a1, T1_DIFF])  # a v1 rollback, not a branch
    body = get(second.url, line)
    assert "tree" not in body["metadata"] and body["metadata"]["num_rollbacks"] == 1
    # A tree's file has its own version: a server that knows no trees refuses it, never misreads it.
    versions = {s: FILE_HEADER.unpack((tmp_path / "sessions" / f"{s}.journal").read_bytes()[:FILE_HEADER.size])
                for s in (sid, line)}
    assert versions == {sid: (MAGIC, TREE_FORMAT_VERSION), line: (MAGIC, FORMAT_VERSION)}
    second.close()
    # And a v2 server serves that line as a line.
    third = session_server_factory.launch(2, backend.url, "--session-mode", "v2", env=env)
    line_body = json.loads(_wait_get(third.url, line))
    assert line_body == body and [r["rollback"] for r in line_body["records"]] == [False, True]
    assert _wait_get(third.url, sid) == before


def test_a_linear_tree_get_is_a_line_get_but_for_miles_v2_fields(session_server_factory, backend):
    v1 = session_server_factory.launch(0, backend.url)
    v2 = session_server_factory.launch(0, backend.url, "--session-mode", "v2")
    bodies = []
    for server in (v1, v2):
        sid = new_session(server.url)
        a1 = turn(server.url, sid, [U1])
        a2 = turn(server.url, sid, [U1, a1, T1])
        turn(server.url, sid, [U1, a1, T1, a2, T2])
        bodies.append(get(server.url, sid))
    line, tree = bodies
    assert "tree" not in line["metadata"]
    assert [r.pop("rollback") for r in line["records"]] == [False, False, False]
    for body in bodies:
        for record in body["records"]:
            for key in ("timestamp", "request_timestamp"):
                record.pop(key)
            record["response"].pop("created", None)
            record["response"].pop("id", None)
        body["metadata"].pop("created_at")
        body.pop("session_id")
    assert shape(tree) == ([None, 0, 1], [[0, 1, 2]])
    tree["metadata"].pop("tree")
    assert line["metadata"].pop("num_rollbacks") == 0
    assert line == tree


def test_v1_stays_the_default(session_server_factory, backend):
    server = session_server_factory.launch(0, backend.url)
    sid, a1, _a2 = two_turns(server.url)
    turn(server.url, sid, [U1, a1, T1_DIFF])
    body = get(server.url, sid)
    assert "tree" not in body["metadata"]
    assert [r["rollback"] for r in body["records"]] == [False, True]
    assert post(server.url, sid, [{"role": "user", "content": "a different opening"}]).status_code == 400


def test_refusals_never_reach_the_engine(session_server_factory, stub_backend_factory):
    """A truncated attach node (409) and a suffix that adds nothing (400) are refused before the
    engine is called: the engine sees only the turns that were committed."""
    seen: list[list[int]] = []

    def handler(request: dict[str, Any]) -> tuple[int, bytes]:
        seen.append(request["input_ids"])
        reply = reference_completion(request["input_ids"], TOKENIZER, max_tokens=request.get("max_tokens"))
        return 200, json.dumps(reply).encode()

    server = session_server_factory.launch(0, stub_backend_factory(handler), "--session-mode", "v2")
    sid = new_session(server.url)
    a1 = turn(server.url, sid, [U1])
    assert post(server.url, sid, [U1, a1]).status_code == 400  # the path itself: no new message
    cut = post(server.url, sid, [U1, a1, T1], max_tokens=2)
    assert cut.status_code == 200 and cut.json()["choices"][0]["finish_reason"] == "length"
    a2 = {k: v for k, v in cut.json()["choices"][0]["message"].items() if v is not None}
    assert post(server.url, sid, [U1, a1, T1, a2, T2]).status_code == 409
    assert len(seen) == 2
    body = get(server.url, sid)
    assert shape(body) == ([None, 0], [[0, 1]])
    assert [n["truncated"] for n in body["metadata"]["tree"]["nodes"]] == [False, True]
    assert body["records"][-1]["request"]["input_ids"] == seen[-1]
