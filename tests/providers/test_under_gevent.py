"""Providers inside a gevent-patched process (the blocking face's headline idiom).

gevent's ``os.close`` defers closing a pipe to the hub's next loop iteration; a daemon reads its
token to EOF, so a write end closed that way left the start waiting on the ready line until
something else woke the hub (a start timed out a few times in a hundred).
"""

from __future__ import annotations

import json

import pytest

from tests.support import clean_stdout, run_script

pytest.importorskip("gevent")

TOKEN_PIPE_SCRIPT = """
    from gevent import monkey; monkey.patch_all()
    import fcntl, json, os
    import gevent
    from shinken_sync.providers.process import DaemonProcess

    gevent.sleep(0)  # the hub runs, as in any program that started a sandbox before

    daemon = DaemonProcess.__new__(DaemonProcess)  # only the token pipe, no child
    daemon.token = "t" * 43
    daemon._prepare()
    fd = daemon._token_fd
    fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)
    got, eof = b"", False
    try:  # no gevent switch between the close and these reads: the hub never runs in between
        while chunk := os.read(fd, 4096):
            got += chunk
        eof = True
    except BlockingIOError:  # the write end is still open
        pass
    print(json.dumps({"token": got.decode(), "eof": eof}))
"""


def test_the_token_pipe_write_end_is_closed_before_the_spawn_under_gevent() -> None:
    out = json.loads(clean_stdout(run_script(TOKEN_PIPE_SCRIPT)))
    assert out == {"token": "t" * 43, "eof": True}
