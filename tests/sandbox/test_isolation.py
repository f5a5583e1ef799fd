"""What an agent inside an isolated sandbox cannot reach, tried from inside, checked outside.

Every escape attempt aims only at temporary directories this test created (a
broken sandbox would write there, never elsewhere on the host), and every host
side check reads those same paths.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from shinken_sync.errors import SandboxDied
from shinken_sync.providers.isolated import IsolatedProvider, host_binds
from tests.sandbox.conftest import cgroup_dirs


def sh(sandbox, cmd: str, timeout: float = 20.0):
    return sandbox.exec(cmd, timeout=timeout)


def host_pids_in(handle) -> set[int]:
    return handle.daemon.cgroup.pids() if handle.daemon.cgroup is not None else set()


def host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def alive(pids: set[int]) -> list[str]:
    """Those of ``pids`` still running (not zombies), with what they run, for the message."""
    found = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            found.append(f"{pid} {state} {cmdline[:200]}")
    return found


def daemon_pid_inside(sandbox) -> int:
    """The daemon's pid as the agent sees it (the init's child running shinken_sync.daemon.server)."""
    out = sh(sandbox, "for p in /proc/[0-9]*; do n=${p#/proc/}; "
                      "if tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^[^ ]*python[^ ]* -m shinken_sync.daemon.server'; "
                      "then echo $n; fi; done").stdout.split()  # fmt: skip
    assert len(out) == 1, out
    return int(out[0])


def test_the_agent_is_an_unprivileged_user_inside_and_outside(provider: IsolatedProvider) -> None:
    handle = provider.create()
    with provider.connect(handle) as sb:
        r = sh(sb, "id -u; id -g; grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status; grep NoNewPrivs /proc/self/status")
        lines = r.stdout.split("\n")
        assert lines[0] == "1000" and lines[1] == "1000"
        assert all(line.split()[1] == "0000000000000000" for line in lines[2:5]), r.stdout
        assert lines[5].split()[1] == "1"
        # Its own users, not the host's (without a root filesystem /etc is the host's).
        assert sh(sb, "whoami; getent passwd | cut -d: -f1 | tr '\\n' ' '").stdout == "agent\nroot agent "
        sh(sb, "sleep 30 & echo started")
        # On the host every process of the sandbox runs as one of its two unprivileged uids.
        daemon = handle.daemon
        uids = {host_uid(pid) for pid in host_pids_in(handle) if pid != handle.pid}
        assert uids <= {daemon.daemon_host_uid, daemon.agent_host_uid} and daemon.agent_host_uid in uids, uids
        assert 0 not in uids and min(uids) >= provider.isolation.host_uid_base


def test_the_host_filesystem_is_out_of_reach(make_provider: Callable[..., IsolatedProvider], tmp_path: Path) -> None:
    secret = tmp_path / "canary"
    secret.write_text("host secret")
    secret.chmod(0o644)  # readable by anyone who can reach it: only the sandbox walls keep it out
    bound = tmp_path / "bound"
    bound.mkdir()
    (bound / "visible").write_text("read-only")
    bound.chmod(0o755)
    provider = make_provider(ro_binds=(str(bound),))
    handle = provider.create()
    name = uuid.uuid4().hex
    with provider.connect(handle) as sb:
        assert sh(sb, f"cat {secret}").exit_code != 0
        assert sh(sb, f"cat {bound}/visible").stdout == "read-only"
        with pytest.raises(Exception):  # noqa: B017 - the daemon's file verb cannot see it either
            sb.read_file(str(secret))
        # Write everywhere the agent can name: our temp dirs, the bound one, the root.
        attempts = [f"{tmp_path}/{name}", f"{bound}/{name}", f"/{name}", f"/usr/{name}", f"/etc/{name}"]
        r = sh(sb, "; ".join(f"(mkdir -p $(dirname {p}) && echo x > {p}) 2>/dev/null; echo $?" for p in attempts))
        codes = r.stdout.split()
        assert codes[1:] == ["1"] * 4 or all(c != "0" for c in codes[1:]), codes
        listing = set(sh(sb, "ls /").stdout.split())
    assert not (tmp_path / name).exists() and not (bound / name).exists()
    assert sorted(os.listdir(bound)) == ["visible"]
    # the system's top level, plus the top folders of what the sandbox binds of the host (this
    # interpreter and the package, wherever the checkout lives) and of the bound test folder
    bound_tops = {Path(p).parts[1] for p in [*host_binds(), str(bound)]}
    assert listing <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "proc", "dev", "tmp", "var",
                       "home", "run", "root", "opt", "srv", *bound_tops}, listing


def test_host_processes_and_the_host_network_are_invisible(provider: IsolatedProvider) -> None:
    marker = uuid.uuid4().hex
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0shinken-test-{marker}")
    abstract.listen()
    accepted: list[object] = []
    listener.settimeout(0.2)

    def accept() -> None:
        with __import__("contextlib").suppress(OSError):
            accepted.append(listener.accept())

    try:
        handle = provider.create()
        with provider.connect(handle) as sb:
            r = sh(sb, f"grep -l {marker} /proc/[0-9]*/cmdline 2>/dev/null; kill -0 {sleeper.pid} 2>&1; "
                       f"ls /proc | grep -c '^[0-9]'")  # fmt: skip
            assert marker not in r.stdout
            assert int(r.stdout.split()[-1]) < 10  # the sandbox's init, daemon, this shell and its pipes
            probe = (f"import socket\n"
                     f"for family, addr in ((socket.AF_INET, ('127.0.0.1', {port})), "
                     f"(socket.AF_UNIX, '\\0shinken-test-{marker}')):\n"
                     f"    s = socket.socket(family); s.settimeout(2)\n"
                     f"    try:\n        s.connect(addr); print('connected')\n"
                     f"    except OSError as e:\n        print('refused', e.errno)\n")  # fmt: skip
            r = sh(sb, f"python3 -c {shlex.quote(probe)}")
            assert r.stdout.split() == ["refused", "111", "refused", "111"], r.stdout + r.stderr
            assert sh(sb, "cat /proc/net/dev | grep -c :").stdout.strip() == "1"  # lo only
        thread = threading.Thread(target=accept)
        thread.start()
        thread.join()
        assert not accepted
    finally:
        sleeper.kill()
        sleeper.wait()
        listener.close()
        abstract.close()


def test_nothing_listens_on_a_host_address(provider: IsolatedProvider) -> None:
    handle = provider.create()
    assert handle.url.startswith("ws+unix://")
    ours = {str(pid) for pid in host_pids_in(handle)}
    inodes = set()
    for pid in ours:
        with __import__("contextlib").suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    tcp = Path("/proc/net/tcp").read_text() + Path("/proc/net/tcp6").read_text()
    listening = {line.split()[9] for line in tcp.splitlines()[1:] if line.split()[3] == "0A"}
    assert not inodes & listening


def test_one_sandbox_cannot_see_another(provider: IsolatedProvider) -> None:
    a, b = provider.create_many(2)
    # Apart on the host too: no host uid in common.
    assert {a.daemon.daemon_host_uid, a.daemon.agent_host_uid}.isdisjoint(
        {b.daemon.daemon_host_uid, b.daemon.agent_host_uid})
    marker = uuid.uuid4().hex
    with provider.connect(a) as sa, provider.connect(b) as sbb:
        sh(sa, f"echo {marker} > /tmp/{marker}; echo {marker} > /home/agent/{marker}; "
               f"(exec -a sleeper-{marker} sleep 60) & "
               f"python3 -c \"import socket,time; s=socket.socket(socket.AF_UNIX); "
               f"s.bind('\\x00{marker}'); s.listen(); time.sleep(60)\" > /dev/null 2>&1 &")  # fmt: skip
        time.sleep(0.5)
        assert marker in sh(sa, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
        pattern = f"sleeper-[{marker[0]}]{marker[1:]}"  # never matches this grep's own command line
        r = sh(sbb, f"cat /tmp/{marker} /home/agent/{marker} 2>&1; cat /proc/[0-9]*/cmdline 2>/dev/null | "
                    f"tr '\\0' ' ' | grep -c '{pattern}'; ls {a.daemon.host_dir} 2>&1")  # fmt: skip
        assert f"{marker}\n" not in r.stdout.replace(f"/{marker}", "")
        assert "\n0\n" in r.stdout
        probe = f"import socket; s=socket.socket(socket.AF_UNIX); s.connect('\\x00{marker}')"
        assert "Connection refused" in sh(sbb, f"python3 -c {shlex.quote(probe)}").stderr


def test_the_agent_cannot_read_the_daemon(provider: IsolatedProvider) -> None:
    handle = provider.create()
    token = handle.token
    with provider.connect(handle) as sb:
        daemon = daemon_pid_inside(sb)
        ptrace = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                  f"print(libc.ptrace(16, {daemon}, 0, 0), ctypes.get_errno())")  # PTRACE_ATTACH
        tries = [f"cat /proc/{daemon}/environ", f"head -c 64 /proc/{daemon}/mem", f"ls /proc/{daemon}/fd",
                 f"cat /proc/{daemon}/maps", "ls /run/shinkend", f"kill -STOP {daemon}", "kill -STOP 1"]
        r = sh(sb, "; ".join(f"if {t} >/dev/null 2>&1; then echo REACHED; else echo denied; fi" for t in tries)
                   + f"; python3 -c {shlex.quote(ptrace)}; cat /proc/{daemon}/oom_score_adj")  # fmt: skip
        assert r.stdout.splitlines()[:len(tries)] == ["denied"] * len(tries), r.stdout + r.stderr
        assert r.stdout.splitlines()[-2] == "-1 1"  # EPERM
        assert r.stdout.splitlines()[-1] == "1000"  # the OOM killer's first choice
        # Every process's cmdline and environ: neither the token nor the variable that once carried it.
        r = sh(sb, "cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ 2>/dev/null")
        assert token not in r.stdout
        assert "SHINKEND_TOKEN" not in r.stdout
        # Every file it can reach: not the token. (Not the variable's name: the daemon's own source,
        # mounted read-only where the checkout is, names it; a checkout under /tmp is reached here.)
        r = sh(sb, "grep -rsI . /tmp /var/tmp /dev/shm /home /run 2>/dev/null", timeout=60)
        assert token not in r.stdout
    # Nor is it on the host, in any file of the sandbox's directory.
    for root, _, files in os.walk(handle.daemon.host_dir):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path):
                assert token.encode() not in Path(path).read_bytes()


def test_outgrowing_the_memory_limit_is_reported_as_oom(make_provider: Callable[..., IsolatedProvider]) -> None:
    provider = make_provider(memory_mb=200)
    handle = provider.create()
    with provider.connect(handle) as sb, pytest.raises(SandboxDied) as died:
        sh(sb, "python3 -c 'x = bytearray(400 * 2**20); import time; time.sleep(10)'", timeout=30)
    assert died.value.oom is True, died.value
    live = provider.check_alive(handle)
    assert not live.alive and live.oom


def test_the_async_face_sees_the_same_walls(provider: IsolatedProvider, tmp_path: Path) -> None:
    async def main() -> None:
        handle = provider.create()
        sb = await provider.aconnect(handle)
        try:
            r = await sb.exec("id -u; cat " + str(tmp_path / "nothing") + " 2>&1 | head -c 0; ls /run/shinkend 2>&1")
            assert r.stdout.startswith("1000\n") and "Permission denied" in r.stdout
        finally:
            await sb.close()

    asyncio.run(main())


def test_a_fork_bomb_is_contained(make_provider: Callable[..., IsolatedProvider]) -> None:
    provider = make_provider(pids=64)
    bombed, other = provider.create_many(2)
    pids_dir = bombed.daemon.cgroup.dirs.get("pids") or bombed.daemon.cgroup.dirs[""]
    with provider.connect(bombed) as sb, provider.connect(other) as calm:
        t0 = time.monotonic()
        try:  # ends when the shell cannot fork any more, or at the timeout (its group killed)
            sb.exec("f() { f | f & }; f; sleep 30", timeout=3)
        except Exception:  # noqa: BLE001, S110 - either way it returns
            pass
        assert time.monotonic() - t0 < 10
        current = int(Path(pids_dir, "pids.current").read_text())
        assert 0 < current <= 64
        # The bomb stays inside its own sandbox (its pids and its CPU quota): the other one
        # answers at once, and the bombed daemon's own verbs (no fork needed) still work.
        t0 = time.monotonic()
        assert sh(calm, "echo calm").stdout == "calm\n"
        calm_s = time.monotonic() - t0
        assert sb.screenshot(timeout=60).data
        assert calm_s < 5, calm_s
        peak = Path(pids_dir, "pids.peak")
        if peak.exists():
            assert int(peak.read_text()) <= 64
    pids = host_pids_in(bombed)
    provider.destroy(bombed)
    assert not alive(pids)


def test_destroy_leaves_no_process_mount_cgroup_or_directory(provider: IsolatedProvider) -> None:
    handles = provider.create_many(2)
    for h in handles:
        with provider.connect(h) as sb:
            sh(sb, "sleep 300 & echo > /tmp/x")
    pids = set().union(*(host_pids_in(h) for h in handles))
    dirs = [h.daemon.host_dir for h in handles]
    groups = cgroup_dirs(provider.prefix)
    assert len(pids) >= 6 and len(groups) >= 2
    for h in handles:
        provider.destroy(h)
    assert not alive(pids)
    assert cgroup_dirs(provider.prefix) == []
    assert not any(os.path.exists(d) for d in dirs)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert not any(d in mounts for d in dirs)


def test_files_the_client_writes_belong_to_the_agent(provider: IsolatedProvider) -> None:
    handle = provider.create()
    with provider.connect(handle) as sb:
        sb.write_file("/home/agent/notes/todo.txt", b"first\n", make_dirs=True)
        r = sh(sb, "echo second >> /home/agent/notes/todo.txt && touch /home/agent/notes/more && "
                   "stat -c '%u %n' /home/agent/notes /home/agent/notes/todo.txt && cat /home/agent/notes/todo.txt")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.splitlines() == ["1000 /home/agent/notes", "1000 /home/agent/notes/todo.txt",
                                         "first", "second"]
