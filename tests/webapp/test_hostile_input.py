"""Hostile input, round two, against a real ``shinken-session-server`` (both modes where the
path exists in both): records GETs next to clients that never read, journal damage before and
after a restart, the data directory's symlinks and modes (as root, all inside ``tmp_path`` or
a temporary directory this module makes), another local user reading journals, the request
field policy and the journal byte budgets, the bytes-in-flight budget under concurrent big
bodies, the single-process app's API key, and messages whose fields hold every JSON type.

Every file these tests write, link or chmod is under a temporary directory they created."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from http.client import HTTPResponse
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import requests

from tests.webapp.test_journal_recovery import (
    ENTRY,
    Conversation,
    create,
    http,
    journal_path,
    read_journal,
    records,
)
from webapp import datadir
from webapp.serve import server_argv

pytestmark = pytest.mark.integration

MODES = {"single-process": 0, "router": 1}
NOBODY = 65534
MiB = 1 << 20
SESSION_CAP, DATA_CAP = 300_000, 1_000_000  # a turn of the reference backend (R3 on) is ~10-100 KB


def serve(factory, backend_url: str, data_dir: Path, workers: int, *extra: str, env: dict | None = None):
    return factory.launch(workers, backend_url, "--data-dir", str(data_dir), *extra, env=env)


def launch_fails(backend_url: str, data_dir: Path, workers: int = 0, timeout: float = 90) -> str:
    """Run the launcher expecting it to refuse; its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    argv = server_argv(workers, backend_url, "127.0.0.1:0", "--data-dir", str(data_dir))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert '"ready": true' not in out.stdout, out.stdout
    assert out.returncode != 0
    return out.stdout + out.stderr


def chat(base: str, sid: str, body: dict, **kw) -> requests.Response:
    return http("POST", f"{base}/sessions/{sid}/v1/chat/completions", json=body, **kw)


# -- records GETs next to clients that never read ---------------------------------------------------

def _stalled_get(url: str, path: str) -> socket.socket:
    """A GET whose client never reads a byte of the answer (a tiny receive buffer, so the
    server's send blocks at once)."""
    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_normal_get_is_served_while_64_clients_never_read(mode, reference_backend_factory,
                                                            session_server_factory, tmp_path) -> None:
    big = reference_backend_factory(r3_layers=256, r3_topk=8)  # ~8-10 MiB of records per turn
    server = serve(session_server_factory, big.url, tmp_path / "data", MODES[mode],
                   "--routing-replay-layers", "256")
    heavy = Conversation(create(server.url), "heavy")
    for _ in range(2):
        heavy.turn(server.url)
    small = Conversation(create(server.url), "small", words=1)
    small.turn(server.url)
    assert len(records(server.url, heavy.sid)) > 8 * MiB
    stalled = [_stalled_get(server.url, f"/sessions/{heavy.sid}") for _ in range(64)]
    try:
        time.sleep(2.0)  # every stalled send has started and filled its socket
        started = time.monotonic()
        resp = requests.get(f"{server.url}/sessions/{small.sid}", timeout=20)
        took = time.monotonic() - started
        assert resp.status_code == 200 and json.loads(resp.content)["metadata"]["num_records"] == 1
        assert took < 10.0, f"a one-turn GET took {took:.1f} s behind 64 clients that never read"
        # a big GET by a reading client is served too (it needs the send threads the stalled hold)
        assert len(records(server.url, heavy.sid)) > 8 * MiB
    finally:
        for sock in stalled:
            sock.close()


# -- journal damage ---------------------------------------------------------------------------------

def _flip_digit(path: Path, start: int, end: int) -> int:
    """Change one ASCII digit between ``start`` and ``end`` of the file (the middle one); its offset."""
    data = path.read_bytes()
    digits = [i for i in range(start, end) if 48 <= data[i] <= 57]
    at = digits[len(digits) // 2]
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([48 + (data[at] - 48 + 1) % 10]))
    return at


def _sidecars(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "sessions").glob("*.journal.damaged.*"))


def _served_session(factory, backend_url: str, data: Path, mode: str, turns: int):
    """A server on ``data`` and a session with ``turns`` answered turns on it."""
    server = serve(factory, backend_url, data, MODES[mode])
    conv = Conversation(create(server.url), f"{turns} turns")
    for _ in range(turns):
        conv.turn(server.url)
    return server, conv


