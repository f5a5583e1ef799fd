"""The records journal end to end, with real processes on loopback: a session's
records survive a SIGKILLed worker, a restarted server (even with another ``--workers``) and a
torn journal tail byte for byte (a worker killed amid turns keeps every answered one); a full
disk or a file-size limit is a 507 that commits nothing; DELETE removes the file and
``--max-sessions`` counts the whole server; GET answers HEAD, a Range and an ETag; a worker's
memory stays flat while gigabytes of records go to disk.

The journal format checked here (docs/session-server-ops.md): ``DIR/sessions/<id>.journal`` = b"SHKJ" +
u32 LE version 1, then entries ``struct.Struct("<QBI")`` (payload length, kind, crc32 of the
kind byte + payload) each followed by its payload; kinds 1 CREATE, 3 IMAGE, 4 DELTA (a turn; version 1 wrote 2 TURN).

Every file these tests write is under pytest's ``tmp_path`` (the tmpfs of the disk-full test is
mounted on a directory inside it and unmounted at teardown)."""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import subprocess
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import requests

from bench import procfs
from tests.support import sigkill_tree
from tests.webapp.test_images import image_part, png
from tests.webapp.test_supervisor import wait_healthy, worker_procs
from webapp.serve import server_argv
from webapp.sharding import shard_for

pytestmark = pytest.mark.integration

JOURNAL_HEADER = b"SHKJ" + struct.pack("<I", 2)
ENTRY = struct.Struct("<QBI")
CREATE, TURN, IMAGE = 1, 4, 3  # TURN: a version 2 turn (DELTA)
R3_LAYERS, R3_TOPK = 8, 8  # small records: ~340 bytes of base64 R3 per token
RESTART_LIMIT = 30.0  # a restarted worker must be serving again within this (loaded 2-core machine)
LOG_LIMIT = 10.0  # a worker's log line reaches the server's output within this
MiB = 1024 * 1024


# -- helpers -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    offset: int
    kind: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + ENTRY.size + self.length


def read_journal(path: Path) -> list[Entry]:
    """Every entry of a journal, checked strictly (header, lengths, CRCs): a torn or corrupt
    entry anywhere fails the assertion."""
    entries = []
    with open(path, "rb") as f:
        assert f.read(len(JOURNAL_HEADER)) == JOURNAL_HEADER, path
        offset = len(JOURNAL_HEADER)
        while head := f.read(ENTRY.size):
            assert len(head) == ENTRY.size, f"{path}: short entry header at {offset}"
            length, kind, crc = ENTRY.unpack(head)
            check, left = zlib.crc32(bytes([kind])), length
            while left:
                piece = f.read(min(left, 4 * MiB))
                assert piece, f"{path}: entry at {offset} claims {length} bytes, {length - left} follow"
                check, left = zlib.crc32(piece, check), left - len(piece)
            assert check == crc, f"{path}: bad CRC of the entry at {offset}"
            assert kind in (CREATE, TURN, IMAGE), f"{path}: unknown kind {kind} at {offset}"
            entries.append(Entry(offset, kind, length))
            offset += ENTRY.size + length
    return entries


def journal_path(data_dir: Path, sid: str) -> Path:
    return data_dir / "sessions" / f"{sid}.journal"


def serve(factory, backend_url: str, data_dir: Path, workers: int, *extra: str, layers: int = R3_LAYERS,
          env: dict[str, str] | None = None, data_dir_flag: bool = True):
    """A ``shinken-session-server`` on ``data_dir`` (by flag, else by SHINKEN_DATA_DIR)."""
    where = ["--data-dir", str(data_dir)] if data_dir_flag else []
    env = {**(env or {}), **({} if data_dir_flag else {"SHINKEN_DATA_DIR": str(data_dir)})}
    return factory.launch(workers, backend_url, *where, "--routing-replay-layers", str(layers), *extra, env=env)


def http(method: str, url: str, **kw) -> requests.Response:
    """One request on a connection of its own, closed after the reply: a graceful stop of the
    server then waits for no keep-alive connection a response object still holds."""
    kw["headers"] = {"Connection": "close", **kw.get("headers", {})}
    kw.setdefault("timeout", 60)
    return requests.request(method, url, **kw)


