"""What a provider knows about one sandbox: :class:`Liveness`.

Its own module, with no imports from the SDK, because both sides need it: the
providers answer with it (``Provider.check_alive``) and the client core reads
it when a connection drops. Defined in ``providers.base`` it made the circle
``client -> providers.base -> client``; ``providers.base``
re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Liveness:
    """What a provider knows about one sandbox right now.

    ``exit_code`` is set when the sandbox exited on its own, ``signal`` when it
    was killed by one (``oom`` when the kernel's OOM killer did it and the
    provider can tell). Providers that cannot introspect report
    ``alive=True`` with ``detail="unknown"``.
    """

    alive: bool
    exit_code: int | None = None
    signal: int | None = None
    oom: bool = False
    detail: str = ""
