"""Fixtures of the isolation tests (marker ``sandbox``; tox env ``sandbox``): real
bubblewrap sandboxes from :class:`~shinken_sync.providers.isolated.IsolatedProvider`.
Skipped, with the reason, where isolated sandboxes cannot run (not root, no bwrap).

Teardown removes every cgroup a test's provider created, even when the test (or
the provider) failed half way: :func:`remove_leftovers` kills what is in them and
removes them, and the state directories live in the test's own temporary directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shinken_sync.providers.cgroups import detect
from shinken_sync.providers.isolated import IsolatedProvider, Isolation

HERE = Path(__file__).parent


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "isolated sandboxes need root (the provider maps the sandbox's users and creates cgroups)"
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = unavailable()
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.sandbox)
            item.add_marker(pytest.mark.integration)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


def cgroup_dirs(prefix: str) -> list[str]:
    """Every cgroup directory named after ``prefix`` (a provider's) on this host."""
    found = []
    with contextlib.suppress(Exception):
        _, parents = detect()
        for base in parents.values():
            with contextlib.suppress(OSError):
                found += [os.path.join(base, n) for n in os.listdir(base) if n.startswith(f"shinken-{prefix}")]
    return found


def remove_leftovers(prefix: str) -> None:
    for path in cgroup_dirs(prefix):
        for _ in range(100):
            with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as f:
                for pid in f.read().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                import time

                time.sleep(0.05)


@pytest.fixture
def state_dir() -> Iterator[str]:
    # Short (a unix socket path lives in it) and ours: removed whatever happened.
    path = tempfile.mkdtemp(prefix="shk-t-", dir="/tmp")
    os.chmod(path, 0o711)  # the sandbox's unprivileged uid binds its socket directory from below it
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_provider(state_dir: str) -> Iterator[Callable[..., IsolatedProvider]]:
    """``make_provider(**isolation_fields, provider_kwargs=...)``: closed and cleaned up after the test."""
    made: list[IsolatedProvider] = []

    def make(provider_kwargs: dict[str, Any] | None = None, **isolation: Any) -> IsolatedProvider:
        isolation.setdefault("state_dir", state_dir)
        provider = IsolatedProvider(isolation=Isolation(**isolation), **(provider_kwargs or {}))
        made.append(provider)
        return provider

    yield make
    for provider in made:
        try:
            provider.close()
        finally:
            remove_leftovers(provider.prefix)


@pytest.fixture
def provider(make_provider: Callable[..., IsolatedProvider]) -> IsolatedProvider:
    return make_provider()