def create(base: str) -> str:
    resp = http("POST", f"{base}/sessions", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["session_id"]


def records(base: str, sid: str) -> bytes:
    resp = http("GET", f"{base}/sessions/{sid}", timeout=60)
    assert resp.status_code == 200, (sid, resp.status_code, resp.text[:300])
    assert int(resp.headers["Content-Length"]) == len(resp.content)
    return resp.content


def metadata(body: bytes) -> dict:
    return json.loads(body)["metadata"]


def records_prefix(body: bytes) -> bytes:
    """The body up to the end of its last record: an appended turn keeps it as a prefix."""
    return body[:body.rindex(b'],"metadata":')]


def sessions_on_every_shard(base: str, shards: int, per_shard: int) -> list[str]:
    """``per_shard`` fresh sessions on each of ``shards`` shards (the surplus is deleted)."""
    owned: dict[int, list[str]] = {shard: [] for shard in range(shards)}
    while any(len(sids) < per_shard for sids in owned.values()):
        sid = create(base)
        mine = owned[shard_for(sid, shards)]
        if len(mine) < per_shard:
            mine.append(sid)
        else:
            assert http("DELETE", f"{base}/sessions/{sid}", timeout=30).status_code == 204
    return [sid for sids in owned.values() for sid in sids]


class Conversation:
    """One client's view of a session: the whole history is resent each turn (TITO appends)."""

    def __init__(self, sid: str, topic: str, words: int = 12) -> None:
        self.sid = sid
        self.topic = topic
        self.words = words
        self.messages: list[dict] = []
        self.history: list[list[dict]] = [[]]  # the messages after 0, 1, 2... turns

    def text(self, turn: int | None = None) -> str:
        n = len(self.history) - 1 if turn is None else turn
        return f"{self.topic} step {n}: " + "click the button on the screen " * self.words

    def say(self, base: str, text: str | None = None, images: tuple[bytes, ...] = ()) -> requests.Response:
        """One turn; on 200 the user message and the reply join the history."""
        text = self.text() if text is None else text
        content = [{"type": "text", "text": text}, *(image_part(i) for i in images)] if images else text
        user = {"role": "user", "content": content}
        resp = http("POST", f"{base}/sessions/{self.sid}/v1/chat/completions", timeout=120,
                    json={"messages": [*self.messages, user]})
        if resp.status_code == 200:
            self.messages = [*self.messages, user, resp.json()["choices"][0]["message"]]
            self.history.append(self.messages)
        return resp

    def turn(self, base: str, images: tuple[bytes, ...] = ()) -> None:
        resp = self.say(base, images=images)
        assert resp.status_code == 200, (self.sid, resp.status_code, resp.text[:500])

    def retry(self, base: str) -> None:
        """The last turn again (as a client does that never got its reply): a rollback."""
        self.rewind(len(self.history) - 2)
        self.turn(base)

    def rewind(self, turns: int) -> None:
        """Forget the turns after the first ``turns`` (the server lost them)."""
        self.history = self.history[:turns + 1]
        self.messages = self.history[-1]


def assert_continues(base: str, conv: Conversation, before: bytes) -> bytes:
    """One more turn succeeds and only appends: the old records are a byte prefix of the new
    body, and ``accumulated_token_ids`` extends the old list."""
    conv.turn(base)
    after = records(base, conv.sid)
    old_ids, new_ids = metadata(before)["accumulated_token_ids"], metadata(after)["accumulated_token_ids"]
    assert len(new_ids) > len(old_ids) and new_ids[:len(old_ids)] == old_ids, conv.sid
    assert metadata(after)["num_records"] == metadata(before)["num_records"] + 1
    assert after.startswith(records_prefix(before)), conv.sid
    return after


def wait_for_restart(server, shard: int, shards: int, old_pid: int) -> None:
    deadline = time.monotonic() + RESTART_LIMIT
    while time.monotonic() < deadline:
        proc = worker_procs(server, shards).get(shard)
        if proc is not None and proc.pid != old_pid:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"shard {shard} was not restarted within {RESTART_LIMIT} s:\n{server.output()[-3000:]}")
    wait_healthy(server.url, RESTART_LIMIT)


