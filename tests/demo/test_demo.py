"""`shinken demo` end to end: real session server, real shinkend sandboxes, real files."""

import json
import re
import socket
import subprocess
import sys

import pytest
from PIL import Image

pytestmark = pytest.mark.integration


def _demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shinken_sync.cli", "demo", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_demo_writes_consistent_trajectories(tmp_path):
    out = tmp_path / "out"
    proc = _demo("--sandboxes", "2", "--turns", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^records consistent +yes$", proc.stdout, re.MULTILINE), proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 2 and summary["steps"] == 4
    assert summary["consistent"] is True and not summary["episode_errors"]

    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert len({line["session_id"] for line in lines}) == 2
    for ep in lines:
        steps, records = ep["steps"], ep["records"]
        assert len(steps) == len(records) == 2
        # every applied action is exactly what the model said in that turn's record
        for step, record in zip(steps, records):
            content = record["response"]["choices"][0]["message"]["content"]
            assert json.loads(content)["action"] == step["action"]
            assert step["outcome"] in {"ok", "error"}
            assert step["observation"]["format"] == "jpeg"
            assert record["output_token_ids"] and len(record["output_token_logprobs"]) == len(
                record["output_token_ids"])
        last = records[-1]
        assert ep["metadata"]["accumulated_token_ids"] == last["prompt_token_ids"] + last["output_token_ids"]
        # append-only: each turn's prompt extends the previous turn's full token sequence
        first = records[0]
        assert last["prompt_token_ids"][: len(first["prompt_token_ids"]) + len(first["output_token_ids"])] == (
            first["prompt_token_ids"] + first["output_token_ids"])

    sheet = Image.open(out / "contact_sheet.png")
    assert sheet.width >= 480 and sheet.height >= 270


def test_demo_refuses_a_taken_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _demo("--sandboxes", "1", "--turns", "1", "--port", str(port), "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
