"""The viewer's pieces without a browser: the list's paging/sorting rules and the fleet hub's
bounds (frame types and sizes, the hub's byte budget, focus, long polls, expiry)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from shinken_sync.fleet_wire import BatchError, FrameItem, decode_batch, encode_batch
from webapp import viewer_fleet
from webapp.viewer_fleet import FleetHub, FleetNotFound, FrameRefused
from webapp.viewer_shape import SUMMARY_FIELDS, ViewerQueryError, is_viewer_path, page_of


def _rows() -> list[dict]:
    return [{"session_id": f"s{i}", "turns": i % 3, "tokens": 10 * i, "images": 0, "rollbacks": 0,
             "created": 100.0 + i, "last_turn": None if i == 0 else 200.0 - i, "status": "idle",
             "instance": None} for i in range(7)]


def test_rows_carry_exactly_the_declared_fields() -> None:
    assert all(set(r) == set(SUMMARY_FIELDS) for r in _rows())


def test_page_of_sorts_pages_and_filters() -> None:
    page = page_of(_rows(), {"sort": "created", "order": "asc", "limit": "3", "offset": "2"})
    assert [r["session_id"] for r in page["sessions"]] == ["s2", "s3", "s4"] and page["total"] == 7
    by_turns = page_of(_rows(), {"sort": "turns"})["sessions"]
    assert [r["turns"] for r in by_turns] == sorted((r["turns"] for r in _rows()), reverse=True)
    # No turn yet sorts last in a descending list of last turns, first in an ascending one.
    assert page_of(_rows(), {"sort": "last_turn"})["sessions"][-1]["session_id"] == "s0"
    assert page_of(_rows(), {"sort": "last_turn", "order": "asc"})["sessions"][0]["session_id"] == "s0"
    assert page_of(_rows(), {"prefix": "s6"})["total"] == 1


@pytest.mark.parametrize("args", [{"sort": "password"}, {"order": "up"}, {"limit": "0"}, {"limit": "501"},
                                  {"offset": "-1"}, {"offset": "x"}])
def test_page_of_refuses_bad_queries(args: dict) -> None:
    with pytest.raises(ViewerQueryError):
        page_of(_rows(), args)


def test_viewer_paths() -> None:
    assert is_viewer_path("/ui") and is_viewer_path("/ui/sessions/x")
    assert not is_viewer_path("/uix") and not is_viewer_path("/sessions/ui")


def _fleet(hub: FleetHub, n: int = 2) -> str:
    return hub.register("f", [{"tile_id": f"t{i}", "label": f"tile {i}"} for i in range(n)])["fleet_id"]


def test_hub_takes_only_images_within_its_bounds() -> None:
    hub = FleetHub(max_bytes=1000)
    fid = _fleet(hub)
    with pytest.raises(FrameRefused):
        hub.push(fid, "t0", b"<script>", "text/html", 1, 1)
    with pytest.raises(FrameRefused):
        hub.push(fid, "t0", b"", "image/png", 1, 1)
    with pytest.raises(FleetNotFound):
        hub.push(fid, "nope", b"x", "image/png", 1, 1)
    hub.push(fid, "t0", b"x" * 600, "image/png", 1, 1)
    with pytest.raises(FrameRefused):  # the two tiles together would pass the budget
        hub.push(fid, "t1", b"x" * 600, "image/png", 1, 1)
    with pytest.raises(FrameRefused):  # all or none: the good frame of a bad batch is not taken
        hub.push_many(fid, [("t1", b"y", "image/png", 1, 1), ("t0", b"<p>", "text/html", 1, 1)])
    assert hub.frame(fid, "t1").seq == 0
    hub.push(fid, "t0", b"x" * 100, "image/png", 1, 1)  # a replaced frame frees its bytes
    hub.push(fid, "t1", b"x" * 600, "image/png", 1, 1)
    assert hub.held == 700
    hub.unregister(fid)
    assert hub.held == 0
    with pytest.raises(FrameRefused):
        hub.register("f", [])
    with pytest.raises(FrameRefused):
        hub.register("f", [{"tile_id": 3}])


def test_focus_is_the_tile_watched_live_lately(monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FleetHub()
    fid = _fleet(hub)
    assert hub.push(fid, "t0", b"a", "image/jpeg", 1, 1)["focus"] is None
    hub.frame(fid, "t1", live=True)
    assert hub.push(fid, "t0", b"b", "image/jpeg", 1, 1)["focus"] == "t1"
    monkeypatch.setattr(viewer_fleet, "FOCUS_TTL", 0.0)
    assert hub.heartbeat(fid)["focus"] is None


def test_frame_batches_round_trip_and_refuse_what_does_not_parse() -> None:
    frames = [FrameItem("a", "image/png", 3, 4, b"\x89PNG..."), FrameItem("b", "image/jpeg", 0, 0, b"")]
    assert decode_batch(encode_batch(frames), 4) == frames
    body = encode_batch(frames)
    for bad in (b"", body[:3], body[:-1], body + b"x", b"\x00\x00\x00\x02[]", b"\xff\xff\xff\xff"):
        with pytest.raises(BatchError):
            decode_batch(bad, 4)
    with pytest.raises(BatchError):
        decode_batch(body, 1)


def test_long_poll_wakes_on_the_next_frame() -> None:
    hub = FleetHub()
    fid = _fleet(hub)
    hub.push(fid, "t0", b"1", "image/jpeg", 1, 1)
    threading.Timer(0.2, hub.push, (fid, "t0", b"2", "image/jpeg", 1, 1)).start()
    t0 = time.monotonic()
    tile = hub.frame(fid, "t0", after=1, wait=5.0)
    assert tile.seq == 2 and tile.data == b"2" and time.monotonic() - t0 < 2.0
    assert hub.frame(fid, "t0", after=2, wait=0.05).seq == 2  # no newer frame: the current one


def test_silent_fleets_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FleetHub()
    fid = _fleet(hub)
    hub.push(fid, "t0", b"abc", "image/jpeg", 1, 1)
    monkeypatch.setattr(viewer_fleet, "FLEET_TTL", -1.0)
    assert hub.fleets() == [] and hub.held == 0
    with pytest.raises(FleetNotFound):
        hub.get(fid)


@pytest.fixture
def core_with_a_session(backend, tmp_path):
    from tests.viewer_rollout import image_part, screenshot_png
    from webapp.core import CoreConfig, build_session_core

    core = build_session_core(CoreConfig(backend.url, data_dir=str(tmp_path)))
    sid = json.loads(core.create_session().read())["session_id"]
    messages: list[dict] = [{"role": "system", "content": "s"}]
    for i in range(3):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"t{i}"},
                                                     image_part(screenshot_png(i))]})
        reply = json.loads(core.chat(sid, json.dumps({"messages": messages}).encode()).read())
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    yield core, sid
    core.close()


def test_concurrent_viewers_share_one_timeline_build(core_with_a_session, monkeypatch) -> None:
    from webapp.viewer_data import ViewerData

    core, sid = core_with_a_session
    data = ViewerData(core)
    builds = []
    real = data._encoded

    def slow(*args):
        builds.append(1)
        time.sleep(0.3)  # long enough for every other viewer to arrive while it builds
        return real(*args)

    monkeypatch.setattr(data, "_encoded", slow)
    bodies: list[bytes] = []
    threads = [threading.Thread(target=lambda: bodies.append(data.timeline(sid).read())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(set(bodies)) == 1 and json.loads(bodies[0])["summary"]["turns"] == 3


def test_a_failed_build_answers_500_and_is_not_cached(core_with_a_session, monkeypatch) -> None:
    from webapp.viewer_data import ViewerData

    core, sid = core_with_a_session
    data = ViewerData(core)
    real = data._build
    monkeypatch.setattr(data, "_build", lambda *a: 1 / 0)
    assert data.timeline(sid).status == 500
    monkeypatch.setattr(data, "_build", real)
    assert data.timeline(sid).status == 200


def test_timeline_skips_the_ids_unread_and_matches_the_records(core_with_a_session, monkeypatch) -> None:
    """The length-skipped parse gives the same messages as parsing each record whole."""
    from webapp import viewer_data

    core, sid = core_with_a_session
    parsed: list[bytes] = []
    real_parsed = viewer_data._parsed
    monkeypatch.setattr(viewer_data, "_parsed", lambda data: (parsed.append(data), real_parsed(data))[1])
    fast = json.loads(viewer_data.ViewerData(core).timeline(sid).read())
    assert len(parsed) == 3 and all(b'"input_ids":[]' in d for d in parsed)  # the ids were cut, not parsed
    # The same timeline from each record parsed whole, ids and replay payloads included.
    from webapp.filebody import read_pieces
    from webapp.records import IdsText

    _records, state, _rollbacks, _version = core.registry.get(sid).snapshot()
    ids = IdsText(state.token_ids)
    monkeypatch.setattr(viewer_data, "_load_record",
                        lambda turn, _ids_bytes: real_parsed(read_pieces(turn.record.pieces(ids.prefix))))
    whole = json.loads(viewer_data.ViewerData(core).timeline(sid).read())
    assert fast == whole and [len(t["messages"]) for t in fast["turns"]] == [2, 1, 1]
    records = json.loads(core.get_session(sid).read())["records"]
    assert [t["reply"]["parts"][0]["text"] for t in fast["turns"]] == [
        r["response"]["choices"][0]["message"]["content"] for r in records]


def test_timelines_of_format_1_journals_match_their_records(tmp_path) -> None:
    """A data dir written by the first journal format (its records one text each, ids and R3
    inside): the timeline skips them by length and says what the records GET says."""
    import shutil

    from tests.webapp import journal_conversations as jc
    from webapp.viewer_data import ViewerData

    fixture = Path(__file__).parent / "journal_v1" / "data"
    shutil.copytree(fixture, tmp_path / "data")
    core = jc.core_on(str(tmp_path / "data"))
    try:
        data = ViewerData(core)
        sids = sorted(core.registry.ids())
        assert sids, "the fixture holds sessions"
        for sid in sids:
            timeline = json.loads(data.timeline(sid).read())
            records = json.loads(core.get_session(sid).read())["records"]
            assert timeline["summary"]["turns"] == len(records) == len(timeline["turns"])
            assert [t["reply"]["parts"][0]["text"] if t["reply"]["parts"] else "" for t in timeline["turns"]] == [
                r["response"]["choices"][0]["message"]["content"] or "" for r in records], sid
    finally:
        core.close()
