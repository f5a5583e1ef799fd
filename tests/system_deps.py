"""Make sure the system programs the integration tests use are present.

Run by tox before the tests. As root on Debian/Ubuntu it installs what is
missing with apt-get; otherwise it prints the one line to run and carries on
(the tests that need the programs then skip, each saying why).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

# program -> Debian package that provides it
PROGRAMS = {"Xvfb": "xvfb", "xdotool": "xdotool", "xterm": "xterm", "chromium": "chromium"}


def main() -> int:
    missing = sorted({pkg for prog, pkg in PROGRAMS.items() if shutil.which(prog) is None})
    if not missing:
        return 0
    line = "apt-get install -y " + " ".join(missing)
    can_install = hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")
    if not can_install:
        print(f"system_deps: missing {', '.join(missing)}; the Xvfb (and viewer browser) tests will skip. "
              f"To run them: sudo {line}", file=sys.stderr)
        return 0
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"system_deps: installing {', '.join(missing)}", file=sys.stderr)
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
