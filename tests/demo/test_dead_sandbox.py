"""An episode whose sandbox dies ends there, with SandboxDied and its cause (in Ray
mode a lost node must cost its episodes, marked; the single-process demo shares run_episode).
Before, the episode played every remaining turn against the dead sandbox."""

from __future__ import annotations

import io
import threading

import pytest
import requests

from shinken_sync.demo import Episode, Progress, run_episode
from shinken_sync.errors import SandboxDied
from shinken_sync.providers import LocalProvider
from webapp.serve import start_session_server

pytestmark = pytest.mark.integration


class KillsItsDaemonOnSecondStep:
    """The real sandbox; its daemon is SIGKILLed just before the second step."""

    def __init__(self, sandbox, handle):
        self.sandbox, self.handle, self.steps = sandbox, handle, 0

    def screenshot(self, **kwargs):
        return self.sandbox.screenshot(**kwargs)

    def step(self, actions, **kwargs):
        self.steps += 1
        if self.steps == 2:
            self.handle.daemon.process.kill()
            self.handle.daemon.process.wait(10)
        return self.sandbox.step(actions, **kwargs)


def test_an_episode_whose_sandbox_dies_ends_with_sandbox_died():
    with start_session_server(1) as server, LocalProvider() as provider:
        handle = provider.create()
        sandbox = provider.connect(handle)
        ep = Episode(index=0, sandbox_id=handle.sandbox_id)
        with pytest.raises(SandboxDied, match="SIGKILL"):
            run_episode(ep, KillsItsDaemonOnSecondStep(sandbox, handle), server.url, 5, requests.Session(),
                        threading.Event(), Progress(5, stream=io.StringIO()))
        assert len(ep.steps) == 1 and not ep.finished
