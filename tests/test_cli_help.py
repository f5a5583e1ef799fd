"""Every command-line option of ours has help text that shows its default, without reST markup;
every CLI has ``--version`` and one-line usage errors pointing at the right ``--help``."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

import shinken_sync
from shinken_sync.cli import build_parser as shinken_parser
from shinken_sync.daemon.server import MIN_TOKEN_BYTES
from shinken_sync.daemon.server import build_parser as shinkend_parser
from webapp.serve import build_parser as session_server_parser


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    root = shinken_parser()
    (sub,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    return [(f"shinken {name}", parser) for name, parser in sub.choices.items()] + [
        ("shinkend", shinkend_parser()), ("shinken-session-server", session_server_parser())]


@pytest.mark.parametrize(("name", "parser"), _parsers(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_option_has_help_with_its_default(name, parser):
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert text, f"{name} {action.option_strings[0]} has no help"
        if action.required:
            continue
        assert "default" in text, f"{name} {action.option_strings[0]}: no default in {text!r}"
    assert "``" not in parser.format_help(), f"{name} --help shows reST markup"


COMMANDS = {  # each console script of setup.py, run as its module
    "shinken": ["-m", "shinken_sync.cli"],
    "shinkend": ["-m", "shinken_sync.daemon.server"],
    "shinken-session-server": ["-m", "webapp.serve"],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_cli_prints_the_one_version(name):
    proc = subprocess.run([sys.executable, *COMMANDS[name], "--version"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    # one source: shinken_sync.__version__, which setup.py reads (so the installed metadata agrees)
    assert proc.stdout.strip() == f"{name} {shinken_sync.__version__}"
    assert importlib.metadata.version("shinken") == shinken_sync.__version__


@pytest.mark.parametrize(("argv", "pointer"), [
    (["-m", "shinken_sync.cli", "demo", "--backend-uri", "http://127.0.0.1:1"], "(see shinken demo --help)"),
    (["-m", "shinken_sync.cli", "sandboxes", "--turns", "3"], "(see shinken sandboxes --help)"),
    (["-m", "shinken_sync.daemon.server", "--fleet", "x"], "(see shinkend --help)"),
    (["-m", "shinken_sync.daemon.server", "--port", "70000"], "(see shinkend --help)"),
    (["-m", "shinken_sync.daemon.server", "--fleet", "2", "--display", "xvfb"], "(see shinkend --help)"),
])
def test_usage_errors_are_one_line_pointing_at_the_right_help(argv, pointer, tmp_path):
    # cwd is a scratch folder: were the argv ever valid, the command's outputs land there, not in the checkout
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, check=False,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(pointer), proc.stderr  # not argparse's whole usage
    assert "usage:" not in proc.stderr


def test_shinkend_help_states_the_token_rule():
    text = shinkend_parser().format_help()
    assert f"at least {MIN_TOKEN_BYTES} bytes" in " ".join(text.split())


def test_routing_replay_layers_help_reads_as_a_sentence():
    parser = session_server_parser()
    (action,) = [a for a in parser._actions if "--routing-replay-layers" in a.option_strings]
    assert "count /samples" not in action.help  # the garbled text it had
    assert "MoE layer count" in action.help and "--reference-r3-layers" in action.help
