"""The session lifecycle over HTTP, in both server modes (``--workers 0`` and the router over
workers) and both session modes (``--session-mode v1`` lines, ``v2`` trees):

- a deleted or expired session answers 410 Gone (``session_gone``, miles' "session reclaimed"
  text) while its tombstone lasts; an id never seen stays 404; tombstones expire after
  ``--tombstone-ttl``, are bounded by ``--max-tombstones`` per worker (oldest dropped) and
  survive a SIGKILLed worker and a restarted server (even with another ``--workers``);
- a turn whose ``chat_template_kwargs`` differ from the session's first turn's is refused 400
  (``render_settings_changed``), also after a restart: nothing sent to the engine or recorded;
- a client's ``input_ids`` is refused 400: nothing sent to the engine or recorded;
- ``X-Miles-Session-Generation`` counts the committed turns (rollbacks and tree branches
  included) on GET, DELETE, samples, chat and messages replies;
- ``DELETE`` with ``If-Match`` deletes only the session at that generation, else 412
  (``GenerationMismatch``) and nothing deleted.

The engine is an in-process stub that answers as the reference backend and counts its calls.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.webapp.test_supervisor import worker_procs
from webapp.reference_backend import reference_completion_json
from webapp.sharding import shard_for
from webapp.tokenizers import load_tokenizer

TOKENIZER = load_tokenizer(None)  # the servers' (no --tokenizer): the byte tokenizer
GEN = "X-Miles-Session-Generation"
SERVER_MODES = {"single-process": 0, "router": 2}
RESTART_LIMIT = 60.0  # a worker's respawn on a loaded 2-core machine (a bound, not a target)
U1 = {"role": "user", "content": "open the settings page"}
U2 = {"role": "user", "content": "now click save"}
U2_OTHER = {"role": "user", "content": "now click cancel"}


class Engine:
    """The stub engine: the reference backend's replies, every request body kept."""

    def __init__(self, factory: Callable[..., str]) -> None:
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.url = factory(self._answer)

    def _answer(self, request: dict[str, Any]) -> tuple[int, bytes]:
        with self._lock:
            self.requests.append(request)
        return 200, reference_completion_json(request["input_ids"], TOKENIZER, max_tokens=request.get("max_tokens"))

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self.requests)


@pytest.fixture(scope="module")
def engine(stub_backend_factory) -> Engine:
    return Engine(stub_backend_factory)


def launch(factory: Any, engine: Engine, workers: int, *flags: str) -> Any:
    return factory.launch(workers, engine.url, "--backend-kind", "sglang", *flags)


@pytest.fixture(scope="module")
def servers(session_server_factory, engine) -> Iterator[Callable[[str, str], str]]:
    """(server mode, session mode) -> the base URL of a server, started on first use."""
    started: dict[tuple[str, str], str] = {}

    def get(mode: str, session_mode: str) -> str:
        if (mode, session_mode) not in started:
            server = launch(session_server_factory, engine, SERVER_MODES[mode], "--session-mode", session_mode)
            started[(mode, session_mode)] = server.url
        return started[(mode, session_mode)]

    yield get


def create(base: str) -> str:
    resp = requests.post(f"{base}/sessions", timeout=30)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["session_id"])


def chat(base: str, sid: str, messages: list[dict[str, Any]], **fields: Any) -> requests.Response:
    return requests.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=60,
                         json={"messages": messages, **fields})


def turn(base: str, sid: str, messages: list[dict[str, Any]], **fields: Any) -> tuple[dict[str, Any], int]:
    """(the assistant message, the reply's generation header)."""
    resp = chat(base, sid, messages, **fields)
    assert resp.status_code == 200, resp.text
    message = {k: v for k, v in resp.json()["choices"][0]["message"].items() if v is not None}
    return message, int(resp.headers[GEN])


def get(base: str, sid: str) -> requests.Response:
    return requests.get(f"{base}/sessions/{sid}", timeout=30)


