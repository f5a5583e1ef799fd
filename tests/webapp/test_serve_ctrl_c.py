"""A terminal's Ctrl-C on ``shinken-session-server`` (SIGINT to its whole process group) is a
clean stop: exit 0, the embedded backend is not restarted on the way out (it used to print
``embedded backend exited with code 0; restarting it``), no traceback from gunicorn's worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.support import start_process
from webapp.serve import server_argv

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("workers", [0, 2])
def test_ctrl_c_stops_the_server_cleanly(workers, tmp_path):
    proc = start_process(server_argv(workers, None, "127.0.0.1:0", "--data-dir", str(tmp_path / "data")),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert json.loads(proc.stdout.readline())["ready"] is True
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "restarting" not in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
