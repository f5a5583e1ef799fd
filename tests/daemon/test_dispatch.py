"""Dispatch error mapping, in-process: display failures, hangs and daemon bugs become replies."""

from __future__ import annotations

import asyncio
import json

import pytest

from shinken_sync import protocol
from shinken_sync.daemon import verbs
from shinken_sync.daemon.display.base import DisplayError
from shinken_sync.daemon.display.virtual import VirtualDisplay
from shinken_sync.daemon.screencast import StreamRegistry


def _run(display_patch, verb="click", args=None):
    async def main():
        display = VirtualDisplay(1024, 768)
        display_patch(display)
        sandbox = verbs.SandboxState("t", display, StreamRegistry(display))
        call = protocol.Call(1, verb, args if args is not None else {"x": 1, "y": 1})
        return json.loads(await verbs.execute(sandbox, outbox=None, call=call))

    return asyncio.run(main())


def test_a_display_error_keeps_its_kind():
    async def unsupported(*a, **k):
        raise DisplayError("no middle button here", protocol.ERR_UNSUPPORTED)

    reply = _run(lambda d: setattr(d, "click", unsupported))
    assert (reply["call_id"], reply["outcome"], reply["error"]["kind"]) == (1, "error", "unsupported")
    assert reply["error"]["message"] == "no middle button here"


def test_a_daemon_bug_is_an_internal_error_reply(caplog):
    async def broken(*a, **k):
        raise RuntimeError("boom")

    reply = _run(lambda d: setattr(d, "click", broken))
    assert (reply["outcome"], reply["error"]["kind"]) == ("error", protocol.ERR_INTERNAL)
    assert "boom" in reply["error"]["message"]
    assert "Traceback" in caplog.text or any(r.exc_info for r in caplog.records)


def test_a_hung_display_action_times_out(monkeypatch):
    monkeypatch.setattr(verbs, "DISPLAY_CALL_TIMEOUT_S", 0.05)

    async def hang(*a, **k):
        await asyncio.sleep(10)

    reply = _run(lambda d: setattr(d, "click", hang))
    assert (reply["outcome"], reply["error"]["kind"]) == (protocol.TIMEOUT, protocol.ERR_TIMEOUT)


@pytest.mark.parametrize(("verb", "args"), [("screen_size", {}), ("cursor", {})])
def test_plain_verbs_reply_ok(verb, args):
    reply = _run(lambda d: None, verb, args)
    assert reply["outcome"] == "ok" and reply["result"]
