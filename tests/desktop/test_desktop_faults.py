"""A desktop that cannot start says why in one line and leaves nothing behind: a program
missing from PATH names its Debian package; an app that dies at start is quoted from its own
log. The daemon is real; PATH is a temporary directory of links to the real programs, where
the broken 'chromium' is a script standing in for a browser that fails (a real one cannot be
made to fail on demand)."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

import psutil
import pytest

from shinken_sync.daemon.display.desktop import DESKTOPS
from shinken_sync.providers import DaemonStartError, LocalProvider

NEEDED = ("Xvfb", "xdotool", "openbox", "xterm", "mousepad", "setpriv")
MISSING = [p for p in NEEDED if shutil.which(p) is None]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.xvfb,
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} installed"),
]


def _path_without_chromium(tmp_path, chromium_script: str | None = None) -> str:
    """A PATH holding the desktop's programs and python, but not the real chromium."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in dict.fromkeys((*NEEDED, *DESKTOPS["full"].programs, "sh", "bash", "python3")):
        real = shutil.which(program)
        if real and program != "chromium":
            (bin_dir / program).symlink_to(real)
    if chromium_script is not None:
        script = bin_dir / "chromium"
        script.write_text(chromium_script)
        script.chmod(0o755)
    return str(bin_dir)


def _desktop_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "shinken-desktop-*")))


def _start(path: str, monkeypatch: pytest.MonkeyPatch) -> DaemonStartError:
    monkeypatch.setenv("PATH", path)
    provider = LocalProvider(display="xvfb", screen=(800, 600), extra_args=["--desktop", "full"], start_timeout=60)
    with provider, pytest.raises(DaemonStartError) as caught:
        provider.create()
    return caught.value


def test_a_missing_browser_is_named_with_its_package(tmp_path, monkeypatch) -> None:
    error = _start(_path_without_chromium(tmp_path), monkeypatch)
    assert error.exit_code == 3
    assert "the full desktop needs chromium on PATH: apt-get install chromium" in error.stderr_tail


def test_a_browser_that_dies_at_start_is_quoted_from_its_log(tmp_path, monkeypatch) -> None:
    before_dirs = _desktop_dirs()
    script = "#!/bin/sh\necho 'chromium: cannot open the profile: disk on fire' >&2\nexit 7\n"
    error = _start(_path_without_chromium(tmp_path, script), monkeypatch)
    assert error.exit_code == 3
    assert "chromium exited (exit 7) before showing a window" in error.stderr_tail
    assert "disk on fire" in error.stderr_tail  # the app's own words, from its log
    # Nothing left behind: no desktop directory, and none of the programs this run started
    # (each was started through the temporary PATH, so its argv[0] lies under tmp_path).
    assert _desktop_dirs() <= before_dirs
    leftovers = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                 if (p.info["cmdline"] or [""])[0].startswith(str(tmp_path))]  # fmt: skip
    assert not leftovers, leftovers
