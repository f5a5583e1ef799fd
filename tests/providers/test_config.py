"""Provider configs and the factory: every substrate by its type, unknown keys and bad values refused."""

from __future__ import annotations

import json

import pytest

from shinken_sync.providers import ProviderError, ProviderExhausted, StaticProvider
from shinken_sync.providers.config import (
    CONFIGS,
    FleetConfig,
    IsolatedConfig,
    LocalConfig,
    StaticConfig,
    config_from_dict,
    make_provider,
)
from shinken_sync.providers.errors import ProviderConfigError
from shinken_sync.providers.isolated import Isolation


def test_every_substrate_has_one_config_with_its_type() -> None:
    assert sorted(CONFIGS) == ["fleet", "isolated", "local", "ray", "static"]
    for kind, cls in CONFIGS.items():
        assert cls().type == kind
        with pytest.raises(TypeError):
            cls(type="other")  # the type is the class's, not a choice


def test_a_dict_form_round_trips_through_json() -> None:
    text = json.dumps({"type": "isolated", "display": "xvfb", "screen": [1280, 800], "extra_args": ["--seed", "3"],
                       "isolation": {"memory_mb": 1024, "cpus": 2, "ro_binds": ["/opt/fonts"], "rootfs": None}})
    config = config_from_dict(json.loads(text))
    assert config == IsolatedConfig(display="xvfb", screen=(1280, 800), extra_args=("--seed", "3"),
                                    isolation=Isolation(memory_mb=1024, cpus=2.0, ro_binds=("/opt/fonts",)))
    assert config_from_dict({"type": "fleet", "n": 4}) == FleetConfig(n=4)
    assert config_from_dict({"type": "static", "endpoints": [["ws://h/sb/0", "t" * 16]]}).endpoints == (
        ("ws://h/sb/0", "t" * 16),)


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"type": "nope"}, "'nope' is unknown"),
        ({"display": "virtual"}, "None is unknown"),
        ({"type": "local", "dispaly": "xvfb"}, "unknown key(s) ['dispaly']"),
        ({"type": "isolated", "isolation": {"memroy_mb": 1}}, "isolated.isolation: unknown key(s) ['memroy_mb']"),
        ({"type": "local", "rtt_ms": "fast"}, "local.rtt_ms must be float"),
        ({"type": "local", "rtt_ms": True}, "local.rtt_ms must be float"),
        ({"type": "fleet", "n": 2.5}, "fleet.n must be int"),
        ({"type": "local", "screen": [1920]}, "local.screen must have 2 items"),
        ({"type": "local", "extra_args": "--seed 3"}, "local.extra_args must be a list"),
        ({"type": "ray", "strategy": "scatter"}, "ray.strategy must be one of ['spread', 'pack']"),
        ({"type": "isolated", "isolation": {"memory_mb": "lots"}}, "isolated.isolation.memory_mb must be int"),
        ({"type": "isolated", "isolation": []}, "isolated.isolation must be an object"),
    ],
)
def test_bad_configs_are_refused_with_a_typed_error(data: dict, names: str) -> None:
    with pytest.raises(ProviderConfigError) as err:
        config_from_dict(data)
    assert names in str(err.value)
    assert isinstance(err.value, ProviderError) and isinstance(err.value, ValueError)


def test_the_factory_builds_each_provider() -> None:
    provider = make_provider({"type": "static", "endpoints": [["ws://127.0.0.1:1/sb/0", "x" * 16]]})
    assert isinstance(provider, StaticProvider)
    assert make_provider(StaticConfig()).__class__ is StaticProvider
    with pytest.raises(ProviderConfigError):
        make_provider(Isolation())  # type: ignore[arg-type]
    assert LocalConfig().display == "virtual"


def test_create_many_is_on_the_interface_and_all_or_nothing() -> None:
    provider = StaticProvider([(f"ws://127.0.0.1:1/sb/{i}", "x" * 16) for i in range(3)])
    first, second = provider.create_many(2)
    assert (first.index, second.index) == (0, 1)
    with pytest.raises(ProviderExhausted):  # one left, two asked: the third is taken, then destroyed
        provider.create_many(2)
    with pytest.raises(ProviderExhausted):
        provider.create()
    with pytest.raises(ValueError):
        provider.create_many(1, parallelism=0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ray", "'local' or 'isolated'"),
        ("{not json", "not a provider type nor a JSON object"),
        ('{"type": "local", "screan": [1, 2]}', "unknown key(s) ['screan']"),
        ("@/nonexistent/provider.json", "cannot read"),
    ],
)
def test_the_demo_refuses_a_bad_provider_in_one_line(spec: str, message: str) -> None:
    from shinken_sync.demo import DemoError, provider_config

    with pytest.raises(DemoError) as err:
        provider_config(spec, "virtual")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_demo_fills_a_provider_config_with_its_screen_and_display(tmp_path) -> None:
    from shinken_sync.demo import SCREEN, provider_config

    assert provider_config("isolated", "virtual") == IsolatedConfig(screen=SCREEN)
    path = tmp_path / "p.json"
    path.write_text('{"type": "local", "rtt_ms": 50}')
    assert provider_config(f"@{path}", "virtual") == LocalConfig(screen=SCREEN, rtt_ms=50.0)
