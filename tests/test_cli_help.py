"""Every command-line option of ours has help text that shows its default, without reST markup."""

from __future__ import annotations

import argparse

import pytest

from shinken_sync.cli import build_parser as shinken_parser
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
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action) if action.help else ""
        assert text, f"{name} {action.option_strings[0]} has no help"
        if action.required:
            continue
        assert "default" in text, f"{name} {action.option_strings[0]}: no default in {text!r}"
    assert "``" not in parser.format_help(), f"{name} --help shows reST markup"
