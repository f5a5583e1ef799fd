"""Records GETs paced while their process serves other requests (webapp.send_pace): the pacing
decision with an injected clock, the request count of the WSGI middleware, the setting, and a
paced body's bytes over a real socket from real send threads."""

from __future__ import annotations

import argparse
import json
import socket
from urllib.parse import urlsplit

import pytest

from webapp.router import RouterConfig
from webapp.send_pace import ENVIRON_KEY, LINGER, PACE_SLICE, MiB, Paced, Pacer, paced
from webapp.settings import BY_NAME, add_arguments, values_from_env


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _pacer(rate_mib_s: float = 100.0) -> tuple[Pacer, Clock, list[float]]:
    clock, slept = Clock(), []
    return Pacer(rate_mib_s, clock=clock, sleep=slept.append), clock, slept


def _request(pacer: Pacer) -> Paced:
    """A request counted as the middleware counts one."""
    handle = Paced(pacer)
    pacer.requests += 1
    return handle


def test_a_get_alone_is_never_paced() -> None:
    pacer, clock, _ = _pacer()
    get = _request(pacer)
    get.body_started()  # the GET's own request is not another one
    for _ in range(100):
        assert pacer.delay(10 * MiB, clock()) == 0.0
        clock.t += 0.001


def test_the_pace_engages_while_another_request_is_in_flight_and_only_then() -> None:
    pacer, clock, slept = _pacer(100.0)
    get = _request(pacer)
    get.body_started()
    chat = _request(pacer)
    # 10 MiB written in no time at 100 MiB/s: 0.1 s owed
    assert pacer.delay(10 * MiB, clock()) == pytest.approx(0.1)
    clock.t += 0.1
    # the next 10 MiB took 0.05 s to write: 0.05 s more
    started = clock()
    clock.t += 0.05
    assert pacer.delay(10 * MiB, started) == pytest.approx(0.05)
    chat.ended()
    clock.t += 0.05
    assert pacer.delay(10 * MiB, clock()) > 0  # the chat ended within LINGER: still paced
    clock.t += LINGER + 1.0
    assert pacer.delay(10 * MiB, clock()) == 0.0  # nothing else in flight: flat out
    # engaging again does not charge the time spent flat out or idle before
    _request(pacer)
    assert pacer.delay(5 * MiB, clock()) == pytest.approx(0.05)
    assert pacer.pace(5 * MiB, clock(), until=clock() + 1.0)
    assert slept == [pytest.approx(0.1)]  # the budget goes on from the previous write's


def test_a_send_thread_never_sleeps_past_its_slice() -> None:
    """However low the rate, a send thread's call ends by ``until`` (the lane's calls stay
    bounded); what is still owed is slept at the start of the next call, before any write."""
    pacer, clock, slept = _pacer(1.0)
    _request(pacer)  # a chat in flight
    assert not pacer.pace(2 * MiB, clock(), until=clock() + 0.2)  # 2 s owed, 0.2 s slept
    assert slept == [pytest.approx(0.2)]
    clock.t += 0.2
    assert pacer.delay(0, 0.0) == pytest.approx(1.8)  # before the next write: still owed
    assert not pacer.pace(0, 0.0, until=clock() + 0.2)
    clock.t += 1.8
    assert pacer.pace(0, 0.0, until=clock() + 0.2)  # paid up: write
    assert slept == [pytest.approx(0.2), pytest.approx(0.2)]


def test_gets_do_not_pace_each_other_and_share_the_rate_under_chats() -> None:
    pacer, clock, _ = _pacer(100.0)
    first, second = _request(pacer), _request(pacer)
    first.body_started()
    second.body_started()
    assert pacer.delay(10 * MiB, clock()) == 0.0
    first.ended()  # a GET that ends does not pace the other one
    assert pacer.delay(10 * MiB, clock()) == 0.0
    third = _request(pacer)
    third.body_started()
    _request(pacer)  # a chat: the two GETs now keep to 100 MiB/s together
    assert pacer.delay(10 * MiB, clock()) == pytest.approx(0.1)
    assert pacer.delay(10 * MiB, clock()) == pytest.approx(0.2)


def test_a_rate_of_zero_never_paces_and_sends_in_whole_calls() -> None:
    pacer, clock, _ = _pacer(0.0)
    _request(pacer)
    _request(pacer)
    assert not pacer.enabled
    assert pacer.delay(1 << 30, clock()) == 0.0
    assert pacer.slice_size(1 << 30) == 1 << 30
    assert _pacer(1.0)[0].slice_size(1 << 30) == PACE_SLICE


def test_the_middleware_counts_requests_until_their_body_is_closed() -> None:
    pacer, clock, _ = _pacer()
    seen: list[Paced] = []

    def app(environ, start_response):
        seen.append(paced(environ))
        if environ.get("fail"):
            raise RuntimeError("boom")
        return [b"x"]

    counted = pacer.counting(app)
    body = counted({}, lambda *a: None)
    assert pacer.requests == 1 and seen[0].pacer is pacer
    assert list(body) == [b"x"]
    assert pacer.requests == 1  # iterated, not yet closed: the server still sends it
    clock.t += 1.0
    body.close()
    body.close()  # a second close counts nothing
    assert pacer.requests == 0 and pacer.others_ended == clock()
    with pytest.raises(RuntimeError):
        counted({"fail": True}, lambda *a: None)
    assert pacer.requests == 0
    # a records body's request: its end does not stamp "another request ended"
    environ: dict = {}
    body = counted(environ, lambda *a: None)
    environ[ENVIRON_KEY].body_started()
    assert pacer.sending == 1
    clock.t += 5.0
    body.close()
    assert pacer.requests == 0 and pacer.sending == 0 and pacer.others_ended == clock() - 5.0
    # a body sent outside a counting app: never paced, and counts nothing
    outside = paced({})
    outside.body_started()
    outside.ended()
    assert not outside.pacer.enabled and (outside.pacer.requests, outside.pacer.sending) == (0, 0)