def kill_server(server) -> None:
    """SIGKILL the whole server tree at once (no finally, no flush of anything in user space)."""
    sigkill_tree(server.proc)


def log_lines(server, *needles: str, limit: float = LOG_LIMIT) -> list[str]:
    """The server's output lines holding every needle, waiting up to ``limit`` for one."""
    deadline = time.monotonic() + limit
    while True:
        found = [line for line in server.output().splitlines() if all(n in line for n in needles)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def vm_rss(pid: int) -> int:
    rss = procfs.status_bytes(pid, "VmRSS")
    assert rss is not None, f"process {pid} is gone"
    return rss


@pytest.fixture(scope="module")
def backend(reference_backend_factory):
    return reference_backend_factory(r3_layers=R3_LAYERS, r3_topk=R3_TOPK)


# -- 1. a SIGKILLed worker ---------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_sigkilled_worker_comes_back_with_every_session_byte_identical(session_server_factory, backend,
                                                                         tmp_path) -> None:
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, 2)
    base = server.url
    convs = [Conversation(sid, f"task {i}") for i, sid in enumerate(sessions_on_every_shard(base, 2, 4))]
    for _ in range(3):
        for conv in convs:
            conv.turn(base)
    before = {conv.sid: records(base, conv.sid) for conv in convs}
    for conv in convs:
        assert metadata(before[conv.sid])["num_records"] == 3
        assert [e.kind for e in read_journal(journal_path(data, conv.sid))] == [CREATE, TURN, TURN, TURN]

    victim = worker_procs(server, 2)[0]
    victim.kill()
    victim.wait(10)
    wait_for_restart(server, 0, 2, victim.pid)

    for conv in convs:  # both shards: the restarted one reloaded its journals
        assert records(base, conv.sid) == before[conv.sid], (conv.sid, shard_for(conv.sid, 2))
    for conv in convs:
        assert_continues(base, conv, before[conv.sid])
    # A kill between turns leaves no torn entry behind.
    assert log_lines(server, "torn tail", limit=0) == []
    server.close()


@pytest.mark.timeout(120)
def test_a_worker_killed_amid_turns_loses_no_answered_turn_and_serves_no_torn_one(
        session_server_factory, reference_backend_factory, tmp_path) -> None:
    """Six clients chat without pause on the shard whose worker is SIGKILLed: afterwards each
    session holds every turn its client got a 200 for (at most one more, journaled but never
    answered), the records it had are a byte prefix of what it has, and it continues."""
    layers = 64  # ~2.7 KB of record per token: appends of a few MB, so some are in flight
    backend64 = reference_backend_factory(r3_layers=layers, r3_topk=8)
    data = tmp_path / "data"
    # --fsync: each append waits for the disk after its bytes are in the file, so the kill often
    # falls between a turn's journaling and its reply
    server = serve(session_server_factory, backend64.url, data, 2, "--fsync", layers=layers)
    base = server.url
    convs = [Conversation(sid, f"client {i}") for i, sid in enumerate(sessions_on_every_shard(base, 2, 6)[:6])]
    assert {shard_for(conv.sid, 2) for conv in convs} == {0}
    seen: dict[str, tuple[int, bytes]] = {conv.sid: (0, records(base, conv.sid)) for conv in convs}
    answered: dict[str, int] = {conv.sid: 0 for conv in convs}
    stop = threading.Event()

    def client(conv: Conversation) -> None:
        while not stop.is_set():
            if conv.say(base).status_code != 200:
                return
            answered[conv.sid] += 1
            resp = http("GET", f"{base}/sessions/{conv.sid}", timeout=60)
            if resp.status_code != 200:
                return
            seen[conv.sid] = (answered[conv.sid], resp.content)

    threads = [threading.Thread(target=client, args=(conv,), daemon=True) for conv in convs]
    for thread in threads:
        thread.start()
    time.sleep(3.0)
    victim = worker_procs(server, 2)[0]
    victim.kill()
    victim.wait(10)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert sum(answered.values()) >= 6, answered  # the clients were busy
    wait_for_restart(server, 0, 2, victim.pid)

    for conv in convs:
        body = records(base, conv.sid)  # whole JSON (records() checks the length too)
        n, last_seen = seen[conv.sid]
        assert body.startswith(records_prefix(last_seen)), conv.sid
        held = metadata(body)["num_records"]
        assert answered[conv.sid] <= held <= answered[conv.sid] + 1, (conv.sid, answered[conv.sid], held, n)
        assert len(json.loads(body)["records"]) == held
        if held > answered[conv.sid]:  # journaled, never answered: the client retries it (a rollback)
            conv.turn(base)
            body = records(base, conv.sid)
            assert (metadata(body)["num_records"], metadata(body)["num_rollbacks"]) == (held, 1), conv.sid
        assert_continues(base, conv, body)
    server.close()


