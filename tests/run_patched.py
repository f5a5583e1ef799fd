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
    sys.exit(pytest.main(sys.argv[1:]))