def test_the_setting_parses_and_refuses_bad_values() -> None:
    setting = BY_NAME["records_get_pace"]
    assert setting.default > 0  # on by default (docs/session-server-ops.md says why)
    assert values_from_env({"SHINKEN_RECORDS_GET_PACE": "0"})["records_get_pace"] == 0.0
    assert values_from_env({"SHINKEN_RECORDS_GET_PACE": " 512.5 "})["records_get_pace"] == 512.5
    for bad in ("-1", "fast", "", "1e"):
        with pytest.raises(ValueError, match="SHINKEN_RECORDS_GET_PACE"):
            values_from_env({"SHINKEN_RECORDS_GET_PACE": bad})
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    assert parser.parse_args(["--records-get-pace", "64"]).records_get_pace == 64.0
    with pytest.raises(argparse.ArgumentError, match=">= 0"):
        parser.parse_args(["--records-get-pace", "-3"])
    env = {"SHINKEN_BACKEND_URL": "http://127.0.0.1:9", "SHINKEN_RECORDS_GET_PACE": "32"}
    assert RouterConfig.from_env(env).records_get_pace == 32.0
    with pytest.raises(ValueError):
        Pacer(-1.0)


PACED_BODY_SCRIPT = """
    from gevent import monkey; monkey.patch_all()
    import json, os, random, socket, sys
    import gevent
    from webapp import filebody
    from webapp.send_pace import ENVIRON_KEY, Pacer

    path = os.path.join(sys.argv[1], "s.journal")
    with open(path, "wb") as f:
        f.write(random.Random(7).randbytes(12 << 20))
    # base64 runs (writev) and a long plain span (sendfile) between JSON glue
    pieces = [b'{"a":"', filebody.B64Span(path, 0, 6 << 20), b'","b":"',
              filebody.FileSpan(path, 6 << 20, 6 << 20), b'"}']
    expected = filebody.read_pieces(pieces)
    others = int(sys.argv[2])

    slept = []
    real_sleep = monkey.get_original("time", "sleep")
    def sleep(seconds):
        slept.append(seconds)
        real_sleep(seconds)
    pacer = Pacer(16.0, sleep=sleep)  # ~0.9 s for these ~14 MiB while paced: calls end paced, resume
    environ = {}
    def app(environ, start_response):
        return [b""]
    counted = pacer.counting(app)
    counted(environ, None)  # the GET's own request, counted
    pacer.requests += others  # chats in flight

    server, client = socket.socketpair()
    got = []
    def drain():
        sock = monkey.get_original("socket", "socket")(fileno=os.dup(client.fileno()))
        sock.setblocking(True)
        while chunk := sock.recv(1 << 20):
            got.append(chunk)
        sock.close()
        done.release()
    done = monkey.get_original("_thread", "allocate_lock")()
    done.acquire()
    monkey.get_original("_thread", "start_new_thread")(drain, ())

    body = filebody._FileBody(pieces, server, environ[ENVIRON_KEY])
    for chunk in body:
        server.sendall(chunk)
    body.close()
    server.shutdown(socket.SHUT_WR)
    while not done.acquire(False):
        gevent.sleep(0.01)
    server.close()
    client.close()
    print(json.dumps({"same": b"".join(got) == expected, "sleeps": len(slept)}))
"""


@pytest.mark.parametrize("others", [1, 0])
def test_a_paced_body_is_byte_identical_and_paced_only_with_others_in_flight(tmp_path, others: int) -> None:
    """Through the real send threads (writev of base64 runs, sendfile of a long span) over a
    socket: the bytes are the same whether paced or not; the send threads sleep only while
    another request is in flight."""
    from tests.support import clean_stdout, run_script

    out = json.loads(clean_stdout(run_script(PACED_BODY_SCRIPT, str(tmp_path), str(others))))
    assert out["same"]
    if others:
        assert out["sleeps"] > 0
    else:
        assert out["sleeps"] == 0


# -- a real server ----------------------------------------------------------------------------------

def _held_request(url: str, sid: str) -> socket.socket:
    """A chat whose client sent its head and a few bytes of its body: a request in flight in
    the process that sends records GETs (it reads the body) until the socket closes."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"mess".encode())
    return sock


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_records_get_paced_under_a_request_in_flight_is_byte_identical(workers, reference_backend_factory,
                                                                         session_server_factory, tmp_path) -> None:
    """Both server modes at a pace of 4 MiB/s: the GET answered while another request is in
    flight (paced) is the same bytes as the GET answered alone, whole and as a range."""
    from tests.webapp.test_journal_recovery import Conversation, create, http, records

    backend = reference_backend_factory(r3_layers=64, r3_topk=8)  # ~1-3 MiB of records per turn
    server = session_server_factory.launch(workers, backend.url, "--data-dir", str(tmp_path / "data"),
                                           "--routing-replay-layers", "64", "--records-get-pace", "4")
    conv = Conversation(create(server.url), "paced")
    for _ in range(2):
        conv.turn(server.url)
    alone = records(server.url, conv.sid)
    assert len(alone) > 2 * MiB
    held = _held_request(server.url, create(server.url))
    try:
        paced_body = records(server.url, conv.sid)
        ranged = http("GET", f"{server.url}/sessions/{conv.sid}", headers={"Range": "bytes=1000-2999999"})
    finally:
        held.close()
    assert paced_body == alone
    assert ranged.status_code == 206 and ranged.content == alone[1000:3000000]
