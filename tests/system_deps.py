"""Make sure the system programs the integration tests use are present.

Run by tox before the tests. As root on Debian/Ubuntu it installs what is
missing with apt-get; otherwise it prints the one line to run and carries on
(the tests that need the programs then skip, each saying why).

The real desktop's packages come from images/desktop/packages.txt, the list
its OCI image installs too (images/desktop/Dockerfile), with the same apt-get
flags, so the host's /usr (the isolated provider's base filesystem) and the
image hold the same desktop.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

# program -> Debian package that provides it
# bwrap: the isolated sandboxes (tests/sandbox); choom comes with util-linux.
PROGRAMS = {"Xvfb": "xvfb", "xdotool": "xdotool", "xterm": "xterm", "chromium": "chromium", "bwrap": "bubblewrap"}
DESKTOP_PACKAGES_FILE = pathlib.Path(__file__).resolve().parents[1] / "images" / "desktop" / "packages.txt"
#: The flags both desktop forms install with (images/desktop/Dockerfile uses the same).
APT_INSTALL = ["apt-get", "install", "-y", "-qq", "--no-install-recommends"]


def desktop_packages(path: pathlib.Path = DESKTOP_PACKAGES_FILE) -> list[str]:
    """The packages of images/desktop/packages.txt: one a line, ``#`` starts a comment."""
    names = []
    for line in path.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.append(name)
    return names


def _not_installed(packages: list[str]) -> list[str]:
    if shutil.which("dpkg-query") is None:
        return []  # not Debian: the desktop tests skip, naming what they miss
    missing = []
    for package in packages:
        status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True,
                                check=False).stdout  # fmt: skip
        if "install ok installed" not in status:
            missing.append(package)
    return missing


def main() -> int:
    missing = sorted({pkg for prog, pkg in PROGRAMS.items() if shutil.which(prog) is None}
                     | set(_not_installed(desktop_packages())))  # fmt: skip
    if not missing:
        return 0
    line = "apt-get install -y --no-install-recommends " + " ".join(missing)
    can_install = hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")
    if not can_install:
        print(f"system_deps: missing {', '.join(missing)}; the Xvfb, desktop, sandbox and viewer browser tests will skip. "
              f"To run them: sudo {line}", file=sys.stderr)
        return 0
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"system_deps: installing {', '.join(missing)}", file=sys.stderr)
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run([*APT_INSTALL, *missing], check=True, env=env, stdout=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
