"""One definition, two forms: the desktop's package list (images/desktop/packages.txt) is what
the OCI image installs (images/desktop/Dockerfile, parsed with Docker's own parser through the
``dockerfile`` package: no Docker daemon here) and what the host installs (tests/system_deps.py,
run by tox and so by .ci/run), and it holds every program the daemon's desktop starts."""

from __future__ import annotations

import pathlib
import shlex

import pytest

from shinken_sync.daemon import server
from shinken_sync.daemon.display import desktop, xvfb
from tests import system_deps

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "images" / "desktop" / "Dockerfile"
PACKAGES = ROOT / "images" / "desktop" / "packages.txt"


def _instructions() -> list:
    dockerfile = pytest.importorskip("dockerfile")
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def test_the_package_list_holds_every_program_the_desktop_runs() -> None:
    packages = set(system_deps.desktop_packages(PACKAGES))
    for name, spec in desktop.DESKTOPS.items():
        assert set(spec.programs.values()) <= packages, name
    assert {xvfb.APT_PACKAGES[p] for p in xvfb.REQUIRED_PROGRAMS} <= packages
    assert len(packages) == len(system_deps.desktop_packages(PACKAGES))  # each package listed once


def test_the_host_installs_the_same_list_the_same_way() -> None:
    assert system_deps.DESKTOP_PACKAGES_FILE == PACKAGES
    assert "--no-install-recommends" in system_deps.APT_INSTALL


def test_the_dockerfile_parses_and_installs_exactly_that_list() -> None:
    steps = _instructions()
    assert steps[0].cmd == "FROM" and steps[0].value[0].startswith("debian:bookworm")
    copies = [s for s in steps if s.cmd == "COPY" and s.value[0] == "images/desktop/packages.txt"]
    assert len(copies) == 1, "the image must copy the package list (and no other one)"
    target = copies[0].value[1]
    installs = [s for s in steps if s.cmd == "RUN" and target in s.value[0]]
    assert len(installs) == 1
    words = shlex.split(installs[0].value[0])
    # the list goes whole into apt-get, with the flags the host uses
    assert "xargs" in words and "apt-get" in words and "install" in words
    assert "--no-install-recommends" in words
    assert steps.index(copies[0]) < steps.index(installs[0])


def test_the_image_runs_shinkend_with_a_declared_desktop_as_a_user() -> None:
    steps = _instructions()
    (entry,) = [s for s in steps if s.cmd == "ENTRYPOINT"]
    assert entry.json, "exec form: shinkend is PID 1's child of nothing, and gets the signals"
    argv = list(entry.value)
    assert argv[0].endswith("/shinkend")
    assert argv[argv.index("--desktop") + 1] in desktop.DESKTOPS
    assert argv[argv.index("--display") + 1] == "xvfb"
    users = [s.value[0] for s in steps if s.cmd == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert any(s.cmd == "RUN" and "pip install" in s.value[0] and "/src" in s.value[0] for s in steps)


def test_the_daemon_offers_exactly_the_declared_desktops() -> None:
    (action,) = [a for a in server.build_parser()._actions if a.dest == "desktop"]
    assert tuple(action.choices) == tuple(desktop.DESKTOPS)


def test_the_docs_tables_list_every_app_and_desktop() -> None:
    text = (ROOT / "docs" / "desktop.md").read_text()
    for app in desktop.APPS.values():
        assert f"| `{app.name}` | `{app.program}` | `{app.package}` | `{app.window_class}` |" in text, app.name
    for name in desktop.DESKTOPS:
        assert f"| `{name}` |" in text, name
