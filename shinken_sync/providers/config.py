"""Typed provider configs, one per substrate, and the one factory that builds providers.

Each config is a frozen dataclass whose ``type`` field names its substrate::

    type       config             provider
    local      LocalConfig        LocalProvider       one shinkend process per sandbox, on loopback
    fleet      FleetConfig        LocalFleetProvider  N virtual sandboxes in one shinkend
    static     StaticConfig       StaticProvider      sandboxes already running elsewhere
    ray        RayConfig          RayProvider         sandbox hosts as actors on a Ray cluster
    isolated   IsolatedConfig     IsolatedProvider    each shinkend in its own namespaces + cgroup

:func:`make_provider` takes a config (or its dict form, e.g. parsed from JSON or TOML)
and returns the provider; :func:`config_from_dict` refuses an unknown ``type`` or key
and a value of the wrong type with :class:`~.errors.ProviderConfigError`. Providers
are imported on use, so a config never loads Ray (or bubblewrap checks) it does not name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from .errors import ProviderConfigError
from .isolated import Isolation
from .process import DEFAULT_START_TIMEOUT_S

if typing.TYPE_CHECKING:
    from .base import Provider

__all__ = [
    "FleetConfig", "IsolatedConfig", "LocalConfig", "ProviderConfig", "RayConfig", "StaticConfig",
    "config_from_dict", "make_provider",
]  # fmt: skip


@dataclass(frozen=True)
class _DaemonOptions:
    """What every shinkend-starting provider passes to its daemons (``create`` defaults)."""

    display: str = "virtual"
    screen: tuple[int, int] = (1920, 1080)
    rtt_ms: float = 0.0
    #: More shinkend flags, passed through (a desktop's options, ``--launch ...``).
    extra_args: tuple[str, ...] = ()
    start_timeout: float = DEFAULT_START_TIMEOUT_S


@dataclass(frozen=True)
class LocalConfig(_DaemonOptions):
    type: Literal["local"] = field(default="local", init=False)
    stream_grace: float | None = None

    def build(self) -> Provider[Any]:
        from .local import LocalProvider

        return LocalProvider(self.display, self.screen, self.rtt_ms, stream_grace=self.stream_grace,
                             extra_args=list(self.extra_args), start_timeout=self.start_timeout)  # fmt: skip


@dataclass(frozen=True)
class FleetConfig:
    type: Literal["fleet"] = field(default="fleet", init=False)
    n: int = 16
    screen: tuple[int, int] = (1920, 1080)
    rtt_ms: float = 0.0
    extra_args: tuple[str, ...] = ()
    start_timeout: float = DEFAULT_START_TIMEOUT_S

    def build(self) -> Provider[Any]:
        from .local import LocalFleetProvider

        return LocalFleetProvider(self.n, self.screen, self.rtt_ms, extra_args=list(self.extra_args),
                                  start_timeout=self.start_timeout)  # fmt: skip


@dataclass(frozen=True)
class StaticConfig:
    type: Literal["static"] = field(default="static", init=False)
    #: ``(url, token)`` pairs, handed out in order.
    endpoints: tuple[tuple[str, str], ...] = ()

    def build(self) -> Provider[Any]:
        from .static import StaticProvider

        return StaticProvider([tuple(e) for e in self.endpoints])  # type: ignore[misc]


@dataclass(frozen=True)
class RayConfig(_DaemonOptions):
    type: Literal["ray"] = field(default="ray", init=False)
    address: str | None = None
    strategy: Literal["spread", "pack"] = "spread"
    sandboxes_per_host: int = 1
    num_cpus: float = 0.0
    memory: int | None = None
    use_sandbox_resource: bool = True

    def build(self) -> Provider[Any]:
        from .ray_cluster import RayProvider

        return RayProvider(
            address=self.address, strategy=self.strategy, sandboxes_per_host=self.sandboxes_per_host,
            num_cpus=self.num_cpus, memory=self.memory, use_sandbox_resource=self.use_sandbox_resource,
            display=self.display, screen=self.screen, rtt_ms=self.rtt_ms, extra_args=list(self.extra_args),
            start_timeout=self.start_timeout,
        )  # fmt: skip


@dataclass(frozen=True)
class IsolatedConfig(_DaemonOptions):
    type: Literal["isolated"] = field(default="isolated", init=False)
    stream_grace: float | None = None
    #: How each sandbox is isolated (root filesystem, limits, uids; see providers.isolated.Isolation).
    isolation: Isolation = field(default_factory=Isolation)

    def build(self) -> Provider[Any]:
        from .isolated import IsolatedProvider

        return IsolatedProvider(self.display, self.screen, self.rtt_ms, stream_grace=self.stream_grace,
                                extra_args=list(self.extra_args), start_timeout=self.start_timeout,
                                isolation=self.isolation)  # fmt: skip


ProviderConfig = LocalConfig | FleetConfig | StaticConfig | RayConfig | IsolatedConfig
#: ``type`` -> its config class: the one table the factory and the parser read.
CONFIGS: dict[str, type[Any]] = {
    str(cls.__dataclass_fields__["type"].default): cls
    for cls in (LocalConfig, FleetConfig, StaticConfig, RayConfig, IsolatedConfig)
}


def make_provider(config: ProviderConfig | dict[str, Any]) -> Provider[Any]:
    """The provider ``config`` describes (a config object, or its dict form)."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    if not isinstance(config, tuple(CONFIGS.values())):
        raise ProviderConfigError(f"not a provider config: {config!r}; pass one of {sorted(CONFIGS)} configs")
    return config.build()


def config_from_dict(data: dict[str, Any]) -> ProviderConfig:
    """A config from its dict form: ``{"type": "isolated", "display": "xvfb", "isolation":
    {"memory_mb": 1024}}``. Unknown types and keys, and values of the wrong type, raise
    :class:`ProviderConfigError` naming them."""
    if not isinstance(data, dict):
        raise ProviderConfigError(f"a provider config is an object, not {type(data).__name__}")
    kind = data.get("type")
    cls = CONFIGS.get(kind) if isinstance(kind, str) else None
    if cls is None or not isinstance(kind, str):
        raise ProviderConfigError(f"provider config type {kind!r} is unknown; known: {sorted(CONFIGS)}")
    config: ProviderConfig = _build(cls, {k: v for k, v in data.items() if k != "type"}, kind)
    return config


def _build(cls: type[Any], data: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ProviderConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    return cls(**{name: _convert(hints[name], value, f"{where}.{name}") for name, value in data.items()})


def _convert(hint: Any, value: Any, where: str) -> Any:
    """``value`` as ``hint`` wants it (lists become tuples), or ProviderConfigError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(option, value, where)
            except ProviderConfigError:
                continue
        raise ProviderConfigError(f"{where} must be {_name(hint)}, not {value!r}")
    if origin is Literal:
        if value not in args:
            raise ProviderConfigError(f"{where} must be one of {list(args)}, not {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ProviderConfigError(f"{where} must be a list, not {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ProviderConfigError(f"{where} must have {len(args)} items, not {len(value)}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ProviderConfigError(f"{where} must be an object, not {type(value).__name__}")
        return _build(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and (hint is bool or not isinstance(value, bool))):
        raise ProviderConfigError(f"{where} must be {hint.__name__}, not {value!r}")
    return value


def _name(hint: Any) -> str:
    return " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(hint))