# -- 2. a torn tail ----------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_torn_tail_is_cut_logged_and_never_served(session_server_factory, backend, tmp_path) -> None:
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, 2)
    base = server.url
    names = ("garbage", "flipped", "cut", "clean")
    convs = {name: Conversation(create(base), name) for name in names}
    bodies: dict[str, list[bytes]] = {name: [] for name in names}  # the GET after 1, 2, 3 turns
    for _ in range(3):
        for name, conv in convs.items():
            conv.turn(base)
            bodies[name].append(records(base, conv.sid))
    server.close()

    paths = {name: journal_path(data, conv.sid) for name, conv in convs.items()}
    entries = {name: read_journal(path) for name, path in paths.items()}
    for name in names:
        assert [e.kind for e in entries[name]] == [CREATE, TURN, TURN, TURN], name
        assert entries[name][-1].end == paths[name].stat().st_size
    # garbage: an entry header claiming 1 MiB, then 100 bytes of it
    with open(paths["garbage"], "ab") as f:
        f.write(ENTRY.pack(MiB, TURN, 0x12345678) + b"g" * 100)
    # flipped: one byte in the middle of the last entry's payload (its CRC no longer matches)
    last = entries["flipped"][-1]
    with open(paths["flipped"], "r+b") as f:
        f.seek(last.offset + ENTRY.size + last.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))
    # cut: the last entry loses the second half of its payload
    last = entries["cut"][-1]
    os.truncate(paths["cut"], last.offset + ENTRY.size + last.length // 2)
    good = {"garbage": (entries["garbage"][-1].end, 3), "flipped": (entries["flipped"][-1].offset, 2),
            "cut": (entries["cut"][-1].offset, 2), "clean": (entries["clean"][-1].end, 3)}

    server = serve(session_server_factory, backend.url, data, 2)
    base = server.url
    for name, (size, turns) in good.items():
        assert records(base, convs[name].sid) == bodies[name][turns - 1], name
        assert paths[name].stat().st_size == size, name  # truncated to the last good entry
        assert len(read_journal(paths[name])) == 1 + turns, name
    for name in ("garbage", "flipped", "cut"):
        lines = log_lines(server, "torn tail", str(paths[name]))
        assert lines, f"no 'torn tail' line naming {paths[name]}:\n{server.output()[-3000:]}"
        assert any("WARNING" in line for line in lines), lines
    assert log_lines(server, "torn tail", str(paths["clean"]), limit=0) == []

    # Each continues from what was recovered; the journals stay whole.
    for name, (_size, turns) in good.items():
        conv = convs[name]
        conv.rewind(turns)
        assert_continues(base, conv, bodies[name][turns - 1])
        assert [e.kind for e in read_journal(paths[name])] == [CREATE] + [TURN] * (turns + 1), name
    server.close()


# -- 3. a whole-server restart --------------------------------------------------------------------

def snapshot(base: str, sid: str) -> tuple[bytes, bytes, bytes]:
    """Everything a client can read of a session: records, records with images, samples."""
    with_images = http("GET", f"{base}/sessions/{sid}", params={"images": "1"}, timeout=60)
    samples = http("POST", f"{base}/sessions/{sid}/samples", params={"images": "1"}, json={}, timeout=60)
    assert with_images.status_code == 200 and samples.status_code == 200, (with_images.text[:300], samples.text[:300])
    return records(base, sid), with_images.content, samples.content


@pytest.mark.timeout(150)
def test_a_restarted_server_serves_every_session_byte_identical_and_continues(session_server_factory, backend,
                                                                               tmp_path) -> None:
    """A graceful stop, then a SIGKILL of the whole tree: records, images and samples come back
    byte for byte; a turn retried right after the restart (a rollback) and new turns append."""
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, 2, "--fsync")
    base = server.url
    convs = [Conversation(create(base), f"task {i}") for i in range(6)]
    shots = (png(64, 48, 1), png(64, 48, 2))
    for turn in range(2):
        for i, conv in enumerate(convs):
            conv.turn(base, images=(shots[turn],) if i == 0 else ())
    convs[1].retry(base)  # a rollback: replaces the last record
    assert metadata(records(base, convs[1].sid))["num_rollbacks"] == 1
    assert [e.kind for e in read_journal(journal_path(data, convs[0].sid))] == [CREATE, IMAGE, TURN, IMAGE, TURN]
    before = {conv.sid: snapshot(base, conv.sid) for conv in convs}
    assert len(json.loads(before[convs[0].sid][1])["images"]) == 2
    server.close()  # a graceful stop
    assert server.proc.returncode == 0

    server = serve(session_server_factory, backend.url, data, 2, "--fsync")
    base = server.url
    for conv in convs:
        assert snapshot(base, conv.sid) == before[conv.sid], conv.sid
    after = {conv.sid: assert_continues(base, conv, before[conv.sid][0]) for conv in convs}
    kill_server(server)  # now a crash of the whole tree

    server = serve(session_server_factory, backend.url, data, 2, env={"SHINKEN_FSYNC": "1"})
    base = server.url
    for conv in convs:
        assert records(base, conv.sid) == after[conv.sid], conv.sid
    convs[2].retry(base)  # the first turn after the restart rolls back the last one before it
    retried = records(base, convs[2].sid)
    assert metadata(retried)["num_rollbacks"] == 1
    assert metadata(retried)["num_records"] == metadata(after[convs[2].sid])["num_records"]
    after[convs[2].sid] = retried
    for conv in convs:
        assert_continues(base, conv, after[conv.sid])
    server.close()


