"""Run pytest inside a gevent-monkey-patched process (tox's ``gevent`` env).

Patching must come first, before pytest or anything it imports touches
threading, sockets or ssl; every SDK test then runs with greenlets for threads.

    python tests/run_patched.py tests/sdk tests/daemon [pytest args...]
"""

from gevent import monkey

monkey.patch_all()

# Imported after patching, on purpose.
import sys

import pytest

if __name__ == "__main__":
    # anyio's pytest plugin (pulled in by openai) imports trio when installed,
    # and trio needs select.epoll, which patching removes.
    sys.exit(pytest.main(["-p", "no:anyio", *sys.argv[1:]]))
