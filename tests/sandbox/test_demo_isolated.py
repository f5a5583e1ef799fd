"""``shinken demo --provider isolated``: the main job on isolated sandboxes, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_demo_runs_its_episodes_in_isolated_sandboxes(tmp_path: Path, state_dir: str) -> None:
    out = tmp_path / "out"
    config = json.dumps({"type": "isolated", "isolation": {"state_dir": state_dir, "memory_mb": 1024}})
    done = subprocess.run([sys.executable, "-m", "shinken_sync.cli", "demo", "--provider", config,
                           "--sandboxes", "2", "--turns", "2", "--workers", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 2 and summary["consistent"] and summary["steps"] == 4
    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert all(line["sandbox"].startswith("ws+unix://") for line in lines)
    assert (out / "contact_sheet.png").stat().st_size > 0
    assert "2 isolated virtual sandboxes" in done.stderr
    # every sandbox's directory went with it (the uid slots' lock files stay, unlocked)
    assert [p.name for p in Path(state_dir).iterdir()] in ([], [".shinken-uid-slots"])
