"""Records GETs paced while their process serves other requests (webapp.send_pace): the pacing
decision with an injected clock, the request count of the WSGI middleware, the setting, and a
paced body's bytes over a real socket from real send threads."""

from __future__ import annotations

import argparse
import json

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
    pacer.pace(5 * MiB, clock())
    assert slept == [pytest.approx(0.1)]  # the budget goes on from the previous write's


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
    # a body sent outside a counting app: never paced
    assert not paced({}).pacer.enabled


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
    pacer = Pacer(64.0, sleep=sleep)  # 64 MiB/s: ~0.2 s for these ~14 MiB while paced
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
