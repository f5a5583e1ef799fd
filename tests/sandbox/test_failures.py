"""An isolated sandbox that cannot be built says what is missing, in one line, and leaves nothing.

"Nothing" is checked where it would be: the state directory (host directories,
sockets, staging mount points), the cgroups named after the provider, the
processes, the mounts. The one stand-in: a fake ``bwrap`` that refuses like a
kernel without user namespaces would (turning them off here would be a global
sysctl, outside anything a test may touch).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shinken_sync.providers.errors import CgroupUnavailable, DaemonStartError, IsolationUnavailable
from shinken_sync.providers.isolated import IsolatedProvider, Isolation
from tests.sandbox.conftest import cgroup_dirs, remove_leftovers


def leftovers(state_dir: str) -> list[str]:
    # The uid slots' lock files stay, empty, for the next sandboxes (unlinking a lock file
    # races with whoever opens it next); they hold no lock once their sandbox is gone.
    return [name for name in os.listdir(state_dir) if name != ".shinken-uid-slots"]


def assert_nothing_left(provider: IsolatedProvider | None, state_dir: str) -> None:
    assert leftovers(state_dir) == []
    if provider is not None:
        assert cgroup_dirs(provider.prefix) == []
    assert state_dir not in Path("/proc/self/mountinfo").read_text()


_cleanups: list[Path] = []


def request_cleanup(path: Path) -> None:
    _cleanups.append(path)


@pytest.fixture(autouse=True)
def _remove_requested() -> Iterator[None]:
    yield
    while _cleanups:
        shutil.rmtree(_cleanups.pop(), ignore_errors=True)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_no_bwrap(state_dir: str) -> None:
    with pytest.raises(IsolationUnavailable) as err:
        IsolatedProvider(isolation=Isolation(bwrap="/nonexistent/bwrap", state_dir=state_dir))
    assert "bubblewrap" in one_line(err.value) and "apt-get install bubblewrap" in str(err.value)
    assert_nothing_left(None, state_dir)


def test_no_root_filesystem(state_dir: str, tmp_path: Path) -> None:
    with pytest.raises(IsolationUnavailable) as err:
        IsolatedProvider(isolation=Isolation(rootfs=str(tmp_path / "missing"), state_dir=state_dir))
    assert "is not a directory" in one_line(err.value) and "docs/sandboxes.md" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(IsolationUnavailable) as err:
        IsolatedProvider(isolation=Isolation(rootfs=str(tmp_path / "empty"), state_dir=state_dir))
    assert "has no /usr/bin/python3" in one_line(err.value)
    assert_nothing_left(None, state_dir)


def test_namespaces_refused(state_dir: str, make_provider: Callable[..., IsolatedProvider]) -> None:
    # Beside the state directory: bwrap runs as the sandbox's unprivileged uid, which cannot
    # reach pytest's 0700 tmp_path.
    fake = Path(state_dir + "-bin") / "bwrap"
    fake.parent.mkdir(mode=0o755)
    request_cleanup(fake.parent)
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace, likely because the kernel "
                    "does not allow non-privileged user namespaces.' >&2\nexit 1\n")  # fmt: skip
    fake.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    provider = make_provider(bwrap=str(fake))
    with pytest.raises(IsolationUnavailable) as err:
        provider.create()
    text = one_line(err.value)
    assert "No permissions to create a new namespace" in text and "user.max_user_namespaces" in text
    assert_nothing_left(provider, state_dir)


def test_cgroups_not_permitted(state_dir: str, make_provider: Callable[..., IsolatedProvider]) -> None:
    provider = make_provider(cgroup_parent="/no/such/parent")
    with pytest.raises(CgroupUnavailable) as err:
        provider.create()
    assert "cannot create cgroup" in one_line(err.value) and "cgroup_parent" in str(err.value)
    assert_nothing_left(provider, state_dir)


def test_a_daemon_that_fails_to_start_quotes_its_log(state_dir: str,
                                                     make_provider: Callable[..., IsolatedProvider]) -> None:
    provider = make_provider(provider_kwargs={"extra_args": ["--display", "xvfb", "--launch", "/no/such/program"]})
    with pytest.raises(DaemonStartError) as err:
        provider.create()
    first = str(err.value).splitlines()[0]
    assert "exited before it was ready" in first and "/no/such/program" in first  # what failed, at once
    assert err.value.stderr_tail  # the daemon's (the desktop's) own last words
    assert_nothing_left(provider, state_dir)


def test_create_many_is_all_or_nothing(state_dir: str, make_provider: Callable[..., IsolatedProvider]) -> None:
    provider = make_provider()
    ok = provider.create()
    with pytest.raises(DaemonStartError):
        provider.create_many(3, extra_args=["--screen", "1x1"])
    assert leftovers(state_dir) == [os.path.basename(ok.daemon.host_dir)]
    assert len(cgroup_dirs(provider.prefix)) == len(ok.daemon.cgroup.dirs)
    provider.destroy(ok)
    assert_nothing_left(provider, state_dir)


def test_what_a_killed_provider_left_is_swept_by_the_next(state_dir: str,
                                                          make_provider: Callable[..., IsolatedProvider]) -> None:
    driver = ("import sys, time\n"
              "from shinken_sync.providers.isolated import IsolatedProvider, Isolation\n"
              f"p = IsolatedProvider(isolation=Isolation(state_dir={state_dir!r}))\n"
              "h = p.create()\n"
              "print(p.prefix, h.daemon.host_dir, *sorted(h.daemon.cgroup.pids()), flush=True)\n"
              "time.sleep(120)\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    try:
        prefix, host_dir, *pids = proc.stdout.readline().split()
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # the sandbox dies with its provider (bwrap --die-with-parent)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    try:
        assert os.path.isdir(host_dir) and cgroup_dirs(prefix)  # nobody cleaned up after a SIGKILL
        make_provider()  # the next provider on this state_dir does
        assert not os.path.exists(host_dir)
        assert cgroup_dirs(prefix) == []
    finally:
        remove_leftovers(prefix)
