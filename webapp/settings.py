"""Parsing of the settings the session server's entry points share: ``HOST:PORT`` binds and
``SHINKEN_<FIELD>`` numbers (float and int fields) from the environment.

Imports nothing of the session core or the tokenizers, so the router may use it.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping

__all__ = ["ENV_PREFIX", "REPLAY_SETTINGS", "float_settings_from_env", "number_settings_from_env", "parse_bind",
           "replay_settings_from_env"]

ENV_PREFIX = "SHINKEN_"
DEFAULT_HOST = "127.0.0.1"
# The replay settings of the session core (``webapp.core.CoreConfig`` fields), declared once:
# name -> type. The router carries them to its workers, the single-process app reads them
# directly; ``shinken-session-server`` sets them from ``--routing-replay-layers`` /
# ``--indexer-replay``.
REPLAY_SETTINGS: dict[str, type] = {"routing_replay_layers": int, "indexer_replay": bool}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


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


def number_settings_from_env(config_class: type, environ: Mapping[str, str] | None = None,
                             kinds: tuple[type, ...] = (float, int)) -> dict[str, float | int]:
    """``SHINKEN_<FIELD>`` (upper case) for every number field (of ``kinds``: float, int, or
    either of them ``| None``) of the dataclass ``config_class`` that the environment sets, as
    keyword arguments for it.

    Raises ``ValueError`` naming the variable when one is not a number of the field's kind.
    """
    env = os.environ if environ is None else environ
    settings: dict[str, float | int] = {}
    for name, hint in typing.get_type_hints(config_class).items():
        kind = next((k for k in kinds if hint is k or hint == (k | None)), None)
        if kind is None:
            continue
        key = f"{ENV_PREFIX}{name.upper()}"
        if key in env:
            settings[name] = _number(key, env[key], kind)
    return settings


def float_settings_from_env(config_class: type, environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """:func:`number_settings_from_env` for the float fields only."""
    return number_settings_from_env(config_class, environ, (float,))  # type: ignore[return-value]


def _number(key: str, raw: str, kind: type = float) -> float | int:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None


def replay_settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, int | bool]:
    """``SHINKEN_ROUTING_REPLAY_LAYERS`` (an integer >= 0) and ``SHINKEN_INDEXER_REPLAY`` (a
    boolean: 1/0, true/false, yes/no, on/off) when set, as :data:`REPLAY_SETTINGS` keywords.

    Raises ``ValueError`` naming the variable when one does not parse.
    """
    env = os.environ if environ is None else environ
    settings: dict[str, int | bool] = {}
    for name, kind in REPLAY_SETTINGS.items():
        key = f"{ENV_PREFIX}{name.upper()}"
        if key not in env:
            continue
        raw = env[key].strip()
        if kind is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(f"{key} must be a boolean (1/0, true/false), got {raw!r}")
            settings[name] = raw.lower() in _TRUE
        else:
            if not raw.isdigit():
                raise ValueError(f"{key} must be an integer >= 0, got {raw!r}")
            settings[name] = int(raw)
    return settings
