"""docs/real-task.md's walkthrough runs as written: its python block, in a fresh interpreter,
in a temporary directory (where it saves its screenshot), against a real desktop."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from shinken_sync.daemon.display.desktop import DESKTOPS

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "real-task.md"
MISSING = sorted(p for p in {*DESKTOPS["full"].programs, "Xvfb", "xdotool"} if shutil.which(p) is None)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.desktop,
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (images/desktop/packages.txt)"),
]


def test_the_walkthrough_runs_and_the_task_is_done(tmp_path: pathlib.Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 1, "the walkthrough is one script"
    script = tmp_path / "real_task.py"
    script.write_text(blocks[0])
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: the browser's window is titled 'ordered 42" in done.stdout, done.stdout
    shot = Image.open(tmp_path / "real-task.png")
    assert shot.size == (1280, 800)
