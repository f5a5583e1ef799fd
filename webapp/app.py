"""The single-process session server: the router (:mod:`webapp.router`, the one HTTP
surface) over one in-process shard (:class:`webapp.local_shard.LocalShard`).

``gunicorn -k gevent --no-control-socket 'webapp.app:create_app()'`` serves it (the flag: gunicorn 25.1+). Settings come
from the arguments or, when ``config`` is None, from the environment: ``SHINKEN_<NAME>`` for
every ``core``, ``router``, ``http`` and ``launcher`` setting of :data:`webapp.settings.SETTINGS`
(the same variables ``shinken-session-server`` sets). Without ``SHINKEN_BACKEND_URL`` the app
starts the reference backend (``webapp.reference_backend``) as a subprocess of its own, the
embedded default, with ``SHINKEN_REFERENCE_R3_LAYERS`` / ``SHINKEN_REFERENCE_R3_TOPK`` (routing
replay follows its R3 unless set).

Routes, auth (``api_key``), instance tags, limits, error shapes, ``/health`` and the viewer are
the router's: both server modes answer every request the same way (the route-parity tests).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from flask import Flask

from webapp.core import CoreConfig
from webapp.http_limits import HttpLimits
from webapp.local_shard import LocalShard
from webapp.reference_backend import ReferenceBackendProcess, start_reference_backend
from webapp.router import RouterConfig
from webapp.router import create_app as create_router_app
from webapp.settings import BY_NAME, Scope, embedded_replay_layers, scope_values, values_from_env

__all__ = ["CORE_EXTENSION_KEY", "config_from_env", "create_app"]

CORE_EXTENSION_KEY = "shinken_session_core"
API_KEY_ENV: str = BY_NAME["api_key"].env_var or ""


def config_from_env(environ: Mapping[str, str] | None = None, **kw: Any) -> CoreConfig:
    """The ``CoreConfig`` the environment describes (the ``core`` settings of
    :data:`webapp.settings.SETTINGS`), ``kw`` overriding it; ``backend_url`` may be None (the
    embedded backend: routing replay then follows its R3 unless set)."""
    given = {**values_from_env(environ, (Scope.CORE, Scope.LAUNCHER)), **kw}
    if not given.get("backend_url"):
        given["routing_replay_layers"] = embedded_replay_layers(given)
    return CoreConfig(**scope_values(Scope.CORE, given))


def _config_from_env(kw: dict[str, Any]) -> tuple[CoreConfig, ReferenceBackendProcess | None]:
    config, reference = config_from_env(**kw), None
    if not config.backend_url:
        launcher = scope_values(Scope.LAUNCHER, values_from_env(None, (Scope.LAUNCHER,)))
        reference = start_reference_backend(tokenizer=config.tokenizer, r3_layers=launcher["reference_r3_layers"],
                                            r3_topk=launcher["reference_r3_topk"])
        config = dataclasses.replace(config, backend_url=reference.url)
    return config, reference


def create_app(config: CoreConfig | None = None, *, api_key: str | None = None, **kw: Any) -> Flask:
    """The single-process session server app.

    ``config`` wins; keyword arguments override its fields (or, without it, build one with the
    environment as described in the module docstring, the router settings too). ``api_key``
    (else ``SHINKEN_API_KEY``): enforced on every route but ``/health``, as in the multi-process
    mode, so running this app under gunicorn directly never serves unauthenticated.
    """
    if config is None:
        config, reference = _config_from_env(dict(kw))
        router_values = values_from_env(None, (Scope.ROUTER,))
    else:
        config, reference = dataclasses.replace(config, **kw), None
        router_values = {}
    router_values["api_key"] = api_key or router_values.get("api_key") or os.environ.get(API_KEY_ENV) or None
    router_values["workers"] = 0
    router = RouterConfig(core=dataclasses.asdict(config), **router_values)
    local: list[LocalShard] = []

    def one_local_shard(final: RouterConfig) -> LocalShard:  # built once the data directory is locked
        local.append(LocalShard(CoreConfig(**final.core)))
        return local[0]

    app = create_router_app(router, HttpLimits.from_env(), shards=one_local_shard)

    def shutdown() -> None:
        local[0].stop()
        if reference is not None:
            reference.close()

    atexit.register(shutdown)
    app.extensions[CORE_EXTENSION_KEY] = local[0].core
    return app

