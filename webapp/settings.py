"""Parsing of the settings the session server's entry points share: ``HOST:PORT`` binds and
``SHINKEN_<FIELD>`` numbers from the environment.

Imports nothing of the session core or the tokenizers, so the router may use it.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping

__all__ = ["ENV_PREFIX", "float_settings_from_env", "parse_bind"]

ENV_PREFIX = "SHINKEN_"
DEFAULT_HOST = "127.0.0.1"


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6HOST]:PORT`` or ``:PORT`` (host 127.0.0.1) -> ``(host, port)``.

    Raises ``argparse.ArgumentTypeError`` (both users are ``--bind`` options) for anything else.
    """
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"--bind must be HOST:PORT, got {bind!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise argparse.ArgumentTypeError(f"--bind: an IPv6 host goes in brackets ([::1]:PORT), got {bind!r}")
    return host.strip("[]") or DEFAULT_HOST, int(port)


def float_settings_from_env(config_class: type, environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """``SHINKEN_<FIELD>`` (upper case) for every float field of the dataclass ``config_class``
    that the environment sets, as keyword arguments for it.

    Raises ``ValueError`` naming the variable when one is not a number.
    """
    env = os.environ if environ is None else environ
    settings: dict[str, float] = {}
    for name, hint in typing.get_type_hints(config_class).items():
        if hint is not float and hint != (float | None):
            continue
        key = f"{ENV_PREFIX}{name.upper()}"
        if key in env:
            settings[name] = _number(key, env[key])
    return settings


def _number(key: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {raw!r}") from None
