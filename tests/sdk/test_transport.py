"""The transport choice: websockets or the [fast] extra (picows + uvloop), same behaviour.

The whole SDK suite runs once per transport in tox (``SHINKEN_TRANSPORT``);
these tests check the choice itself, and run one real step over each
available transport in the same process.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from shinken_sync import actions as A
from shinken_sync import transport
from shinken_sync.client import aconnect
from shinken_sync.errors import classify_exception, is_connection_loss
from shinken_sync.sharedloop import SharedLoop

AVAILABLE = ["websockets", *(["fast"] if transport.fast_available() else [])]


def test_choose_names_a_transport_and_refuses_unknown_settings():
    assert transport.choose("websockets").name == "websockets"
    expected = "fast" if transport.fast_available() else "websockets"
    assert transport.choose("auto").name == expected
    with pytest.raises(ValueError, match="auto, websockets or fast"):
        transport.choose("quic")


def test_fast_without_the_extra_is_an_import_error_naming_it(monkeypatch):
    for module in ("picows", "picows.websockets", "picows.websockets.exceptions"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    monkeypatch.setattr(transport, "_cache", {})
    monkeypatch.setattr(transport, "fast_available", lambda: False)
    with pytest.raises(ImportError, match=r"\[fast\] extra"):
        transport.choose("fast")
    assert transport.choose("auto").name == "websockets"


@pytest.mark.integration
@pytest.mark.parametrize("name", AVAILABLE)
def test_a_step_and_a_drop_behave_the_same_on_each_transport(monkeypatch, name):
    from shinken_sync.providers.local import LocalProvider

    monkeypatch.setattr(transport, "TRANSPORT", name)

    async def dropped(url: str, token: str) -> None:
        sb = await aconnect(url, token)
        transport.abort(sb._ws)
        result = await asyncio.wait_for(sb.step([A.click(6, 6)], observe={}), 10)
        assert result.outcomes == ["connection_lost"]
        assert is_connection_loss(result.observation_error)
        assert classify_exception(result.observation_error) == "connection_lost"
        await sb.close()

    with LocalProvider(display="virtual", screen=(1024, 768)) as provider:
        url, token = provider.endpoint(provider.create())

        async def both() -> None:
            sb = await aconnect(url, token)
            assert sb.transport == name
            result = await sb.step([A.click(5, 5)], observe={"max_long_edge": 64})
            assert result.ok and result.observation.width == 64
            await sb.close()
            await dropped(url, token)

        asyncio.run(both())


def test_a_shared_loop_runs_uvloop_only_under_the_fast_transport_and_without_gevent(monkeypatch):
    for setting in ("websockets", "fast"):
        monkeypatch.setattr(transport, "TRANSPORT", setting)
        expected = setting == "fast" and transport.fast_available() and "gevent.monkey" not in sys.modules
        if "gevent.monkey" in sys.modules:
            expected = expected or (setting == "fast" and not sys.modules["gevent.monkey"].is_module_patched("threading"))
        with SharedLoop("transport-test") as shared:
            is_uvloop = type(shared.loop).__module__.startswith("uvloop")
        assert is_uvloop == transport.uses_uvloop() == bool(expected and _has_uvloop())


def _has_uvloop() -> bool:
    import importlib.util

    return importlib.util.find_spec("uvloop") is not None


@pytest.mark.integration
def test_websockets_does_not_keep_the_last_observation_once_it_was_read(monkeypatch):
    """The websockets parser's last frame is emptied once its message is out
    (else each idle connection holds its last ~72 KiB observation)."""
    from shinken_sync.providers.local import LocalProvider

    monkeypatch.setattr(transport, "TRANSPORT", "websockets")

    async def body(url: str, token: str) -> None:
        sb = await aconnect(url, token)
        shot = await sb.screenshot(format="png")
        assert len(shot.data) > transport.RELEASE_FRAME_BYTES and shot.data.startswith(b"\x89PNG")
        await asyncio.sleep(0.05)  # the reader has dispatched and released by now
        parser = sb._ws.protocol.parser.gi_yieldfrom  # websockets' Protocol.parse
        assert len(parser.gi_frame.f_locals["frame"].data) == 0, "websockets' parser still holds the observation"
        await sb.close()

    with LocalProvider(display="virtual", screen=(1024, 768)) as provider:
        asyncio.run(body(*provider.endpoint(provider.create())))


@pytest.mark.integration
@pytest.mark.parametrize("name", AVAILABLE)
def test_the_blocking_face_resolves_names_and_runs_the_liveness_probe_on_each_transport(monkeypatch, name):
    """What the SharedLoop delegates to threads -- DNS for a hostname, the
    liveness probe in its executor -- works on each transport; under the
    gevent variant of the suite (tests/run_patched.py) this runs patched."""
    import os
    import signal

    from shinken_sync.errors import SandboxDied
    from shinken_sync.providers.local import LocalProvider
    from shinken_sync.sync import connect

    monkeypatch.setattr(transport, "TRANSPORT", name)
    with LocalProvider(display="virtual", screen=(1024, 768)) as provider, SharedLoop("dns-probe") as shared:
        handle = provider.create()
        url, token = provider.endpoint(handle)
        by_name = url.replace("127.0.0.1", "localhost")  # resolved through the loop's executor
        assert by_name != url
        sb = connect(by_name, token=token, loop=shared, liveness_probe=lambda: provider.check_alive(handle))
        assert sb.transport == name and sb.screen_size() == (1024, 768)
        os.kill(handle.pid, signal.SIGKILL)
        with pytest.raises(SandboxDied) as info:
            for _ in range(50):  # the first call may still be answered before the kill lands
                sb.cursor()
        assert info.value.signal == signal.SIGKILL and classify_exception(info.value) == "sandbox_died"
        sb.close()
