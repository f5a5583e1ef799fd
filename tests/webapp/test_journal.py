"""The session journal (webapp.journal) in-process: format, recovery, torn tails, write errors.

Every core here writes under ``tmp_path``. The end-to-end paths (a SIGKILLed worker, a whole
server restart, re-sharding, a full tmpfs) are in test_journal_recovery.py.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib

import pytest

from webapp.core import SessionCore, SessionRegistry
from webapp.filebody import FileSpan, decode_layout, encode_layout, file_response, read_pieces, slice_pieces
from webapp.journal import ENTRY_HEADER, FILE_HEADER, FORMAT_VERSION, MAGIC, READ_VERSIONS, JournalStore, Kind
from webapp.sharding import shard_for

from .test_core import R3, TOK, WAIT, FakeBackend, body_of, chat, error_of, new_session

PNG_1x1 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")


def core_on(data_dir, backend=None, owns=lambda sid: True, fsync=False) -> SessionCore:
    registry = SessionRegistry(JournalStore(str(data_dir), fsync=fsync))
    registry.restore(owns)
    return SessionCore(TOK, backend or FakeBackend(), registry=registry, turn_wait_timeout=WAIT,
                       routing_replay_layers=R3.layers)


def play(core: SessionCore, sid: str, turns: int, start: list | None = None) -> list:
    """``turns`` chats appending a user message each time; returns the conversation."""
    msgs = list(start or [])
    for i in range(turns):
        msgs.append({"role": "user", "content": f"step {i} of {sid[:6]}"})
        reply = chat(core, sid, msgs)
        assert reply.status == 200, reply.read()
        msgs.append(body_of(reply)["choices"][0]["message"])
    return msgs


def entries(path) -> list[tuple[int, Kind, int]]:
    """(offset, kind, total size) of each entry, read with the documented format alone."""
    data = path.read_bytes()
    assert FILE_HEADER.unpack(data[:FILE_HEADER.size]) == (MAGIC, FORMAT_VERSION)
    out, pos = [], FILE_HEADER.size
    while pos < len(data):
        length, kind, crc = ENTRY_HEADER.unpack_from(data, pos)
        payload = data[pos + ENTRY_HEADER.size:pos + ENTRY_HEADER.size + length]
        assert zlib.crc32(bytes((kind,)) + payload) == crc
        out.append((pos, Kind(kind), ENTRY_HEADER.size + length))
        pos += ENTRY_HEADER.size + length
    assert pos == len(data)
    return out


def test_restart_serves_the_same_bytes_and_continues_with_the_same_token_ids(tmp_path):
    core = core_on(tmp_path)
    sids = [new_session(core) for _ in range(3)]
    convs = {sid: play(core, sid, 3) for sid in sids}
    before = {sid: core.get_session(sid).read() for sid in sids}
    core.close()

    again = core_on(tmp_path)
    for sid in sids:
        assert again.get_session(sid).read() == before[sid]
        old_ids = body_of(again.get_session(sid))["metadata"]["accumulated_token_ids"]
        play(again, sid, 1, convs[sid])
        after = body_of(again.get_session(sid))
        assert after["metadata"]["accumulated_token_ids"][:len(old_ids)] == old_ids
        assert len(after["records"]) == 4
        assert after["metadata"]["tito_session_mismatch"] == body_of(again.get_session(sid))["metadata"][
            "tito_session_mismatch"] == []


def test_the_file_is_the_documented_format_and_a_turn_stores_what_it_adds(tmp_path):
    core = core_on(tmp_path)
    sid = new_session(core)
    play(core, sid, 2)
    path = tmp_path / "sessions" / f"{sid}.journal"
    found = entries(path)
    assert [kind for _pos, kind, _size in found] == [Kind.CREATE, Kind.DELTA, Kind.DELTA]
    records = body_of(core.get_session(sid))["records"]
    data = path.read_bytes()
    pos, _kind, size = found[2]
    (meta_len,) = struct.unpack_from("<I", data, pos + ENTRY_HEADER.size)
    meta = json.loads(data[pos + ENTRY_HEADER.size + 4:pos + ENTRY_HEADER.size + 4 + meta_len])
    # The documented meta: the token ids as a prefix kept plus u32s, the record as fields.
    assert meta["ids"][0] == records[0]["request"]["input_ids"].__len__() + len(
        records[0]["response"]["choices"][0]["meta_info"]["output_token_logprobs"])
    assert [f[0] for f in meta["fields"]] == ["t", "t", "i", "t", "r", "t"]
    # What the second turn adds: its request shares the first's messages (prefix) and the
    # fields after them (suffix); its R3 holds only the rows past the first turn's.
    _t, prefix, suffix, _n = meta["fields"][1]
    assert prefix > 0 and suffix > 0
    row = 4 * R3.layers * R3.top_k
    first_rows = meta["ids"][0] - 1  # the first turn's prompt + output - 1
    r3 = next(f for f in meta["fields"] if f[0] == "r")
    assert r3[1] == "routed_experts" and r3[2] == first_rows * row // 3 * 3
    second_rows = len(records[1]["request"]["input_ids"]) + len(
        records[1]["response"]["choices"][0]["meta_info"]["output_token_logprobs"]) - 1
    assert r3[3] == second_rows * row - r3[2]
    assert size < len(json.dumps(records[1], separators=(",", ":")))


def test_rollback_replays_to_the_same_records_and_state(tmp_path):
    core = core_on(tmp_path)
    sid = new_session(core)
    first = [{"role": "user", "content": "a"}]
    r1 = body_of(chat(core, sid, first))["choices"][0]["message"]
    second = first + [r1, {"role": "user", "content": "b"}]
    assert chat(core, sid, second).status == 200
    assert chat(core, sid, second).status == 200  # regenerate: replaces the last record
    before = core.get_session(sid).read()
    again = core_on(tmp_path)
    assert again.get_session(sid).read() == before
    assert body_of(again.get_session(sid))["metadata"]["num_rollbacks"] == 1
    assert chat(again, sid, second).status == 200  # the restored previous state allows it again


@pytest.mark.parametrize("damage", ["short_header", "length_past_end", "bad_crc", "unknown_kind", "half_turn"])
def test_a_torn_tail_is_cut_logged_and_never_served(tmp_path, caplog, damage):
    core = core_on(tmp_path)
    sid = new_session(core)
    msgs = play(core, sid, 2)
    path = tmp_path / "sessions" / f"{sid}.journal"
    good = path.stat().st_size
    before = core.get_session(sid).read()
    with open(path, "r+b") as f:
        if damage == "short_header":
            f.seek(0, 2)
            f.write(b"\x07\x00\x00")
        elif damage == "length_past_end":
            f.seek(0, 2)
            f.write(ENTRY_HEADER.pack(1 << 20, Kind.TURN, 0) + b"x" * 100)
        elif damage == "bad_crc":  # the last turn's payload flipped: that whole turn goes
            last_pos, _kind, _size = entries(path)[-1]
            f.seek(good - 10)
            byte = f.read(1)
            f.seek(good - 10)
            f.write(bytes((byte[0] ^ 0xFF,)))
            good = last_pos
        elif damage == "unknown_kind":
            f.seek(0, 2)
            f.write(ENTRY_HEADER.pack(2, 99, zlib.crc32(bytes((99,)) + b"{}")) + b"{}")
        elif damage == "half_turn":  # a crash mid-append: the last turn's first half only
            last_pos, _kind, size = entries(path)[-1]
            f.truncate(last_pos + size // 2)
            good = last_pos
    with caplog.at_level(logging.WARNING, logger="webapp.journal"):
        again = core_on(tmp_path)
    assert "torn tail" in caplog.text and str(path) in caplog.text
    assert path.stat().st_size == good
    got = again.get_session(sid)
    assert got.status == 200
    if damage in ("bad_crc", "half_turn"):
        assert len(body_of(got)["records"]) == 1  # the torn turn is not served
        msgs = msgs[:2]  # what the session holds now: its first turn
    else:
        assert got.read() == before
    play(again, sid, 1, msgs)  # the session continues from what it holds


def test_trailing_images_without_their_turn_are_an_unfinished_commit(tmp_path, caplog):
    core = core_on(tmp_path)
    sid = new_session(core)
    play(core, sid, 1)
    path = tmp_path / "sessions" / f"{sid}.journal"
    good = path.stat().st_size
    before = core.get_session(sid).read()
    meta = json.dumps({"sha256": "0" * 64, "mime_type": "image/png", "width": 1, "height": 1}).encode()
    payload = struct.pack("<I", len(meta)) + meta + b"\x89PNG"
    with open(path, "ab") as f:
        f.write(ENTRY_HEADER.pack(len(payload), Kind.IMAGE, zlib.crc32(bytes((Kind.IMAGE,)) + payload)) + payload)
    with caplog.at_level(logging.WARNING, logger="webapp.journal"):
        again = core_on(tmp_path)
    assert "images without the turn" in caplog.text
    assert path.stat().st_size == good and again.get_session(sid).read() == before


def test_images_survive_a_restart_and_stay_out_of_memory(tmp_path):
    core = core_on(tmp_path)
    sid = new_session(core)
    url = f"data:image/png;base64,{PNG_1x1}"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    assert chat(core, sid, msgs).status == 200
    session = core.registry.get(sid)
    (image,) = session.images.values()
    assert isinstance(image.span, FileSpan)  # the bytes are in the journal, not in the session
    before = core.get_session(sid, include_images=True).read()
    again = core_on(tmp_path)
    assert again.get_session(sid, include_images=True).read() == before
    assert again.samples(sid, b"{}", include_images=True).status == 200


def _played(tmp_path, turns: int):
    """``(core, session id, its messages, its journal, the journal's size, the session's GET)``
    after ``turns`` turns."""
    core = core_on(tmp_path)
    sid = new_session(core)
    msgs = play(core, sid, turns)
    path = tmp_path / "sessions" / f"{sid}.journal"
    return core, sid, msgs, path, path.stat().st_size, core.get_session(sid).read()


def test_a_write_error_is_507_and_commits_nothing(tmp_path, monkeypatch):
    core, sid, msgs, path, size, before = _played(tmp_path, 1)
    real = os.pwritev

    def half_then_full(fd, buffers, offset):  # part of the turn lands, then the disk is full
        if not getattr(half_then_full, "done", False):
            half_then_full.done = True
            return real(fd, [bytes(buffers[0])[:5]], offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", half_then_full)
    msgs.append({"role": "user", "content": "next"})
    reply = chat(core, sid, msgs)
    assert reply.status == 507
    assert body_of(reply)["error"]["code"] == "insufficient_storage" and "No space" in error_of(reply)
    assert path.stat().st_size == size  # cut back: no half turn on disk
    assert core.get_session(sid).read() == before  # nor in memory
    monkeypatch.setattr(os, "pwritev", real)
    assert chat(core, sid, msgs).status == 200  # room again: the same turn goes through
    assert len(body_of(core.get_session(sid))["records"]) == 2


class _Interrupted(BaseException):
    """What a kill or a gevent.Timeout raises into the greenlet making a turn."""


def test_a_turn_interrupted_after_its_write_leaves_no_bytes_behind(tmp_path, monkeypatch):
    core, sid, msgs, path, size, before = _played(tmp_path, 2)
    real = os.pwritev

    def written_then_interrupted(fd, buffers, offset):  # the whole turn lands, then the kill
        real(fd, buffers, offset)
        raise _Interrupted

    monkeypatch.setattr(os, "pwritev", written_then_interrupted)
    longer = [*msgs, {"role": "user", "content": "a long next message " * 50}]
    with pytest.raises(_Interrupted):
        chat(core, sid, longer)
    assert path.stat().st_size == size  # not committed: not on disk either
    assert core.get_session(sid).read() == before
    monkeypatch.setattr(os, "pwritev", real)
    msgs.append({"role": "user", "content": "short"})
    assert chat(core, sid, msgs).status == 200  # shorter than the one cut: no tail of it left
    assert len(body_of(core_on(tmp_path).get_session(sid))["records"]) == 3  # a restart reads it whole


def test_create_on_a_full_disk_is_507_and_leaves_no_file(tmp_path, monkeypatch):
    core = core_on(tmp_path)
    monkeypatch.setattr(os, "pwritev", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    reply = core.create_session()
    assert reply.status == 507 and "No space" in body_of(reply)["error"]
    assert list((tmp_path / "sessions").iterdir()) == []


def test_create_whose_directory_fsync_fails_is_507_and_leaves_no_file(tmp_path, monkeypatch):
    core = core_on(tmp_path, fsync=True)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the file's own fsync works; the directory's fails
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    reply = core.create_session()
    assert reply.status == 507 and "Input/output error" in body_of(reply)["error"]
    assert list((tmp_path / "sessions").iterdir()) == []


def test_delete_removes_the_file_and_max_sessions_counts_the_directory(tmp_path):
    core = core_on(tmp_path)
    sid = new_session(core)
    path = tmp_path / "sessions" / f"{sid}.journal"
    assert path.exists()
    assert core.delete_session(sid).status == 204
    assert not path.exists()
    # Two cores on one directory (two workers of one server) share one max_sessions count.
    shard0 = core_on(tmp_path, owns=lambda s: shard_for(s, 2) == 0)
    shard1 = core_on(tmp_path, owns=lambda s: shard_for(s, 2) == 1)
    for c in (shard0, shard1):
        c.expiry.max_sessions = 3
    assert shard0.create_session().status == 200 and shard1.create_session().status == 200
    assert shard0.create_session().status == 200
    refused = shard1.create_session()
    assert refused.status == 429 and "max_sessions" in body_of(refused)["error"]


def test_a_file_of_another_format_version_is_left_alone(tmp_path, caplog):
    core_on(tmp_path)
    path = tmp_path / "sessions" / "future.journal"
    path.write_bytes(FILE_HEADER.pack(MAGIC, max(READ_VERSIONS) + 1) + b"whatever")
    with caplog.at_level(logging.ERROR, logger="webapp.journal"):
        core = core_on(tmp_path)
    assert "format version" in caplog.text
    assert core.get_session("future").status == 404
    assert path.read_bytes().endswith(b"whatever")  # untouched


def test_workers_restore_only_their_shard(tmp_path):
    core = core_on(tmp_path)
    sids = [new_session(core) for _ in range(8)]
    for n in (2, 3):
        cores = [core_on(tmp_path, owns=lambda s, k=k, n=n: shard_for(s, n) == k) for k in range(n)]
        for sid in sids:
            owner = shard_for(sid, n)
            for k, c in enumerate(cores):
                assert c.get_session(sid).status == (200 if k == owner else 404)


def test_file_layout_round_trip_and_ranges(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 4)
    pieces = [b"head", FileSpan(str(path), 10, 100), b",", FileSpan(str(path), 500, 7), b"tail"]
    whole = read_pieces(pieces)
    inline, layout = encode_layout(pieces)
    assert inline == b"head,tail" and read_pieces(decode_layout(inline, layout)) == whole
    # the inline pieces are views of the one inline buffer, not copies (a long GET's ids text)
    decoded = decode_layout(inline, layout)
    assert [p.obj for p in decoded if isinstance(p, memoryview)] == [inline] * 3
    for start, stop in [(0, 4), (2, 50), (3, 110), (104, 105), (0, len(whole)), (110, len(whole))]:
        assert read_pieces(slice_pieces(pieces, start, stop)) == whole[start:stop]
    with pytest.raises(ValueError):
        decode_layout(inline, {"path": str(path), "pieces": [4, [1, -1]]})
    with pytest.raises(ValueError):
        decode_layout(b"short", layout)


def test_the_etag_names_the_version_even_when_a_cut_tail_is_rewritten(tmp_path):
    core = core_on(tmp_path)
    sid = new_session(core)
    msgs = play(core, sid, 2)
    etag_before = dict(core.get_session(sid).headers)["ETag"]
    path = tmp_path / "sessions" / f"{sid}.journal"
    last_pos, _kind, _size = entries(path)[-1]
    with open(path, "r+b") as f:  # what a machine crash without --fsync may leave: turn 2 half gone
        f.truncate(last_pos + 20)
    again = core_on(tmp_path)
    play(again, sid, 1, msgs[:2])  # the same turn again: same length, other timestamps
    assert path.stat().st_size == entries(path)[-1][0] + entries(path)[-1][2]
    assert dict(again.get_session(sid).headers)["ETag"] != etag_before


@pytest.mark.parametrize(("headers", "status", "span"), [
    ({}, 200, None),
    ({"HTTP_RANGE": "bytes=2-5"}, 206, (2, 6)),
    ({"HTTP_RANGE": "bytes=-3"}, 206, (-3, None)),
    ({"HTTP_RANGE": "bytes=100000-"}, 416, None),
    ({"HTTP_RANGE": "items=0-5"}, 200, None),  # another unit: ignored (RFC 9110 14.2)
    ({"HTTP_RANGE": "bytes=0-1,5-6"}, 200, None),  # several ranges: ignored, the whole body
    ({"HTTP_RANGE": "bytes=2-5", "HTTP_IF_RANGE": '"v1"'}, 206, (2, 6)),
    ({"HTTP_RANGE": "bytes=2-5", "HTTP_IF_RANGE": '"v0"'}, 200, None),  # changed since: whole body
])
def test_file_response_ranges(tmp_path, headers, status, span):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(200)))
    pieces = [b"{head}", FileSpan(str(path), 0, 200), b"{tail}"]
    whole = read_pieces(pieces)
    response = file_response(pieces, status=200, content_type="application/json", headers=[("ETag", '"v1"')],
                             environ={"REQUEST_METHOD": "GET", **headers})
    assert response.status_code == status
    body = b"".join(response.response) if status != 416 else b""
    response.close()
    if status == 200:
        assert body == whole and response.headers["Content-Length"] == str(len(whole))
    elif status == 206:
        start, stop = span
        assert body == whole[start:stop]
        assert response.headers["Content-Range"].endswith(f"/{len(whole)}")
    else:
        assert response.headers["Content-Range"] == f"bytes */{len(whole)}"


def test_usage_counts_across_a_fork_each_process_with_its_own_lock(tmp_path) -> None:
    """The usage counter keeps its files open; a forked child opens its own (a shared open file
    description would share the parent's flock), and the counts of both processes add up."""
    store = JournalStore(str(tmp_path / "data"))
    store.usage.add(1, 10)
    parent_fds = store.usage._fds
    pid = os.fork()
    if pid == 0:  # the child: its add must not reuse the parent's descriptors
        code = 4
        try:
            store.usage.add(1, 5)
            code = 0 if store.usage._fds is not None and store.usage._fds[0] == os.getpid() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.usage._fds == parent_fds
    assert store.usage.read() == (2, 15)
    store.usage.close()
    assert store.usage._fds is None and store.usage.read() == (2, 15)  # opened again


def test_read_pieces_of_many_spans_of_one_file(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 4)
    spans = [FileSpan(str(path), off, 7) for off in range(0, 1000, 100)]
    assert read_pieces([b"<", *spans, b">"]) == b"<" + b"".join(path.read_bytes()[o:o + 7] for o in range(0, 1000, 100)) + b">"


def _reads_of_one_more_turn(data_dir, monkeypatch, known_bytes: int) -> tuple[int, bytes, bytes]:
    from webapp import journal

    monkeypatch.setattr(journal, "_KNOWN_BYTES", known_bytes)
    core = core_on(data_dir)
    sid = new_session(core)
    msgs = play(core, sid, 2)
    calls = []
    real = journal.read_pieces

    def counting(pieces, open_fds=None):
        calls.append(1)
        return real(pieces, open_fds)

    monkeypatch.setattr(journal, "read_pieces", counting)
    play(core, sid, 1, msgs)
    monkeypatch.setattr(journal, "read_pieces", real)
    served = core.get_session(sid).read()
    core.close()
    again = core_on(data_dir)
    restored = again.get_session(sid).read()
    again.close()
    return len(calls), served, restored


def test_a_commit_takes_its_delta_against_the_last_record_in_memory(tmp_path, monkeypatch):
    """The last committed record's text fields are kept (bounded), so the next turn's delta does
    not read them back from the journal; what is stored and served is the same either way."""
    cached, served, restored = _reads_of_one_more_turn(tmp_path / "a", monkeypatch, 64 << 10)
    uncached, served_u, restored_u = _reads_of_one_more_turn(tmp_path / "b", monkeypatch, -1)
    assert uncached > 0 and cached < uncached
    assert served == restored and served_u == restored_u
