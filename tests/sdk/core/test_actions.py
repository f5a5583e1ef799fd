"""Action builders speak the daemon's argument names, and AsyncSandbox's verb methods mirror them."""

from __future__ import annotations

import inspect

import pytest

from shinken_sync import actions as A
from shinken_sync import protocol
from shinken_sync.client import AsyncSandbox, _wire_args
from shinken_sync.daemon.args import SPECS, Screen, validate

SCREEN = Screen(200, 100)
EXAMPLES = [
    A.screenshot("png", 50, 64, (1, 2, 30, 40)),
    A.click(5, 6, "right", 2),
    A.move(1, 1),
    A.drag(0, 0, 10, 10, "middle"),
    A.scroll(1, -2, 3, 4),
    A.type("héllo"),
    A.key("ctrl+shift+t"),
    A.wait(10),
    A.wait_stable(100, 1000),
    A.wait_change(500),
    A.cursor(),
    A.screen_size(),
    A.exec("echo", 1000, "/tmp", {"A": "1"}, b"in", 10, "base64"),
    A.launch("browser", ["http://127.0.0.1:8000/"], 5000),
    A.read_file("/etc/hostname", 0, 10),
    A.write_file("/tmp/x", b"\0\1", True, True, 0o600),
]
BUILDERS = {name: fn for name, fn in vars(A).items() if inspect.isfunction(fn) and not name.startswith("_")}


def test_every_action_verb_has_a_builder():
    assert set(BUILDERS) == protocol.VERBS - {"screencast_start", "screencast_stop", "resume_screencast"}
    assert {action["verb"] for action in EXAMPLES} == set(BUILDERS)


@pytest.mark.parametrize("action", EXAMPLES, ids=lambda a: a["verb"])
def test_builders_produce_what_the_daemon_accepts(action):
    verb = action["verb"]
    args = _wire_args(verb, {k: v for k, v in action.items() if k != "verb"})
    checked = validate(verb, args, SCREEN)  # raises BadArgs on any unknown or bad name
    assert set(args) <= set(SPECS[verb]) and set(checked) == set(SPECS[verb])


def test_omitted_arguments_take_the_daemons_defaults():
    assert A.scroll(dy=2) == {"verb": "scroll", "dx": 0, "dy": 2}
    assert A.wait_stable() == {"verb": "wait_stable"}
    assert validate("wait_stable", {}, SCREEN)["stable_ms"] == 500


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_sandbox_methods_take_the_builders_arguments(name):
    builder = list(inspect.signature(BUILDERS[name]).parameters.values())
    method = [p for p in inspect.signature(getattr(AsyncSandbox, name)).parameters.values() if p.name != "self"]
    assert [p.name for p in method if p.kind is not p.KEYWORD_ONLY] == [p.name for p in builder]
    assert [p.name for p in method if p.kind is p.KEYWORD_ONLY] == ["timeout"]
    assert inspect.iscoroutinefunction(getattr(AsyncSandbox, name))