def delete(base: str, sid: str, **headers: str) -> requests.Response:
    return requests.delete(f"{base}/sessions/{sid}", headers=headers, timeout=30)


def num_records(base: str, sid: str) -> int:
    resp = get(base, sid)
    assert resp.status_code == 200, resp.text
    return len(resp.json()["records"])


def assert_gone(resp: requests.Response, sid: str, openai: bool = False) -> None:
    assert resp.status_code == 410, (resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    if openai:
        assert error["code"] == "session_gone" and error["type"] == "not_found_error"
        error = error["message"]
    assert error.startswith(f"session reclaimed: session_id={sid} ("), error


def assert_unknown(resp: requests.Response, sid: str) -> None:
    assert resp.status_code == 404, (resp.status_code, resp.text[:300])
    assert resp.json()["error"] == f"session not found: session_id={sid}"


def sessions_on_shard(base: str, shard: int, shards: int, n: int) -> list[str]:
    """``n`` fresh sessions owned by ``shard`` (the others are deleted again)."""
    mine: list[str] = []
    while len(mine) < n:
        sid = create(base)
        if shard_for(sid, shards) == shard:
            mine.append(sid)
        else:
            assert delete(base, sid).status_code == 204
    return mine


def wait_until(check: Callable[[], bool], limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {limit} s")
        time.sleep(0.1)


# -- 410 Gone ----------------------------------------------------------------------------------

@pytest.mark.parametrize("session_mode", ["v1", "v2"])
@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_every_route_answers_410_after_delete_and_404_for_an_id_never_seen(servers, mode, session_mode) -> None:
    base = servers(mode, session_mode)
    sid = create(base)
    turn(base, sid, [U1])
    assert delete(base, sid).status_code == 204
    assert_gone(get(base, sid), sid)
    assert_gone(delete(base, sid), sid)
    assert_gone(requests.post(f"{base}/sessions/{sid}/samples", json={}, timeout=30), sid)
    assert_gone(chat(base, sid, [U1]), sid, openai=True)
    assert_gone(requests.get(f"{base}/sessions/{sid}/v1/models", timeout=30), sid, openai=True)
    messages = requests.post(f"{base}/sessions/{sid}/v1/messages", timeout=30,
                             json={"model": "m", "max_tokens": 8, "messages": [U1]})
    assert messages.status_code == 410 and messages.json()["type"] == "error"
    assert messages.json()["error"]["message"].startswith(f"session reclaimed: session_id={sid} (")
    # the exact miles text after a DELETE
    assert get(base, sid).json()["error"] == (f"session reclaimed: session_id={sid} (the trainer released this "
                                              "session and is no longer waiting for the agent)")
    never = "0" * 32
    assert_unknown(get(base, never), never)
    assert_unknown(delete(base, never), never)
    unknown_chat = chat(base, never, [U1])
    assert unknown_chat.status_code == 404 and unknown_chat.json()["error"]["code"] == "session_not_found"


@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_an_expired_session_answers_410(mode, session_server_factory, engine) -> None:
    server = launch(session_server_factory, engine, SERVER_MODES[mode], "--session-idle-ttl", "1.0")
    idle, used = create(server.url), create(server.url)
    turn(server.url, idle, [U1])
    # every request sweeps (at most once a TTL); the idle session is asked only at the end,
    # since any request on it would count as use
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        assert get(server.url, used).status_code == 200
        time.sleep(0.2)
    resp = get(server.url, idle)
    assert_gone(resp, idle)
    assert "expired" in resp.json()["error"]
    assert_gone(chat(server.url, idle, [U1]), idle, openai=True)
    assert get(server.url, used).status_code == 200
    server.close()


@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_a_tombstone_lasts_the_tombstone_ttl_then_the_id_is_unknown(mode, session_server_factory, engine) -> None:
    server = launch(session_server_factory, engine, SERVER_MODES[mode], "--tombstone-ttl", "1.5")
    sid = create(server.url)
    assert delete(server.url, sid).status_code == 204
    assert_gone(get(server.url, sid), sid)
    time.sleep(2.0)
    assert_unknown(get(server.url, sid), sid)
    assert_unknown(delete(server.url, sid), sid)
    server.close()


@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_tombstones_are_bounded_per_worker_oldest_dropped_first(mode, session_server_factory, engine) -> None:
    workers = SERVER_MODES[mode]
    server = launch(session_server_factory, engine, workers, "--max-tombstones", "3")
    shards = max(workers, 1)
    sids = sessions_on_shard(server.url, 0, shards, 5)  # one worker's: the bound is per worker
    for sid in sids:
        assert delete(server.url, sid).status_code == 204
    for sid in sids[:2]:
        assert_unknown(get(server.url, sid), sid)
    for sid in sids[2:]:
        assert_gone(get(server.url, sid), sid)
    server.close()


# -- tombstones outlive processes -------------------------------------------------------------

@pytest.mark.timeout(180)
def test_tombstones_survive_a_sigkilled_worker(session_server_factory, engine, tmp_path) -> None:
    data = tmp_path / "data"
    server = launch(session_server_factory, engine, 2, "--data-dir", str(data))
    gone, kept = sessions_on_shard(server.url, 0, 2, 2)
    turn(server.url, gone, [U1])
    assert delete(server.url, gone).status_code == 204
    path = data / "tombstones" / "0-of-2"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the data directory's rule: prompts' neighbours
    assert [json.loads(line)["session_id"] for line in path.read_text().splitlines()][-1] == gone

    victim = worker_procs(server, 2)[0]
    victim.kill()
    victim.wait(10)

    def respawned() -> bool:
        proc = worker_procs(server, 2).get(0)
        return proc is not None and proc.pid != victim.pid and get(server.url, kept).status_code == 200

    wait_until(respawned, RESTART_LIMIT, "shard 0's worker was not respawned")
    assert_gone(get(server.url, gone), gone)
    assert_gone(chat(server.url, gone, [U1]), gone, openai=True)
    never = "1" * 32
    assert_unknown(get(server.url, never), never)
    server.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_tombstones_and_render_pins_survive_a_restart(mode, session_server_factory, engine, tmp_path) -> None:
    data = tmp_path / "data"
    workers = SERVER_MODES[mode]
    server = launch(session_server_factory, engine, workers, "--data-dir", str(data))
    gone, pinned = create(server.url), create(server.url)
    turn(server.url, gone, [U1])
    assert delete(server.url, gone).status_code == 204
    a1, _ = turn(server.url, pinned, [U1], chat_template_kwargs={"enable_thinking": False})
    server.close()

    # restarted with the other worker count: the tombstone files of the old layout are read too
    server = launch(session_server_factory, engine, 2 if workers == 0 else 0, "--data-dir", str(data))
    assert_gone(get(server.url, gone), gone)
    calls = engine.calls
    refused = chat(server.url, pinned, [U1, a1, U2], chat_template_kwargs={"enable_thinking": True})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "render_settings_changed"
    assert engine.calls == calls and num_records(server.url, pinned) == 1
    _, generation = turn(server.url, pinned, [U1, a1, U2], chat_template_kwargs={"enable_thinking": False})
    assert generation == 2
    server.close()


# -- render settings fixed per session -----------------------------------------------------------

@pytest.mark.parametrize("session_mode", ["v1", "v2"])
@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_chat_template_kwargs_are_fixed_by_the_first_turn(servers, engine, mode, session_mode) -> None:
    base = servers(mode, session_mode)
    sid = create(base)
    a1, _ = turn(base, sid, [U1], chat_template_kwargs={"enable_thinking": False, "mode": "a"})
    assert engine.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False, "mode": "a"}
    before = get(base, sid).content
    for other in ({"enable_thinking": True, "mode": "a"}, {}, None, {"enable_thinking": False}):
        calls = engine.calls
        fields = {} if other is None else {"chat_template_kwargs": other}
        refused = chat(base, sid, [U1, a1, U2], **fields)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "render_settings_changed" and "chat_template_kwargs" in error["message"]
        assert GEN not in refused.headers
        assert engine.calls == calls  # nothing sent
        assert get(base, sid).content == before  # nothing recorded
    # the same settings, keys in another order: the same rendering
    _, generation = turn(base, sid, [U1, a1, U2], chat_template_kwargs={"mode": "a", "enable_thinking": False})
    assert generation == 2
    # no settings on the first turn: absent, null and {} render alike
    plain = create(base)
    b1, _ = turn(base, plain, [U1])
    b2, _ = turn(base, plain, [U1, b1, U2], chat_template_kwargs={})
    turn(base, plain, [U1, b1, U2, b2, U1], chat_template_kwargs=None)
    refused = chat(base, plain, [U1, b1, U2, b2, U1], chat_template_kwargs={"enable_thinking": True})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "render_settings_changed"
    bad = chat(base, create(base), [U1], chat_template_kwargs=["not", "an", "object"])
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_field"


# -- client input_ids ----------------------------------------------------------------------------

@pytest.mark.parametrize("session_mode", ["v1", "v2"])
@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_client_input_ids_are_refused_and_nothing_happens(servers, engine, mode, session_mode) -> None:
    base = servers(mode, session_mode)
    sid = create(base)
    a1, _ = turn(base, sid, [U1])
    before, calls = get(base, sid).content, engine.calls
    for ids in ([1, 2, 3], []):
        refused = chat(base, sid, [U1, a1, U2], input_ids=ids)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_field" and "'input_ids'" in error["message"]
        assert "the server sets it" in error["message"]
    fresh = create(base)
    assert chat(base, fresh, [U1], input_ids=[5]).status_code == 400
    assert engine.calls == calls  # the engine never saw them
    assert get(base, sid).content == before and num_records(base, fresh) == 0
    assert get(base, sid).headers[GEN] == "1" and get(base, fresh).headers[GEN] == "0"


# -- the generation ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_the_generation_counts_committed_turns_of_a_line(servers, mode) -> None:
    base = servers(mode, "v1")
    sid = create(base)
    assert get(base, sid).headers[GEN] == "0"
    a1, g1 = turn(base, sid, [U1])
    assert g1 == 1 and get(base, sid).headers[GEN] == "1"
    _, g2 = turn(base, sid, [U1, a1, U2])
    assert g2 == 2
    # a retry of the last turn rolls it back: records stay two, the generation moves on
    _, g3 = turn(base, sid, [U1, a1, U2])
    body = get(base, sid)
    assert g3 == 3 and body.headers[GEN] == "3" and len(body.json()["records"]) == 2
    assert body.json()["metadata"]["num_rollbacks"] == 1
    samples = requests.post(f"{base}/sessions/{sid}/samples", json={}, timeout=30)
    assert samples.status_code == 200 and samples.headers[GEN] == "3"
    # a refused turn commits nothing and moves nothing
    assert chat(base, sid, [U1, a1, U2], input_ids=[1]).status_code == 400
    assert get(base, sid).headers[GEN] == "3"
    # the Messages route's turn carries it too
    messages = requests.post(f"{base}/sessions/{create(base)}/v1/messages", timeout=60,
                             json={"model": "m", "max_tokens": 8, "messages": [U1]})
    assert messages.status_code == 200 and messages.headers[GEN] == "1"
    # streamed: the header comes with the stream
    streamed = chat(base, create(base), [U1], stream=True)
    assert streamed.status_code == 200 and streamed.headers[GEN] == "1"


@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_the_generation_counts_every_node_of_a_tree(servers, mode) -> None:
    base = servers(mode, "v2")
    sid = create(base)
    a1, g1 = turn(base, sid, [U1])
    _, g2 = turn(base, sid, [U1, a1, U2])
    _, g3 = turn(base, sid, [U1, a1, U2_OTHER])  # a sibling: a node more
    body = get(base, sid)
    assert (g1, g2, g3) == (1, 2, 3) and body.headers[GEN] == "3"
    assert len(body.json()["metadata"]["tree"]["nodes"]) == 3


# -- conditional DELETE --------------------------------------------------------------------------

@pytest.mark.parametrize("session_mode", ["v1", "v2"])
@pytest.mark.parametrize("mode", sorted(SERVER_MODES))
def test_delete_with_if_match_deletes_only_that_generation(servers, mode, session_mode) -> None:
    base = servers(mode, session_mode)
    sid = create(base)
    a1, _ = turn(base, sid, [U1])
    turn(base, sid, [U1, a1, U2])
    for stale in ('"1"', "1", '"3"', 'W/"2"', '"1", "3"', "garbage"):
        refused = delete(base, sid, **{"If-Match": stale})
        assert refused.status_code == 412, (stale, refused.text)
        assert refused.headers[GEN] == "2"
        assert refused.json()["error"] == (f"session {sid} is at generation 2, If-Match asked for {stale!r}: "
                                           "nothing was deleted")
        assert num_records(base, sid) == 2  # nothing deleted
    deleted = delete(base, sid, **{"If-Match": '"1", "2"'})
    assert deleted.status_code == 204 and deleted.headers[GEN] == "2"
    assert_gone(delete(base, sid, **{"If-Match": '"2"'}), sid)
    # bare and * forms, and a session with no turn is at generation 0
    fresh = create(base)
    assert delete(base, fresh, **{"If-Match": "0"}).status_code == 204
    any_generation = create(base)
    turn(base, any_generation, [U1])
    assert delete(base, any_generation, **{"If-Match": "*"}).status_code == 204
    never = "2" * 32
    assert_unknown(delete(base, never, **{"If-Match": "*"}), never)


def test_the_tombstone_file_is_rewritten_whole_within_its_bound(session_server_factory, engine, tmp_path) -> None:
    """A server that deleted many sessions keeps a file of at most twice the bound, every line whole."""
    data = tmp_path / "data"
    server = launch(session_server_factory, engine, 0, "--data-dir", str(data), "--max-tombstones", "4")
    sids = [create(server.url) for _ in range(12)]
    for sid in sids:
        assert delete(server.url, sid).status_code == 204
    path = data / "tombstones" / "0-of-1"
    lines = path.read_bytes().splitlines()
    assert 4 <= len(lines) <= 8 and all(json.loads(line)["reason"] == "deleted" for line in lines)
    assert not [p for p in os.listdir(data / "tombstones") if p.endswith(".tmp")]
    for sid in sids[-4:]:
        assert_gone(get(server.url, sid), sid)
    server.close()
    # a torn last line (a crash mid-append) is skipped, the rest kept
    with open(path, "ab") as f:
        f.write(b'{"session_id":"torn')
    server = launch(session_server_factory, engine, 0, "--data-dir", str(data), "--max-tombstones", "4")
    for sid in sids[-4:]:
        assert_gone(get(server.url, sid), sid)
    assert all(line.endswith(b"}") for line in Path(path).read_bytes().splitlines())
    server.close()


def test_a_planted_tombstone_link_is_never_followed(session_server_factory, engine, tmp_path) -> None:
    """A symlink where a tombstone file belongs is neither read nor written through; the shard's
    sessions are served as ever and its tombstones work."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    server = launch(session_server_factory, engine, 0, "--data-dir", str(data))
    kept = create(server.url)
    turn(server.url, kept, [U1])
    server.close()
    victim = outside / "victim"
    victim.write_bytes(b'{"session_id":"' + b"3" * 32 + b'","at":1e18,"reason":"deleted"}\n')
    before = victim.read_bytes()
    path = data / "tombstones" / "0-of-1"
    path.unlink()
    path.symlink_to(victim)
    server = launch(session_server_factory, engine, 0, "--data-dir", str(data))
    assert num_records(server.url, kept) == 1
    assert_unknown(get(server.url, "3" * 32), "3" * 32)  # the link's target was not read
    assert delete(server.url, kept).status_code == 204
    assert_gone(get(server.url, kept), kept)
    assert victim.read_bytes() == before and not path.is_symlink()
    server.close()
