"""Every verb exists once in shinken_sync.verbs and everywhere derived from it, exactly."""

from __future__ import annotations

import inspect

import pytest

from shinken_sync import actions, client, client_protocol, protocol, sync
from shinken_sync import verbs as table
from shinken_sync.daemon import args as daemon_args
from shinken_sync.daemon import verbs as daemon_verbs

ACTION_HELPERS = {
    name: fn for name, fn in vars(actions).items() if inspect.isfunction(fn) and not name.startswith("_")
}


def _params(function, skip=("self", "timeout")):
    return tuple(name for name in inspect.signature(function).parameters if name not in skip)


def test_the_table_declares_each_verb_once():
    names = [verb.name for verb in table._TABLE]
    assert len(names) == len(set(names)) == len(table.VERBS)
    assert len({verb.method for verb in table._TABLE}) == len(names)  # one method per verb


def test_protocol_daemon_validation_and_handlers_match_the_table():
    assert protocol.VERBS == set(table.VERBS)
    assert list(daemon_args.SPECS) == list(table.VERBS)
    for name, verb in table.VERBS.items():
        assert set(daemon_args.SPECS[name]) == set(verb.args), name
        if verb.default_wait_ms is not None:
            assert daemon_args.SPECS[name][verb.waits_on].default == verb.default_wait_ms
    assert set(daemon_verbs.HANDLERS) == set(table.VERBS)


def test_action_helpers_match_the_table():
    assert set(ACTION_HELPERS) == table.ACTION_VERBS
    for name in table.ACTION_VERBS:
        assert _params(ACTION_HELPERS[name]) == table.VERBS[name].args, name


@pytest.mark.parametrize("face", [client.AsyncSandbox, sync.Sandbox], ids=["async", "sync"])
def test_sandbox_methods_match_the_table(face):
    for name in table.ACTION_VERBS:
        assert _params(getattr(face, table.VERBS[name].method)) == table.VERBS[name].args, name
    # The stream verbs: screencast takes the stream parameters, the stream's stop() its id.
    assert _params(face.screencast) == table.VERBS["screencast_start"].args
    assert _params(face.resume_screencast)[0] == "stream_id"
    stream = client.ScreencastStream if face is client.AsyncSandbox else sync.ScreencastStream
    assert callable(getattr(stream, table.VERBS["screencast_stop"].method))


def test_decoders_and_deadlines_come_from_the_table():
    for name, verb in table.VERBS.items():
        assert (name in client_protocol.DECODERS) == (verb.result in client_protocol.RESULT_DECODERS), name
        waited = client.call_deadline(1.0, name, {}) - 1.0
        if verb.default_wait_ms:
            assert waited == pytest.approx(verb.default_wait_ms / 1000 + client.WAITING_VERB_SLACK)
        elif not verb.waits_on:
            assert waited == 0.0


def test_a_registry_that_drifts_from_the_table_fails_loudly():
    with pytest.raises(AssertionError, match=r"missing \['wait'\], extra \['wiat'\]"):
        table.check_names("HANDLERS", {**{n: None for n in table.VERBS if n != "wait"}, "wiat": None})


def test_the_sdk_does_not_import_the_daemon():
    """At module level: the demo checks the daemon's prerequisites inside a function (it runs one)."""
    import ast
    import pathlib

    root = pathlib.Path(table.__file__).parent
    for path in [*root.glob("*.py"), *root.glob("providers/*.py")]:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                assert "daemon" not in target, f"{path.name} imports {target}"
            elif isinstance(node, ast.Import):
                assert not any("daemon" in alias.name for alias in node.names), path.name


IMAGE_DEFAULTS = {"format": table.DEFAULT_IMAGE_FORMAT, "quality": table.DEFAULT_IMAGE_QUALITY,
                  "fps": table.DEFAULT_SCREENCAST_FPS}


def test_every_image_default_is_the_tables():
    """The SDK's signatures, the daemon's argument defaults, its displays and its encoder agree."""
    from shinken_sync.daemon import imaging
    from shinken_sync.daemon.display import base, virtual, xvfb

    functions = [actions.screenshot, client.AsyncSandbox.screenshot, client.AsyncSandbox.screencast,
                 client.AsyncSandbox.resume_screencast, sync.Sandbox.screenshot, sync.Sandbox.screencast,
                 base.Display.screenshot, virtual.VirtualDisplay.screenshot, xvfb.XvfbDisplay.screenshot,
                 imaging.plan]
    seen = 0
    for function in functions:
        for name, parameter in inspect.signature(function).parameters.items():
            if name in IMAGE_DEFAULTS and parameter.default is not inspect.Parameter.empty:
                assert parameter.default == IMAGE_DEFAULTS[name], (function.__qualname__, name)
                seen += 1
    for verb in ("screenshot", "screencast_start"):  # resume_screencast's None keeps the stream's own
        for name, arg in daemon_args.SPECS[verb].items():
            if name in IMAGE_DEFAULTS:
                assert arg.default == IMAGE_DEFAULTS[name], (verb, name)
                seen += 1
    assert seen >= 20  # the walk found the defaults
