"""`shinken demo` end to end: real session server, real shinkend sandboxes, real files."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

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
            assert record["response"]["choices"][0]["meta_info"]["routed_experts"]  # R3 kept for training
            assert step["outcome"] in {"ok", "error"}
            assert step["observation"]["format"] == "jpeg"
            assert record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]

        def ids(record):  # miles' SessionRecord: the backend request's input_ids + the output ids
            pairs = record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
            return record["request"]["input_ids"], [pair[1] for pair in pairs]

        last_prompt, last_output = ids(records[-1])
        assert ep["metadata"]["accumulated_token_ids"] == last_prompt + last_output
        # append-only: each turn's prompt extends the previous turn's full token sequence
        first_prompt, first_output = ids(records[0])
        assert last_prompt[: len(first_prompt) + len(first_output)] == first_prompt + first_output

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


@pytest.mark.timeout(180)
def test_ctrl_c_keeps_every_episodes_records_so_far(tmp_path):
    out, log = tmp_path / "out", tmp_path / "demo.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shinken_sync.cli", "demo", "--sandboxes", "2", "--turns", "500",
             "--out", str(out)], stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            while not re.search(r"\] [1-9]\d*/1000 steps", log.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
            assert proc.wait(timeout=60) == 130, log.read_text()[-2000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(ep["interrupted"] for ep in lines)
    for ep in lines:
        assert 0 < len(ep["steps"]) < 500
        assert len(ep["records"]) == len(ep["steps"])
        assert ep["check"]["accumulated_matches_last_record"] and ep["check"]["actions_match_records"]
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True
