"""LocalProvider, LocalFleetProvider and StaticProvider lifecycles: nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bench import procfs
from shinken_sync import protocol
from shinken_sync.providers import (
    DaemonStartError,
    Liveness,
    LocalFleetProvider,
    LocalProvider,
    ProviderExhausted,
    StaticProvider,
    UnknownHandle,
)
from tests.support import start_process

pytestmark = pytest.mark.integration

SCREEN = (1024, 768)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not procfs.alive(pid):  # a zombie (exited, not yet reaped) is gone for our purposes
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def test_local_provider_lifecycle(aci):
    with LocalProvider(screen=SCREEN) as provider:
        a, b = provider.create_many(2, parallelism=2)
        assert a.url != b.url and a.token != b.token
        for handle in (a, b):
            url, token = provider.endpoint(handle)
            client = aci(url, token)
            assert (client.hello.width, client.hello.height) == SCREEN
            assert client.hello.sandbox_id == handle.sandbox_id
            assert provider.check_alive(handle) == Liveness(alive=True)
        pids = [a.pid, b.pid]
        provider.destroy(a)
        assert _gone(a.pid)
        assert provider.check_alive(a).alive is False
        provider.destroy(a)  # idempotent
    assert all(_gone(pid) for pid in pids)


def test_the_token_is_in_no_file_argument_or_environment():
    with LocalProvider(screen=SCREEN) as provider:
        handle = provider.create()
        # it came through a pipe the daemon read to EOF and closed before binding
        for name in ("cmdline", "environ"):
            with open(f"/proc/{handle.pid}/{name}", "rb") as f:
                text = f.read().decode(errors="replace")
            assert handle.token not in text and "--token-file" not in text and "SHINKEND_TOKEN" not in text
        fds = [os.readlink(f"/proc/{handle.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{handle.pid}/fd")]
        assert len([fd for fd in fds if fd.startswith("pipe:")]) <= 1  # stdout only (stderr is a file)
        assert handle.daemon._token_fd is None


def test_check_alive_reports_the_killing_signal():
    with LocalProvider(screen=SCREEN) as provider:
        handle = provider.create()
        os.kill(handle.pid, signal.SIGKILL)
        assert _gone(handle.pid)
        handle.daemon.process.wait(10)
        liveness = provider.check_alive(handle)
        assert liveness.alive is False and liveness.signal == signal.SIGKILL and liveness.exit_code is None
        assert "SIGKILL" in liveness.detail and liveness.oom is False

        other = provider.create()
        os.kill(other.pid, signal.SIGTERM)  # a clean stop is an exit, code 0
        other.daemon.process.wait(15)
        assert provider.check_alive(other) == Liveness(alive=False, exit_code=0, detail="shinkend exited with code 0")


@pytest.mark.parametrize("oom_kills_after", [0, 1])
def test_a_sigkill_is_an_oom_kill_only_when_the_memory_cgroup_counted_one(tmp_path, monkeypatch, oom_kills_after):
    from shinken_sync.providers import process

    counter = tmp_path / "memory.events"  # the cgroup v2 format; v1's memory.oom_control has the same line
    counter.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    monkeypatch.setattr(process, "memory_cgroup_oom_counter", lambda pid: str(counter))
    with LocalProvider(screen=SCREEN) as provider:
        handle = provider.create()
        counter.write_text(f"low 0\nhigh 0\nmax 0\noom {oom_kills_after}\noom_kill {oom_kills_after}\n")
        os.kill(handle.pid, signal.SIGKILL)
        handle.daemon.process.wait(10)
        liveness = provider.check_alive(handle)
    assert liveness.alive is False and liveness.signal == signal.SIGKILL
    assert liveness.oom is bool(oom_kills_after)
    assert ("OOM killer" in liveness.detail) is bool(oom_kills_after), liveness.detail


def test_this_machines_memory_cgroup_counter_is_found_and_read():
    from shinken_sync.providers.process import memory_cgroup_oom_counter, read_oom_kills

    counter = memory_cgroup_oom_counter()
    if counter is None:
        pytest.skip("no readable memory cgroup here")
    kills = read_oom_kills(counter)
    assert isinstance(kills, int) and kills >= 0
    assert read_oom_kills(None) is None and read_oom_kills("/nonexistent/memory.events") is None


def test_a_daemon_that_cannot_start_raises_with_its_stderr():
    with LocalProvider(screen=SCREEN, extra_args=["--no-such-flag"]) as provider, pytest.raises(
        DaemonStartError
    ) as info:
        provider.create()
    assert info.value.exit_code == 2
    assert "--no-such-flag" in info.value.stderr_tail and "--no-such-flag" in str(info.value)


def test_unknown_create_option_is_a_type_error():
    with LocalProvider() as provider, pytest.raises(TypeError):
        provider.create(colour="blue")


def test_children_die_with_a_killed_parent(tmp_path):
    """The parent is SIGKILLed (no atexit, no close): PR_SET_PDEATHSIG stops its daemons."""
    script = textwrap.dedent(f"""
        import sys, threading
        from shinken_sync.providers import LocalProvider
        provider = LocalProvider(screen={SCREEN!r})
        # created from a short-lived thread: the spawner thread must keep PDEATHSIG tied to the process
        handles = []
        t = threading.Thread(target=lambda: handles.extend(provider.create_many(2)))
        t.start(); t.join()
        print(" ".join(str(h.pid) for h in handles), flush=True)
        threading.Event().wait(60)
    """)
    parent = start_process([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.3)
        assert not any(_gone(pid, timeout=0) for pid in pids), "the daemons died with the creating thread"
    finally:
        parent.kill()
        parent.wait()
    assert all(_gone(pid) for pid in pids)


def test_fleet_provider_hands_out_each_sandbox_once(aci):
    with LocalFleetProvider(3, screen=SCREEN) as fleet:
        handles = fleet.create_many(2) + [fleet.create()]
        assert len({h.url for h in handles}) == 3
        with pytest.raises(ProviderExhausted):
            fleet.create()
        clients = [aci(*fleet.endpoint(h)) for h in handles]
        assert len({c.hello.sandbox_id for c in clients}) == 3
        assert [c.hello.sandbox_id for c in clients] == [h.sandbox_id for h in handles]
        assert fleet.check_alive(handles[0]).alive
        host_pid = handles[0].pid
        fleet.destroy(handles[0])
        assert fleet.check_alive(handles[1]).alive  # retiring one handle leaves the host up
    assert _gone(host_pid)


def test_static_provider_wraps_given_endpoints(vdaemon, aci):
    provider = StaticProvider([(vdaemon.url, vdaemon.token)])
    handle = provider.create()
    assert provider.endpoint(handle) == (vdaemon.url, vdaemon.token)
    assert provider.check_alive(handle) == Liveness(alive=True, detail="unknown")
    assert aci(*provider.endpoint(handle)).ok("screen_size")["width"] > 0
    with pytest.raises(ProviderExhausted):
        provider.create()
    with pytest.raises(UnknownHandle):
        StaticProvider([("ws://x/sb/0", "t")]).check_alive(handle)
    provider.destroy(handle)
    provider.close()
    assert vdaemon.proc.poll() is None  # a static provider never stops what it did not start
    assert aci(vdaemon.url, vdaemon.token).call("cursor").outcome == protocol.OK


def test_provider_connect_dials_with_a_liveness_probe():
    from shinken_sync.errors import SandboxDied

    with LocalProvider(screen=SCREEN) as provider:
        handle = provider.create()
        sandbox = provider.connect(handle)
        try:
            assert sandbox.screen_size() == SCREEN
            os.kill(handle.pid, signal.SIGKILL)
            handle.daemon.process.wait(10)
            with pytest.raises(SandboxDied) as info:
                sandbox.cursor()
            assert info.value.signal == signal.SIGKILL
        finally:
            sandbox.close()


def test_provider_aconnect():
    import asyncio

    async def main(provider, handle):
        async with await provider.aconnect(handle) as sandbox:
            return await sandbox.screen_size()

    with LocalProvider(screen=SCREEN) as provider:
        assert asyncio.run(main(provider, provider.create())) == SCREEN


def test_ctrl_c_in_the_parent_stops_its_daemons():
    """KeyboardInterrupt in a script that never calls close(): the atexit hook cleans up."""
    script = textwrap.dedent(f"""
        import threading
        from shinken_sync.providers import LocalProvider
        provider = LocalProvider(screen={SCREEN!r})
        print(provider.create().pid, flush=True)
        threading.Event().wait(60)
    """)
    parent = start_process([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGINT)  # only the parent: the daemon must be stopped by it
        parent.wait(30)
    finally:
        parent.kill()
        parent.wait()
    assert _gone(pid)