def _health(base: str) -> dict:
    resp = requests.get(f"{base}/health", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_mid_file_damage_is_refused_while_running_and_set_aside_at_restart(mode, backend, session_server_factory,
                                                                         tmp_path) -> None:
    data = tmp_path / "data"
    server, conv = _served_session(session_server_factory, backend.url, data, mode, 6)
    path = journal_path(data, conv.sid)
    entries = read_journal(path)
    assert len(entries) == 7  # CREATE + 6 turns
    original = path.read_bytes()
    turn2 = entries[2]
    _flip_digit(path, turn2.offset + ENTRY.size, turn2.end)
    # While running: the damage is found (size/mtime moved) and the records are not served.
    resp = http("GET", f"{server.url}/sessions/{conv.sid}")
    assert resp.status_code == 500 and "damaged" in resp.text, resp.text[:300]
    server.close()
    server = serve(session_server_factory, backend.url, data, MODES[mode])
    body = records(server.url, conv.sid)
    assert json.loads(body)["metadata"]["num_records"] == 1  # turn 1: what verifies before the damage
    # Nothing was deleted: the live journal plus its sidecar are the file as it was (damage included).
    (aside,) = _sidecars(data)
    assert aside.name == f"{conv.sid}.journal.damaged.{turn2.offset}"
    damaged = path.read_bytes() + aside.read_bytes()
    assert len(damaged) == len(original) and damaged[:turn2.offset] == original[:turn2.offset]
    assert damaged[turn2.end:] == original[turn2.end:]  # the verified turns after the damage are kept
    assert stat.S_IMODE(aside.stat().st_mode) == 0o600
    assert _health(server.url)["journal_damage"] == 1
    assert "damaged entry at byte" in server.output()
    conv.rewind(1)
    conv.turn(server.url)  # the session continues from what it holds
    server.close()
    server = serve(session_server_factory, backend.url, data, MODES[mode])  # a clean file now: nothing more
    assert json.loads(records(server.url, conv.sid))["metadata"]["num_records"] == 2
    assert len(_sidecars(data)) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_damaged_create_entry_keeps_the_file_and_every_turn(mode, backend, session_server_factory,
                                                              tmp_path) -> None:
    data = tmp_path / "data"
    server, conv = _served_session(session_server_factory, backend.url, data, mode, 3)
    before = records(server.url, conv.sid)
    server.close()
    path = journal_path(data, conv.sid)
    first = read_journal(path)[0]
    create_bytes = path.read_bytes()[first.offset:first.end]
    _flip_digit(path, first.offset + ENTRY.size, first.end)  # a digit of created_at
    server = serve(session_server_factory, backend.url, data, MODES[mode])
    after = records(server.url, conv.sid)
    assert after.split(b'],"metadata":')[0] == before.split(b'],"metadata":')[0]  # every record, byte for byte
    assert json.loads(after)["metadata"]["num_records"] == 3
    read_journal(path)  # every entry verifies again (the CREATE rewritten, same length)
    (aside,) = _sidecars(data)
    damaged = aside.read_bytes()
    assert len(damaged) == len(create_bytes) and damaged != create_bytes  # the damaged bytes, kept
    assert _health(server.url)["journal_damage"] == 1
    conv.turn(server.url)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_session_set_aside_whole_answers_410_damaged_across_restarts(mode, backend, session_server_factory,
                                                                       tmp_path) -> None:
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, MODES[mode])
    lost, kept = create(server.url), Conversation(create(server.url), "kept")
    kept.turn(server.url)
    server.close()
    path = journal_path(data, lost)
    (only,) = read_journal(path)  # a CREATE and no turn: nothing else of it could verify
    _flip_digit(path, only.offset + ENTRY.size, only.end)
    for _ in range(2):  # the restart that sets it aside, then one that finds only the tombstone
        server = serve(session_server_factory, backend.url, data, MODES[mode])
        for method, route in (("GET", f"/sessions/{lost}"), ("POST", f"/sessions/{lost}/v1/chat/completions")):
            resp = http(method, f"{server.url}{route}", json={"messages": [{"role": "user", "content": "hi"}]})
            assert resp.status_code == 410, (method, resp.status_code, resp.text[:300])
            error = resp.json()["error"]  # miles' shape on its routes (a string), OpenAI's on the chat route
            if method == "POST":
                assert error["code"] == "session_gone", error
                error = error["message"]
            assert error.startswith(f"session reclaimed: session_id={lost} (its journal was found damaged"), error
        assert http("GET", f"{server.url}/sessions/{'0' * 32}").status_code == 404  # never seen: still 404
        kept.turn(server.url)  # the other session lost nothing
        assert not path.exists() and len(_sidecars(data)) == 1
        server.close()


# -- the data directory: modes, symlinks, other users -------------------------------------------------