def test_a_second_server_cannot_take_a_data_dir_in_use(session_server_factory, backend, tmp_path) -> None:
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, 1)
    sid = create(server.url)
    second = subprocess.run(server_argv(1, backend.url, "127.0.0.1:0", "--data-dir", str(data)),
                            capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode != 0 and "in use" in second.stderr, (second.returncode, second.stderr[-2000:])
    assert journal_path(data, sid).is_file() and records(server.url, sid)
    server.close()


# -- 4. re-sharding --------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_a_restart_with_other_workers_reshards_every_session(session_server_factory, backend, tmp_path) -> None:
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, 2)
    base = server.url
    convs = [Conversation(create(base), f"task {i}") for i in range(9)]
    for _ in range(2):
        for conv in convs:
            conv.turn(base)
    current = {conv.sid: records(base, conv.sid) for conv in convs}
    server.close()

    for workers in (3, 1, 0):  # 0: the single-process server reads them all as well
        server = serve(session_server_factory, backend.url, data, workers)
        base = server.url
        assert len(worker_procs(server, workers)) == workers
        for conv in convs:
            assert records(base, conv.sid) == current[conv.sid], (workers, conv.sid)
        current = {conv.sid: assert_continues(base, conv, current[conv.sid]) for conv in convs}
        server.close()
    # moved sessions are not left twice on disk
    assert sorted(p.name for p in (data / "sessions").glob("*.journal")) == sorted(f"{c.sid}.journal" for c in convs)


# -- 5. a full disk --------------------------------------------------------------------------------

def assert_insufficient_storage_chat(resp: requests.Response) -> None:
    assert resp.status_code == 507, (resp.status_code, resp.text[:500])
    assert resp.headers["Content-Type"].startswith("application/json")
    error = resp.json()["error"]
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]
    assert error["type"] == "server_error" and error["code"] == "insufficient_storage", error


