"""Command-line conventions shared by ``shinken`` and ``shinken-session-server``.

* :class:`Parser`: a usage error is ONE line on stderr naming the cause and where the
  fix is documented, exit code 2 (argparse's default prints the whole usage first); an
  unknown option after a subcommand points at that subcommand's ``--help``; ``--version``
  prints the package's one version (``shinken_sync.__version__``);
* :class:`HelpFormatter`: every option's help shows its default;
* typed converters whose errors say what is wanted (argparse's own message for a
  failing ``type=`` names the function: ``invalid _positive value``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from shinken_sync import __version__

__all__ = ["EXIT_USAGE", "HelpFormatter", "Parser", "non_negative_int", "port", "positive_int"]

EXIT_USAGE = 2  # argparse's, and what every CLI error of ours exits with


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` unless the help already names its default or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is None
                or action.default is argparse.SUPPRESS or isinstance(action.default, bool)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with :class:`HelpFormatter` and one-line usage errors.

    ``version=True`` (a command's top-level parser) adds ``--version``."""

    def __init__(self, *args: Any, version: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        if version:
            self.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                              help="print the version and exit")

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        # argparse reports options unknown to a subcommand from the top-level parser, whose
        # --help does not list them: the subcommand that was chosen reports them instead.
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.chosen_command(parsed).error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def chosen_command(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the (sub)command that ``parsed`` chose; this one when it has none."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest or "", None) or "")
                if isinstance(chosen, Parser):
                    return chosen.chosen_command(parsed)
        return self


def _int(text: str, wanted: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; pass {wanted}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small; pass an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; pass an integer >= 0")
    return value


def port(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535."""
    value = _int(text, "a port number from 0 (any free port) to 65535")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port; pass 0 (any free port) to 65535")
    return value
