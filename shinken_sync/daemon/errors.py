"""Errors a verb raises to make the daemon answer with an error reply.

The connection worker turns each into one ``reply`` (``outcome`` + ``error.kind``
from :mod:`shinken_sync.protocol`); none of them closes the connection. The tree::

    VerbError                 kind + outcome of the reply (default: error / failed)
    ├── BadArgs               an argument is missing, of the wrong type or out of range (bad_args)
    └── VerbTimeout           the action's own deadline passed (outcome timeout, kind timeout)
    DisplayError              (shinken_sync.daemon.display.base) a display backend failed;
                              answered with its own ``kind``, outcome error

Anything else escaping a verb is a daemon bug: it is logged with its traceback
and answered with kind ``internal``.
"""

from __future__ import annotations

from shinken_sync.protocol import ERR_BAD_ARGS, ERR_FAILED, ERR_TIMEOUT, ERROR, TIMEOUT


class VerbError(Exception):
    """A verb failed; ``kind`` and ``outcome`` go on the wire as they are."""

    def __init__(self, message: str, kind: str = ERR_FAILED, outcome: str = ERROR):
        super().__init__(message)
        self.kind = kind
        self.outcome = outcome


class BadArgs(VerbError):
    def __init__(self, message: str):
        super().__init__(message, ERR_BAD_ARGS)


class VerbTimeout(VerbError):
    def __init__(self, message: str):
        super().__init__(message, ERR_TIMEOUT, TIMEOUT)