def fill_up(path: Path) -> int:
    """Write ``path`` until the file system is full (ENOSPC); returns the bytes written."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (64 * 1024, 4096, 1):
            while True:
                try:
                    written += os.write(fd, b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    return written


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs mounted on ``tmp_path/small`` (root only), unmounted at teardown."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount_point)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True, check=False).returncode != 0:
            # still busy (a process of a failed test holds a file): detach it now, freed when closed
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


@pytest.mark.timeout(120)
def test_a_full_disk_is_507_commits_nothing_and_the_same_chat_succeeds_later(
        session_server_factory, reference_backend_factory, small_tmpfs) -> None:
    layers = 16  # ~700 bytes of record per token
    backend16 = reference_backend_factory(r3_layers=layers, r3_topk=8)
    data = small_tmpfs / "data"
    server = serve(session_server_factory, backend16.url, data, 1, layers=layers)
    try:
        base = server.url
        big = Conversation(create(base), "big", words=90)  # one turn of ~1.5 MB, freed later
        big.turn(base)
        big_size = journal_path(data, big.sid).stat().st_size
        assert big_size > 1.2 * MiB, big_size
        # A turn stores what it adds (its own tokens' R3 rows): a few hundred KB each.
        small = Conversation(create(base), "small", words=20)
        before, last_size, failed = b"", 0, None
        for _ in range(40):
            before = records(base, small.sid)
            size = journal_path(data, small.sid).stat().st_size
            step, last_size = size - last_size, size
            resp = small.say(base)
            if resp.status_code != 200:
                failed = resp
                break
        assert failed is not None, "the 4 MiB tmpfs never filled up"
        assert_insufficient_storage_chat(failed)
        assert records(base, small.sid) == before  # nothing committed
        retry = small.text()
        # the failed turn's record is a bit larger than the last one: room for it once big is gone
        assert big_size > 1.5 * step, (big_size, step)

        fill_up(small_tmpfs / "filler")  # not one page left
        assert_insufficient_storage_chat(small.say(base, retry))
        assert records(base, small.sid) == before
        refused = http("POST", f"{base}/sessions", timeout=30)
        assert refused.status_code == 507, refused.text[:300]
        assert isinstance(refused.json()["error"], str) and refused.json()["error"]

        assert http("DELETE", f"{base}/sessions/{big.sid}", timeout=30).status_code == 204
        assert not journal_path(data, big.sid).exists()
        assert_continues(base, small, before)  # the same chat as the one refused
        assert small.messages[-2]["content"] == retry
        turns = metadata(records(base, small.sid))["num_records"]
        assert [e.kind for e in read_journal(journal_path(data, small.sid))] == [CREATE] + [TURN] * turns
        assert http("POST", f"{base}/sessions", timeout=30).status_code == 200
    finally:
        server.close()  # before the tmpfs is unmounted


@pytest.mark.timeout(90)
def test_a_file_size_limit_is_507_and_nothing_committed(session_server_factory, backend, tmp_path) -> None:
    """RLIMIT_FSIZE on the worker: its journal write fails with EFBIG (Python ignores SIGXFSZ)."""
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, 1)
    base = server.url
    conv = Conversation(create(base), "limited")
    conv.turn(base)
    before = records(base, conv.sid)
    worker = worker_procs(server, 1)[0]
    soft, hard = worker.rlimit(psutil.RLIMIT_FSIZE)
    worker.rlimit(psutil.RLIMIT_FSIZE, (journal_path(data, conv.sid).stat().st_size + 512, hard))
    try:
        text = conv.text()
        assert_insufficient_storage_chat(conv.say(base, text))
        assert records(base, conv.sid) == before
    finally:
        worker.rlimit(psutil.RLIMIT_FSIZE, (soft, hard))
    assert_continues(base, conv, before)
    assert conv.messages[-2]["content"] == text
    assert [e.kind for e in read_journal(journal_path(data, conv.sid))] == [CREATE, TURN, TURN]
    assert worker_procs(server, 1)[0].pid == worker.pid  # answered, not crashed
    server.close()


# -- 6. DELETE and the per-server session limit ---------------------------------------------------

@pytest.mark.timeout(120)
def test_delete_removes_the_journal_and_max_sessions_counts_the_whole_server(session_server_factory, backend,
                                                                          tmp_path) -> None:
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, 2, "--max-sessions", "3", data_dir_flag=False)
    base = server.url
    sids = [create(base) for _ in range(3)]
    for sid in sids:
        assert journal_path(data, sid).is_file()  # SHINKEN_DATA_DIR was honoured
    Conversation(sids[0], "kept").turn(base)

    def assert_full(attempts: int = 6) -> None:
        # fresh ids hash to either shard: a per-worker count would admit some of them
        for _ in range(attempts):
            resp = http("POST", f"{base}/sessions", timeout=30)
            assert resp.status_code == 429, (resp.status_code, resp.text[:300])
            assert isinstance(resp.json()["error"], str) and resp.json()["error"]
        assert len(list((data / "sessions").glob("*.journal"))) == 3

    assert_full()
    assert http("DELETE", f"{base}/sessions/{sids[1]}", timeout=30).status_code == 204
    assert not journal_path(data, sids[1]).exists()
    assert http("GET", f"{base}/sessions/{sids[1]}", timeout=30).status_code == 410
    assert http("DELETE", f"{base}/sessions/{sids[1]}", timeout=30).status_code == 410
    sids[1] = create(base)  # room for one again
    assert_full()
    server.close()

    # after a restart the recovered sessions count as well
    server = serve(session_server_factory, backend.url, data, 2, "--max-sessions", "3")
    base = server.url
    assert_full(attempts=4)
    for sid in sids:
        records(base, sid)
    server.close()


# -- 7. HEAD, Range, ETag --------------------------------------------------------------------------

def raw_head(base: str, path: str) -> tuple[bytes, bytes]:
    """(status line + headers, whatever followed them) of a HEAD, read to EOF."""
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


@pytest.mark.timeout(90)
def test_records_get_answers_head_range_and_etag(session_server_factory, backend, tmp_path) -> None:
    server = serve(session_server_factory, backend.url, tmp_path / "data", 2)
    base = server.url
    conv = Conversation(create(base), "ranges", words=60)
    for _ in range(3):
        conv.turn(base)
    url = f"{base}/sessions/{conv.sid}"
    full = http("GET", url, timeout=60)
    body = full.content
    assert full.status_code == 200 and len(body) > 2 * MiB  # a streamed records body
    etag = full.headers.get("ETag")
    assert etag, full.headers
    assert http("GET", url, timeout=60).headers.get("ETag") == etag  # stable while nothing changes

    head = http("HEAD", url, timeout=30)
    assert head.status_code == 200 and int(head.headers["Content-Length"]) == len(body)
    assert head.headers.get("ETag") == etag
    status_and_headers, after = raw_head(base, f"/sessions/{conv.sid}")
    assert status_and_headers.startswith(b"HTTP/1.1 200") and after == b""  # no body on the wire

    n = len(body)
    for first, last in ((100, 199), (n // 2 - 5000, n // 2 + 70000), (n - 10, n - 1), (0, 0)):
        part = http("GET", url, headers={"Range": f"bytes={first}-{last}"}, timeout=60)
        assert part.status_code == 206, (first, last, part.status_code)
        assert part.headers["Content-Range"] == f"bytes {first}-{last}/{n}"
        assert int(part.headers["Content-Length"]) == last - first + 1
        assert part.content == body[first:last + 1], (first, last)

    conv.turn(base)
    changed = http("GET", url, timeout=60)
    assert changed.headers.get("ETag") not in (None, etag)
    assert changed.content != body


@pytest.mark.timeout(90)
def test_an_etag_never_names_two_different_bodies(session_server_factory, backend, tmp_path) -> None:
    """A turn a client has seen is lost (its journal entry is damaged: a machine crash without
    --fsync, a bad disk) and the client redoes it: the body differs (new timestamps), so must the
    ETag. The redone body has the old length in ~40% of sessions (the timestamps' digits vary):
    twelve sessions, so some do."""
    data = tmp_path / "data"
    server = serve(session_server_factory, backend.url, data, 1)
    convs = [Conversation(create(server.url), f"etag {i}") for i in range(12)]
    seen = {}
    for conv in convs:
        conv.turn(server.url)
        conv.turn(server.url)
        resp = http("GET", f"{server.url}/sessions/{conv.sid}")
        seen[conv.sid] = (resp.headers["ETag"], resp.content)
    server.close()
    for conv in convs:
        last = read_journal(journal_path(data, conv.sid))[-1]
        with open(journal_path(data, conv.sid), "r+b") as f:
            f.seek(last.offset + ENTRY.size + last.length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))

    server = serve(session_server_factory, backend.url, data, 1)
    now = {}
    for conv in convs:
        conv.rewind(1)
        conv.turn(server.url)  # the lost turn, redone
        resp = http("GET", f"{server.url}/sessions/{conv.sid}")
        now[conv.sid] = (resp.headers["ETag"], resp.content)
        assert now[conv.sid][1] != seen[conv.sid][1]
    same_length = [conv.sid for conv in convs if len(now[conv.sid][1]) == len(seen[conv.sid][1])]
    if not same_length:
        pytest.skip("no redone body had its old length this time")
    for sid in same_length:
        etag, body = seen[sid]
        assert now[sid][0] != etag, (sid, etag)
        # so resuming the old copy gets the new body whole, never a splice of the two
        resumed = http("GET", f"{server.url}/sessions/{sid}",
                       headers={"Range": f"bytes={len(body) // 2}-", "If-Range": etag})
        assert resumed.status_code == 200 and resumed.content == now[sid][1]
    server.close()


# -- 8. worker memory stays flat ------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_worker_rss_stays_flat_while_gigabytes_of_records_go_to_disk(session_server_factory,
                                                                     reference_backend_factory,
                                                                     tmp_path) -> None:
    layers = 512  # ~22 KB of base64 R3 per token: ~15-20 MiB per turn of 700-900 tokens
    target = int(1.25 * 1024 * MiB)
    huge = reference_backend_factory(r3_layers=layers, r3_topk=8)
    data = tmp_path / "data"
    server = serve(session_server_factory, huge.url, data, 1, layers=layers)
    base = server.url
    worker = worker_procs(server, 1)[0]
    samples: list[tuple[int, int]] = []  # (turns done, VmRSS bytes)
    turns_done = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                samples.append((turns_done[0], vm_rss(worker.pid)))
            except OSError:  # the worker is gone: the assertions below say so
                return
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    sids: list[str] = []
    written = 0
    started = time.monotonic()
    try:
        while written < target:
            conv = Conversation(create(base), f"bulk {len(sids)}")
            sids.append(conv.sid)
            # a long first message, short ones after: each turn's record is ~15-20 MiB
            for text in (conv.text() + "open the settings panel " * 20, "now press save", "and close it"):
                resp = conv.say(base, text)
                assert resp.status_code == 200, resp.text[:500]
                turns_done[0] += 1
            written += journal_path(data, conv.sid).stat().st_size
            assert time.monotonic() - started < 120, f"only {written >> 20} MiB written in 120 s"
        body = records(base, sids[-1])  # a records GET of the last session, sampled too
        turns_done[0] += 1
        time.sleep(0.2)
    finally:
        stop.set()
        sampler.join(5)
    assert metadata(body)["num_records"] == 3
    assert worker.is_running() and worker_procs(server, 1)[0].pid == worker.pid  # same process throughout
    total = sum(p.stat().st_size for p in (data / "sessions").glob("*.journal"))
    assert total >= target
    warm = max(rss for turns, rss in samples if turns <= 6)
    peak = max(rss for _turns, rss in samples)
    late = max(rss for turns, rss in samples if turns > turns_done[0] // 2)
    report = f"{total >> 20} MiB of records: warm-up {warm >> 20} MiB, peak {peak >> 20} MiB, late {late >> 20} MiB"
    assert peak < 400 * MiB, report
    assert late - warm < 100 * MiB, report
    for sid in sids:  # and the disk space goes with the sessions
        assert http("DELETE", f"{base}/sessions/{sid}", timeout=30).status_code == 204
    assert list((data / "sessions").glob("*.journal")) == []
    server.close()
