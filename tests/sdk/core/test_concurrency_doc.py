"""docs/concurrency.md's python blocks run, in order, as one script against real shinkend processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "concurrency.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def test_doc_has_the_promised_snippets():
    source = "\n".join(python_blocks(DOC.read_text()))
    for idiom in ("return_exceptions=True", "asyncio.Semaphore", "resume_screencast", "GLOBAL_FRAME_BUDGET_BYTES",
                  "random.uniform(0, min(cap"):
        assert idiom in source, idiom


@pytest.mark.integration
@pytest.mark.timeout(110)
def test_doc_snippets_run(tmp_path):
    script = tmp_path / "concurrency_doc.py"
    script.write_text("\n\n".join(python_blocks(DOC.read_text())))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "3 rounds over 16 sandboxes: ['ok', 'ok', 'ok']" in out
    assert "dead sandbox: sandbox died (signal 9" in out
    assert re.search(r"resumed \S+ at seq \d+: missed [1-9]\d* frames", out), out
    assert re.search(r"budget: <FrameBudget queued=\d+ used=\d+B dropped=\d+ evicted=[1-9]", out), out
