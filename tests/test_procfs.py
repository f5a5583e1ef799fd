"""The one /proc reader (bench/procfs.py) on real processes: alive, zombie, gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench import procfs


def test_a_zombie_is_not_alive_and_a_reaped_process_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while procfs.state(proc.pid) != "Z" and time.monotonic() < deadline:  # exited, not yet reaped
        time.sleep(0.01)
    assert procfs.state(proc.pid) == "Z" and not procfs.alive(proc.pid)
    proc.wait()
    assert procfs.state(proc.pid) is None and not procfs.alive(proc.pid)
    assert procfs.status_bytes(proc.pid, "VmRSS") is None
    assert procfs.cpu_seconds(proc.pid, gone=0.0) == 0.0
    with pytest.raises(FileNotFoundError):
        procfs.cpu_seconds(proc.pid)


def test_this_process_reads_back():
    assert procfs.alive(os.getpid()) and procfs.state("self") in ("R", "S")
    assert procfs.status_bytes("self", "VmRSS") > 1 << 20
    assert procfs.thread_count() >= 1 and procfs.fd_count() >= 3
    before = procfs.cpu_seconds()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert procfs.cpu_seconds() > before
