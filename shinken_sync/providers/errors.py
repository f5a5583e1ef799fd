"""Errors the providers raise. They hang off the SDK's root error::

    ShinkenError                       (shinken_sync.errors)
    └── ProviderError                  a provider could not do what was asked
        ├── DaemonStartError           a shinkend process did not report ready
        │                              (exit_code / signal / stderr_tail say why)
        ├── IsolationUnavailable       an isolated sandbox cannot be built here: what is missing
        │   │                          and the fix, in one line (no bwrap, no root filesystem,
        │   │                          namespaces refused)
        │   └── CgroupUnavailable      its cgroup limits cannot be set up or removed
        ├── ProviderConfigError        a provider config is malformed (unknown key, wrong type)
        ├── ProviderExhausted          a fixed-size provider has no sandbox left to hand out
        └── UnknownHandle              the handle was not created by this provider
"""

from __future__ import annotations

from shinken_sync.errors import ShinkenError


class ProviderError(ShinkenError):
    """A provider could not create, reach or destroy a sandbox."""


class DaemonStartError(ProviderError):
    """shinkend exited, or stayed silent, before printing its ready line."""

    def __init__(
        self,
        message: str,
        *,
        exit_code: int | None = None,
        signal: int | None = None,
        stderr_tail: str = "",
    ):
        super().__init__(message)
        self.exit_code = exit_code
        self.signal = signal
        self.stderr_tail = stderr_tail

    def __str__(self) -> str:
        text: str = self.args[0]  # the message __init__ took
        if self.stderr_tail:
            text += "\n--- shinkend stderr (tail) ---\n" + self.stderr_tail
        return text


class ProviderExhausted(ProviderError):
    """Every sandbox of a fixed-size provider (static list, fleet host) is handed out."""


class UnknownHandle(ProviderError):
    """The handle does not belong to this provider (or was already destroyed and forgotten)."""


class IsolationUnavailable(ProviderError):
    """An isolated sandbox cannot be built on this host; the message names what is
    missing and the fix (and quotes bubblewrap's own words when it refused)."""


class CgroupUnavailable(IsolationUnavailable):
    """The sandbox's cgroup (memory, CPU, pids limits) cannot be created, set or removed."""


class ProviderConfigError(ProviderError, ValueError):
    """A provider config is malformed: an unknown ``type`` or key, or a value of the wrong type."""
