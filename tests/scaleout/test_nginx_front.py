"""Three session server instances, each in its own namespace, behind one nginx (tests/scaleout/front.py).

200 sessions created through nginx spread over the instances; every later request of a
session reaches its owner (nginx's access log names the upstream of each request); one
instance SIGKILLed -> its sessions get a 503 naming it, every other session's turns succeed.
"""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.scaleout.conftest import require_nginx
from tests.scaleout.front import Nginx, UnixHTTPConnection, nginx_front, request

pytestmark = [pytest.mark.scaleout, pytest.mark.integration]

SESSIONS = 200
TAGS = ("alpha", "bravo", "charlie")


@pytest.fixture(scope="module")
def front(hosts):
    require_nginx()
    with nginx_front(hosts, TAGS) as pair:
        yield pair


def _turn(nginx: Nginx, sid: str, messages: list[dict]) -> tuple[int, dict]:
    """One chat turn that extends the session's conversation (``messages``, updated)."""
    messages.append({"role": "user", "content": f"turn {len(messages) // 2} of {sid}"})
    conn = UnixHTTPConnection(nginx.socket)
    try:
        status, body = request(conn, "POST", f"/sessions/{sid}/v1/chat/completions",
                               {"model": "reference", "messages": messages})
    finally:
        conn.close()
    if status == 200:
        messages.append(body["choices"][0]["message"])
    return status, body


def _create(nginx: Nginx) -> str:
    conn = UnixHTTPConnection(nginx.socket)
    try:
        status, body = request(conn, "POST", "/sessions")
    finally:
        conn.close()
    assert status == 200, body
    return body["session_id"]


def test_sessions_spread_stick_to_their_owner_and_a_dead_instance_costs_only_its_own(front):
    nginx, instances = front
    addresses = {inst.tag: inst.url.removeprefix("http://") for inst in instances}
    with ThreadPoolExecutor(16) as pool:
        sids = list(pool.map(lambda _: _create(nginx), range(SESSIONS)))
        owners = Counter(sid.split("-", 1)[0] for sid in sids)
        assert set(owners) == set(TAGS), owners  # POST /sessions landed on every instance
        assert all(count >= SESSIONS // 10 for count in owners.values()), owners
        chats: dict[str, list[dict]] = {sid: [] for sid in sids}
        for _ in range(2):
            replies = list(pool.map(lambda sid: _turn(nginx, sid, chats[sid]), sids))
            assert all(status == 200 for status, _ in replies), [r for r in replies if r[0] != 200][:3]
    conn = UnixHTTPConnection(nginx.socket)
    status, body = request(conn, "GET", f"/sessions/{sids[0]}")
    assert status == 200 and len(body["records"]) == 2
    # Every request of a session went to its owner's upstream, never elsewhere.
    per_session = re.compile(r"^\d+ \w+ /sessions/([a-z0-9]+)-[0-9a-f]+\S* -> (\S+) ")
    routed = [per_session.match(line) for line in nginx.access_log()]
    routed = [m for m in routed if m]
    assert len(routed) >= SESSIONS * 2
    assert all(m.group(2) == addresses[m.group(1)] for m in routed)

    victim = instances[1]
    victim.kill()
    with ThreadPoolExecutor(16) as pool:
        replies = dict(zip(sids, pool.map(lambda sid: _turn(nginx, sid, chats[sid]), sids)))
    for sid, (status, body) in replies.items():
        if sid.startswith(victim.tag + "-"):
            assert status == 503, (sid, status, body)
            assert victim.tag in body["error"] and "unavailable" in body["error"]
        else:
            assert status == 200, (sid, status, body)
    # New sessions keep landing on the live instances.
    fresh = [_create(nginx) for _ in range(6)]
    assert not [sid for sid in fresh if sid.startswith(victim.tag + "-")]
    # An id no instance owns is a clear 404 from nginx itself.
    status, body = request(conn, "GET", "/sessions/nobody-0123")
    assert status == 404 and "no session server instance" in body["error"]
