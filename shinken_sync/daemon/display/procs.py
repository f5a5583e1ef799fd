"""How the Xvfb display and its desktop look at and stop the processes they started.

Neither helper reaps: an exited leader stays a zombie until its owner waits for
it, so its pid (and process group id) cannot be reused while the owner may
still signal that group.
"""

from __future__ import annotations

import os
import subprocess


def exit_status(proc: subprocess.Popen[bytes]) -> str | None:
    """How ``proc`` ended ("exit 1", "signal 9"), or None while it runs; never reaps it."""
    if proc.returncode is not None:  # reaped already (gevent's child watcher does)
        code = proc.returncode
        return f"signal {-code}" if code < 0 else f"exit {code}"
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere
        return "exited"
    if info is None:
        return None
    return f"exit {info.si_status}" if info.si_code == os.CLD_EXITED else f"signal {info.si_status}"


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