@pytest.fixture
def open_tmp():
    """A temporary directory other users may traverse (0755): pytest's own is 0700, which
    would hide the server's modes from the other-user checks."""
    path = Path(tempfile.mkdtemp(prefix="shinken-hostile-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
@pytest.mark.parametrize("mode", sorted(MODES))
def test_another_local_user_cannot_read_journals(mode, backend, session_server_factory, open_tmp) -> None:
    data = open_tmp / "data"
    server = serve(session_server_factory, backend.url, data, MODES[mode])
    conv = Conversation(create(server.url), "secret prompt")
    conv.turn(server.url)
    path = journal_path(data, conv.sid)
    assert b"secret prompt" in path.read_bytes()
    got = _as_nobody("cat", str(path))
    assert got.returncode != 0 and "secret prompt" not in got.stdout, got.stdout[:200]
    assert _as_nobody("ls", str(data / "sessions")).returncode != 0
    assert _as_nobody("cat", str(data / "instance_id")).returncode != 0
    for name in ("lock", "instance_id", "usage", "create.lock"):
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((data / "sessions").stat().st_mode) == 0o700


def test_a_group_or_world_writable_data_dir_is_refused(backend, tmp_path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    out = launch_fails(backend.url, data)
    assert "writable by its group or by others" in out
    assert not (data / "sessions").exists()


@pytest.mark.parametrize("name", ["lock", "create.lock"])
def test_a_dangling_lock_symlink_creates_nothing_elsewhere(name, backend, session_server_factory, tmp_path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "sessions").mkdir(parents=True, mode=0o700)
    data.chmod(0o700)
    outside.mkdir()
    (data / name).symlink_to(outside / f"planted-{name}")
    if name == "lock":
        out = launch_fails(backend.url, data)
        assert "symlink" in out
    else:
        server = serve(session_server_factory, backend.url, data, 0)
        resp = http("POST", f"{server.url}/sessions")
        assert resp.status_code == 507 and "symlink" in resp.text, resp.text
    assert list(outside.iterdir()) == []


def test_an_instance_id_symlink_is_never_published(backend, tmp_path) -> None:
    data, secret = tmp_path / "data", tmp_path / "secret"
    secret.write_text("TOP-SECRET-TOKEN\n")
    secret.chmod(0o600)
    (data / "sessions").mkdir(parents=True, mode=0o700)
    data.chmod(0o700)
    (data / "instance_id").symlink_to(secret)
    out = launch_fails(backend.url, data)
    assert "TOP-SECRET-TOKEN" not in out and "symlink" in out


def test_a_planted_instance_id_temp_symlink_is_not_written_through(tmp_path) -> None:
    data, target = tmp_path / "data", tmp_path / "target"
    data.mkdir(mode=0o700)
    target.write_text("keep me\n")
    for pid in (os.getpid(), *range(os.getpid() + 1, os.getpid() + 64)):  # the old name: instance_id.<pid>.tmp
        (data / f"instance_id.{pid}.tmp").symlink_to(target)
    value = datadir.instance_id(str(data))
    assert len(value) == 32 and target.read_text() == "keep me\n"
    assert stat.S_IMODE((data / "instance_id").stat().st_mode) == 0o600


@pytest.mark.timeout(300)
def test_a_journal_symlink_is_neither_truncated_nor_appended_to(backend, session_server_factory, tmp_path) -> None:
    data, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    server = serve(session_server_factory, backend.url, data, 1)
    conv = Conversation(create(server.url), "link")
    conv.turn(server.url)
    server.close()
    path = journal_path(data, conv.sid)
    target = outside / "victim"
    shutil.move(path, target)
    with open(target, "ab") as f:
        f.write(b"\x07\x00\x00")  # a torn tail: the old server truncated the link's target
    path.symlink_to(target)
    victim = target.read_bytes()
    server = serve(session_server_factory, backend.url, data, 1)
    assert http("GET", f"{server.url}/sessions/{conv.sid}").status_code == 404
    resp = chat(server.url, conv.sid, {"messages": [{"role": "user", "content": "more"}]})
    assert resp.status_code == 404
    assert target.read_bytes() == victim
    assert "symlink" in server.output()


# -- fields, disk budgets ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(MODES))
def budgeted(request, backend, session_server_factory, tmp_path_factory):
    data = tmp_path_factory.mktemp("budget") / "data"
    server = serve(session_server_factory, backend.url, data, MODES[request.param],
                   "--max-session-bytes", str(SESSION_CAP), "--max-data-bytes", str(DATA_CAP))
    return server.url, data


def test_an_unknown_top_level_field_is_400_naming_it_and_stores_nothing(budgeted) -> None:
    base, data = budgeted
    sid = create(base)
    size = journal_path(data, sid).stat().st_size
    resp = chat(base, sid, {"messages": [{"role": "user", "content": "hi"}], "padding": "x" * 100_000})
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    assert "'padding'" in err["message"] and err["code"] == "unknown_field"
    for field, value in (("input_ids", [1, 2]), ("custom_logit_processor", "x"), ("image_data", ["x"])):
        resp = chat(base, sid, {"messages": [{"role": "user", "content": "hi"}], field: value})
        assert resp.status_code == 400 and repr(field) in resp.json()["error"]["message"], (field, resp.text)
    assert journal_path(data, sid).stat().st_size == size
    assert chat(base, sid, {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,
                            "top_k": 5, "stream": False}).status_code == 200
    http("DELETE", f"{base}/sessions/{sid}")


def test_a_session_past_max_session_bytes_is_507_and_stores_nothing(budgeted) -> None:
    base, data = budgeted
    conv = Conversation(create(base), "budget", words=200)
    for _ in range(40):
        resp = conv.say(base)
        if resp.status_code != 200:
            break
    assert resp.status_code == 507, resp.text[:300]
    assert "max_session_bytes" in resp.text
    size = journal_path(data, conv.sid).stat().st_size
    assert size <= SESSION_CAP
    assert conv.say(base).status_code == 507 and journal_path(data, conv.sid).stat().st_size == size
    http("DELETE", f"{base}/sessions/{conv.sid}")


def test_the_server_past_max_data_bytes_is_507(budgeted) -> None:
    base, data = budgeted
    sids, last = [], None
    for _ in range(200):
        conv = Conversation(create(base), "fill", words=5)
        sids.append(conv.sid)
        for _ in range(3):
            last = conv.say(base)
            if last.status_code != 200:
                break
        if last.status_code != 200:
            break
    assert last is not None and last.status_code == 507 and "max_data_bytes" in last.text, last.text[:300]
    total = sum(p.stat().st_size for p in (data / "sessions").glob("*.journal"))
    assert total <= DATA_CAP
    for sid in sids:  # deleting frees the budget again
        http("DELETE", f"{base}/sessions/{sid}")
    conv = Conversation(create(base), "after")
    conv.turn(base)
    http("DELETE", f"{base}/sessions/{conv.sid}")


# -- bytes in flight ----------------------------------------------------------------------------------

def _tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_concurrent_big_bodies_past_the_inflight_budget_get_503_with_retry_after(mode, backend,
                                                                                 session_server_factory,
                                                                                 tmp_path) -> None:
    budget = 64 * MiB
    server = serve(session_server_factory, backend.url, tmp_path / "data", MODES[mode],
                   "--max-inflight-bytes", str(budget))
    sid = create(server.url)
    # 30 MiB bodies the core reads and parses, then refuses (a message over max_message_bytes)
    body = json.dumps({"messages": [{"role": "user", "content": "a" * (30 * MiB)}]}).encode()
    baseline = _tree_rss(server.proc.pid)
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss(server.proc.pid))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    parts = urlsplit(server.url)
    head = (f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    headers_sent = threading.Barrier(8)

    def send(_: int) -> tuple[int, dict[str, str], str]:
        # Every head arrives before any body byte, and the bodies wait until the server has had
        # time to admit or refuse each: admission is decided on Content-Length, so exactly the
        # bodies that fit are held, however fast the machine reads and parses the others.
        with socket.create_connection((parts.hostname, parts.port), timeout=120) as sock:
            sock.sendall(head)
            headers_sent.wait()
            time.sleep(2.0)
            sock.sendall(body)
            resp = HTTPResponse(sock)
            resp.begin()
            return resp.status, dict(resp.getheaders()), resp.read().decode()

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(send, range(8)))
    finally:
        stop.set()
        sampler.join()
    statuses = sorted(status for status, _, _ in replies)
    busy = [(headers, text) for status, headers, text in replies if status == 503]
    # two 30 MiB bodies fit in 64 MiB (refused by the core: 413), the other six wait their turn
    assert statuses == [413] * 2 + [503] * 6, statuses
    assert all(headers.get("Retry-After") == "1" for headers, _ in busy), busy
    assert all("max_inflight_bytes" in text for _, text in busy)
    # 8 bodies of 30 MiB at ~3 copies each would add ~720 MiB; at most two are admitted at once.
    grew = peak[0] - baseline
    assert grew < 6 * budget, f"the server grew {grew >> 20} MiB with a {budget >> 20} MiB budget"
    # a body alone over the budget can never fit: 413, not a retry forever
    resp = requests.post(f"{server.url}/sessions/{sid}/v1/chat/completions", timeout=120,
                         data=b" " * (budget + 1), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and "max_inflight_bytes" in resp.text


# -- the single-process app's API key ------------------------------------------------------------------

def test_the_single_process_app_under_gunicorn_enforces_the_api_key(backend, session_server_factory) -> None:
    argv = session_server_factory.gunicorn_argv()
    argv[argv.index("gevent")] = "webapp.gunicorn_worker.SessionServerWorker"
    server = session_server_factory(argv, env={"SHINKEN_API_KEY": "sekrit"}, backend_url=backend.url)
    base = server.url
    auth = {"Authorization": "Bearer sekrit"}
    assert requests.post(f"{base}/sessions", timeout=30).status_code == 401
    sid = requests.post(f"{base}/sessions", headers=auth, timeout=30).json()["session_id"]
    for method, path in (("GET", f"/sessions/{sid}"), ("DELETE", f"/sessions/{sid}"),
                         ("POST", f"/sessions/{sid}/v1/chat/completions"), ("POST", f"/sessions/{sid}/samples"),
                         ("GET", f"/sessions/{sid}/v1/models")):
        resp = requests.request(method, base + path, json={"messages": [{"role": "user", "content": "x"}]},
                                timeout=30)
        assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer", (method, path)
    assert requests.get(f"{base}/sessions/{sid}", headers=auth, timeout=30).status_code == 200
    health = requests.get(f"{base}/health", timeout=30)
    assert health.status_code == 200 and "sessions" not in health.json(), health.text


def test_the_single_process_launcher_takes_an_api_key(backend, session_server_factory) -> None:
    server = session_server_factory.launch(0, backend.url, env={"SHINKEN_API_KEY": "k2"})
    assert requests.post(f"{server.url}/sessions", timeout=30).status_code == 401
    assert requests.post(f"{server.url}/sessions", headers={"Authorization": "Bearer k2"},
                         timeout=30).status_code == 200


# -- every JSON type in a message's fields ---------------------------------------------------------------

JSON_VALUES = [5, -1, 1.5, 0, "x", "", True, False, None, {}, {"a": 1}, [], [5], ["x"], [None], [[]], [{}],
               [{"function": 5}], [{"function": {"name": 5}}], [{"function": {"name": "f", "arguments": 5}}],
               [{"function": {"name": "f", "arguments": {"a": [1]}}, "id": 5, "type": 7}]]


@pytest.fixture(scope="module", params=sorted(MODES))
def plain(request, backend, session_server_factory) -> str:
    return session_server_factory.launch(MODES[request.param], backend.url).url


@pytest.mark.parametrize("field", ["tool_calls", "content", "name", "role", "tool_call_id"])
def test_a_message_field_of_any_json_type_is_answered_never_500(plain, field) -> None:
    sid = create(plain)
    statuses = {}
    for value in JSON_VALUES:
        role = "assistant" if field == "tool_calls" else "user"
        message = {"role": role, "content": "hi", field: value}
        resp = chat(plain, sid, {"messages": [{"role": "user", "content": "q"}, message]})
        statuses[json.dumps(value)] = resp.status_code
        assert resp.status_code < 500, (field, value, resp.status_code, resp.text[:300])
        if resp.status_code == 400:
            assert resp.json()["error"]["code"] in ("invalid_field", "invalid_json", "append_only_violation",
                                                    "unknown_field"), resp.text
    assert statuses[json.dumps(5)] == 400, statuses
    http("DELETE", f"{plain}/sessions/{sid}")


def test_inflight_budget_admits_lengths_up_front_and_meters_chunked_bodies() -> None:
    from webapp.inflight import BodyOverBudget, InflightBudget, Overloaded

    budget = InflightBudget(100)
    with budget.admit(60) as grant:
        assert budget.used == 60 and list(grant.metered([b"x" * 30, b"y" * 30])) and budget.used == 60
        with pytest.raises(Overloaded) as refused, budget.admit(50):
            pass
        assert refused.value.retry_after == 1 and budget.used == 60
        with budget.admit(None) as chunked:
            list(chunked.metered([b"z" * 20]))
            assert budget.used == 80
            with pytest.raises(Overloaded):
                list(chunked.metered([b"z" * 30]))
    assert budget.used == 0
    with pytest.raises(BodyOverBudget), budget.admit(101):
        pass
