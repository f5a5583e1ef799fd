"""`shinken demo` end to end: real session server, real shinkend sandboxes, real files."""

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from shinken_sync.trajectory_file import expand_records
from tests.support import sigint_ignored, sigkill_and_expect_no_descendant, start_process

pytestmark = pytest.mark.integration
XVFB_MISSING = [name for name in ("Xvfb", "xdotool", "xterm") if shutil.which(name) is None]


def _demo(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shinken_sync.cli", "demo", *args], check=False,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(300)
def test_demo_writes_consistent_trajectories(tmp_path):
    out = tmp_path / "out"
    proc = _demo("--sandboxes", "2", "--turns", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^records consistent +yes$", proc.stdout, re.MULTILINE), proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 2 and summary["steps"] == 4
    assert summary["consistent"] is True and not summary["episode_errors"]

    stored = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert all("input_ids" not in ep["records"][1]["request"] for ep in stored)  # stored as what turn 1 added
    lines = _trajectories(out)
    assert len(lines) == 2
    assert len({line["session_id"] for line in lines}) == 2
    for ep in lines:
        steps, records = ep["steps"], ep["records"]
        assert len(steps) == len(records) == 2
        # every applied action is exactly what the model said in that turn's record
        for step, record in zip(steps, records):
            content = record["response"]["choices"][0]["message"]["content"]
            assert json.loads(content)["action"] == step["action"]
            # R3 kept for training: one int32 row of layers x top_k (4 x 8) per token but the last
            r3 = base64.b64decode(record["response"]["choices"][0]["meta_info"]["routed_experts"])
            output = record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
            assert len(r3) == (len(record["request"]["input_ids"]) + len(output) - 1) * 4 * 8 * 4
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

        # the screenshots reached the model: turn k's request names the first observation and the
        # observations of steps 0..k-1 (what the sandbox returned), in order; their bytes are stored once
        observed = [ep["first_observation"]["sha256"]] + [s["observation"]["sha256"] for s in steps]
        for k, record in enumerate(records):
            assert record["request"]["image_data"] == [f"sha256:{d}" for d in observed[:k + 1]]
            vision_runs = sum(1 for a, b in zip(record["request"]["input_ids"], record["request"]["input_ids"][1:])
                              if (a, b) == (259, 261))  # <|vision_start|><|image_pad|> of the byte tokenizer
            assert vision_runs == k + 1
        for digest in observed[:len(records)]:
            assert hashlib.sha256((out / "images" / f"{digest}.jpg").read_bytes()).hexdigest() == digest
        assert ep["check"]["images_match_records"] is True

    sheet = Image.open(out / "contact_sheet.png")
    assert sheet.width >= 480 and sheet.height >= 270


def _trajectories(out: Path) -> list[dict]:
    """trajectories.jsonl with every episode's records expanded to what the session server returned."""
    r3 = (out / "routed_experts.bin").read_bytes()
    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    for line in lines:
        line["records"] = expand_records(line["records"], r3)
    return lines


def _output_bytes(out: Path) -> int:
    files = [f for f in out.iterdir() if f.name in ("trajectories.jsonl", "routed_experts.bin")]
    return sum(f.stat().st_size for f in [*files, *(out / "images").iterdir()])


@pytest.mark.timeout(300)
def test_output_size_grows_linearly_with_turns(tmp_path):
    """Each record used to repeat the whole sequence (token ids, messages, routed experts): 3x the
    turns gave ~7x the bytes. Stored once, 3x the turns is at most ~3x the bytes."""
    sizes = {}
    for turns in (3, 9):
        out = tmp_path / f"t{turns}"
        proc = _demo("--sandboxes", "1", "--turns", str(turns), "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        sizes[turns] = _output_bytes(out)
    assert sizes[9] < 3.6 * sizes[3], sizes


def _start_long_demo(out: Path, log: Path) -> subprocess.Popen:
    """A 2 x 500-turn demo in its own session, returned once it has taken a step."""
    with open(log, "w") as sink:
        proc = start_process([sys.executable, "-m", "shinken_sync.cli", "demo", "--sandboxes", "2", "--turns", "500",
                              "--out", str(out)], stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not re.search(r"\| *[1-9]\d*/1000 \[", log.read_text()):  # tqdm's "| 131/1000 [00:02<..."
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc


@pytest.mark.timeout(240)
def test_sigkill_of_the_demo_leaves_no_process_behind(tmp_path):
    proc = _start_long_demo(tmp_path / "out", tmp_path / "demo.log")
    try:
        # serve, backend, gunicorn, its worker, 2 session workers, 2 shinkend
        sigkill_and_expect_no_descendant(
            proc, ("webapp.serve", "gunicorn", "webapp.reference_backend", "shinken_sync.daemon.server"), 8)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_refuses_a_taken_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _demo("--sandboxes", "1", "--turns", "1", "--port", str(port), "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr


def _wait_for(log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} after {timeout} s: {log.read_text()[-2000:]}"
        time.sleep(0.02)


@pytest.mark.timeout(180)
def test_ctrl_c_keeps_every_episodes_records_so_far(tmp_path):
    out, log = tmp_path / "out", tmp_path / "demo.log"
    proc = _start_long_demo(out, log)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _wait_for(log, "shinken demo: interrupted", 5)  # said at once, not when the stop is done
        assert proc.wait(timeout=60) == 130, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = _trajectories(out)
    assert len(lines) == 2 and all(ep["interrupted"] for ep in lines)
    for ep in lines:
        assert 0 < len(ep["steps"]) < 500
        assert len(ep["records"]) == len(ep["steps"])
        assert ep["check"]["accumulated_matches_last_record"] and ep["check"]["actions_match_records"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["episodes_cut_short"] == 2
    # the table says so too (it said "episodes 2/2" as if the run were complete)
    assert re.search(r"^episodes +2/2 finished, INTERRUPTED by Ctrl-C \(2 cut short\)$", log.read_text(),
                     re.MULTILINE)


@pytest.mark.timeout(180)
def test_a_second_ctrl_c_stops_at_once_and_still_writes_the_outputs(tmp_path):
    out, log = tmp_path / "out", tmp_path / "demo.log"
    proc = _start_long_demo(out, log)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        _wait_for(log, "shinken demo: interrupted", 5)
        os.killpg(proc.pid, signal.SIGINT)
        _wait_for(log, "shinken demo: stopping now", 5)
        assert proc.wait(timeout=60) == 130, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["episodes_started"] == 2
    assert summary["steps"] > 0 and not summary["episode_errors"]  # the stop is no episode's failure
    lines = _trajectories(out)  # the episodes finished by then (none or some), whole
    assert summary["episodes"] == len(lines) and summary["episodes_cut_short"] == 2 - len(lines)
    for ep in lines:
        assert ep["check"]["actions_match_records"]
    assert "INTERRUPTED by Ctrl-C" in log.read_text()


def test_started_processes_take_ctrl_c_even_when_the_test_runner_ignores_it():
    """`tox &` from a non-interactive shell runs everything with SIGINT ignored; the processes the
    Ctrl-C tests start must take SIGINT anyway."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = start_process([sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        proc.stdout.readline()  # the interpreter is up: its handlers are set
        assert not sigint_ignored(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) != 0  # KeyboardInterrupt
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize(("args", "names"), [
    (["--out", "/proc/shinken-demo-test"], ["--out", "/proc/shinken-demo-test", "writable"]),
    (["--out", "{file}"], ["--out", "is a file", "folder"]),
    (["--port", "99999"], ["--port", "99999", "65535"]),
    (["--workers", "-1"], ["--workers", "-1", ">= 0"]),
    (["--turns", "abc"], ["--turns", "'abc'", "integer >= 1"]),
    (["--sandboxes", "0"], ["--sandboxes", "integer >= 1"]),
    (["--backend-uri", "http://127.0.0.1:9"], ["unrecognized arguments: --backend-uri", "(see shinken demo --help)"]),
    (["--backend-kind", "tgi"], ["--backend-kind 'tgi'", "sglang, vllm, auto"]),
    (["--ray", "auto", "--backend-url", "http://127.0.0.1:9"],
     ["--backend-url configures the session server the demo starts without --ray", "--session-server"]),
    # options that would change nothing are refused, saying why
    (["--session-server", "http://127.0.0.1:9"], ["--session-server applies in Ray mode only", "--ray"]),
    (["--drivers", "2", "--node-ip", "127.0.0.1"], ["--drivers, --node-ip apply in Ray mode only"]),
    (["--ray", "auto", "--session-server", "http://127.0.0.1:9", "--workers", "3"],
     ["--workers configures the session server the demo starts", "--session-server"]),
])
def test_cli_errors_are_one_line_with_exit_code_2_and_create_nothing(tmp_path, args, names):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    out = tmp_path / "never-created"
    args = [a.replace("{file}", str(afile)) for a in args]
    if "--out" not in args:
        args += ["--out", str(out)]
    proc = _demo("--sandboxes", "1", "--turns", "1", *args, timeout=60)  # a later flag wins
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for name in names:
        assert name in lines[0], lines[0]
    assert "_positive" not in lines[0]
    assert not out.exists() and afile.read_text() == "x"


@pytest.fixture(scope="module")
def reference_backend():
    from webapp.reference_backend import start_reference_backend

    backend = start_reference_backend(r3_layers=4)
    yield backend
    backend.close()


def test_environment_overrides_are_printed_and_applied(tmp_path, reference_backend):
    """SHINKEN_BACKEND_URL used to change the demo's backend silently; SHINKEN_API_KEY made every
    turn a 401. Both now change the run visibly (the key masked) and the run succeeds."""
    env = dict(os.environ, SHINKEN_BACKEND_URL=reference_backend.url, SHINKEN_API_KEY="first-hour-secret",
               SHINKEN_WORKERS="7")  # overridden by the demo's own --workers: not a change
    proc = _demo("--sandboxes", "1", "--turns", "1", "--out", str(tmp_path / "out"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if "the environment changes this run" in line]
    assert f"SHINKEN_BACKEND_URL={reference_backend.url}" in line and "SHINKEN_API_KEY=***" in line
    assert "first-hour-secret" not in proc.stderr and "SHINKEN_WORKERS" not in line
    assert "1 virtual sandbox x 1 turn, session server with 2 workers" in proc.stderr  # no "1 sandboxes"


def test_an_environment_setting_that_does_not_parse_is_refused_at_once(tmp_path):
    env = dict(os.environ, SHINKEN_MAX_SESSIONS="lots")
    proc = _demo("--sandboxes", "1", "--turns", "1", "--out", str(tmp_path / "out"), env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "SHINKEN_MAX_SESSIONS" in line and "'lots'" in line
    assert not (tmp_path / "out").exists()


def test_an_out_folder_holding_other_files_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = _demo("--sandboxes", "1", "--turns", "1", "--out", str(out), timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"--out {out} holds files no demo wrote (notes.txt)" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


@pytest.mark.timeout(300)
def test_a_rerun_into_the_same_out_replaces_the_previous_outputs(tmp_path):
    out = tmp_path / "out"
    first = _demo("--sandboxes", "2", "--turns", "2", "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    second = _demo("--sandboxes", "1", "--turns", "1", "--out", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"--out {out}: replaced a previous run's outputs" in second.stderr
    (line,) = _trajectories(out)  # this run's one episode, nothing of the first
    sent = {line["first_observation"]["sha256"]} | {s["observation"]["sha256"] for s in line["steps"][:-1]}
    assert {p.stem for p in (out / "images").iterdir()} == sent  # no image of the first run
    log = (out / "session-server.log").read_text()
    restored = re.findall(r"restored (\d+) sessions of shard", log)
    assert restored and set(restored) == {"0"}, log[-2000:]  # the first run's sessions are gone


@pytest.mark.timeout(240)
def test_a_second_demo_on_the_same_out_is_refused_naming_out(tmp_path):
    out = tmp_path / "out"
    proc = _start_long_demo(out, tmp_path / "demo.log")
    try:
        second = _demo("--sandboxes", "1", "--turns", "1", "--out", str(out), timeout=60)
        assert second.returncode == 2, second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert f"--out {out} is in use by another shinken demo" in line and "--data-dir" not in line
        assert proc.poll() is None  # the first run goes on
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_xvfb_prerequisites_are_reported_at_once(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # none of Xvfb, xdotool, xterm on PATH
    proc = subprocess.run([sys.executable, "-m", "shinken_sync.cli", "demo", "--display", "xvfb",
                           "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "Xvfb and xdotool and xterm" in line and "apt-get install xvfb xdotool xterm" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.xvfb
@pytest.mark.skipif(bool(XVFB_MISSING), reason=f"needs {', '.join(XVFB_MISSING)} (apt-get install xvfb xdotool xterm)")
@pytest.mark.timeout(300)
def test_xvfb_demo_screens_show_the_actions(tmp_path):
    out = tmp_path / "out"
    proc = _demo("--sandboxes", "2", "--turns", "4", "--display", "xvfb", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["consistent"] is True
    # a program on each screen shows each action: nearly every step changes what the agent sees
    assert summary["observation_changes"] >= summary["steps"] // 2, summary
    for ep in _trajectories(out):
        shas = [ep["first_observation"]["sha256"]] + [s["observation"]["sha256"] for s in ep["steps"]]
        assert len(set(shas)) > 1, shas


def test_the_demo_on_a_text_only_engine_sends_text_and_records_replies_that_are_no_action(tmp_path):
    """``--backend-url --backend-kind vllm``: the engine takes no images (the server's ready line
    says so), so each observation goes as text; a reply that is no action is a step with outcome
    ``skipped`` and ``InvalidAction``, the episode goes on, the run exits 0 (a loopback stand-in
    answering as vLLM does; the real engine runs the same in the engine tier)."""
    from tests.webapp.vllm_standin import VllmStandIn

    engine = VllmStandIn()
    try:
        out = tmp_path / "valid"
        done = _demo("--sandboxes", "2", "--turns", "2", "--workers", "0", "--backend-url", engine.url,
                     "--backend-kind", "vllm", "--out", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        assert engine.requests and all("multi_modal_data" not in body for body in engine.requests)
        records = [r for line in _trajectories(out) for r in line["records"]]
        assert records and all(not r["request"].get("image_data") for r in records)
        assert all(step["outcome"] == "ok" for line in _trajectories(out) for step in line["steps"])
        assert json.loads((out / "summary.json").read_text())["consistent"]

        engine.reply_text = "I would rather not click anything."
        out = tmp_path / "invalid"
        done = _demo("--sandboxes", "1", "--turns", "3", "--workers", "0", "--backend-url", engine.url,
                     "--backend-kind", "vllm", "--out", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        (line,) = _trajectories(out)
        assert [s["outcome"] for s in line["steps"]] == ["skipped"] * 3
        assert {s["error"]["type"] for s in line["steps"]} == {"InvalidAction"}
        assert all(s["action"] is None for s in line["steps"])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["outcomes"] == {"skipped": 3} and summary["consistent"]
    finally:
        engine.close()
