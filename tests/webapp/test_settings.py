"""The settings parsing shared by the server, router, single-process app and reference backend."""

from __future__ import annotations

import argparse

import pytest

from webapp.core import CoreConfig
from webapp.router import RouterConfig
from webapp.settings import (
    float_settings_from_env,
    number_settings_from_env,
    parse_bind,
    replay_settings_from_env,
)


@pytest.mark.parametrize("bind, expected", [("127.0.0.1:0", ("127.0.0.1", 0)), (":80", ("127.0.0.1", 80)),
                                            ("[::1]:9", ("::1", 9)), ("0.0.0.0:8000", ("0.0.0.0", 8000))])
def test_parse_bind(bind: str, expected: tuple[str, int]) -> None:
    assert parse_bind(bind) == expected


@pytest.mark.parametrize("bind", ["nope", "host:", "host:-1", "host:65536", "::1:80", "[::1:80"])
def test_parse_bind_refuses(bind: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bind(bind)


def test_float_settings_from_env() -> None:
    env = {"SHINKEN_READ_TIMEOUT": "0.5", "SHINKEN_TURN_WAIT_TIMEOUT": "7", "SHINKEN_POOL_MAXSIZE": "3",
           "SHINKEN_CHAT_MARGIN": "1"}
    assert float_settings_from_env(CoreConfig, env) == {"read_timeout": 0.5, "turn_wait_timeout": 7.0}
    assert float_settings_from_env(RouterConfig, env) == {"read_timeout": 0.5, "chat_margin": 1.0}
    with pytest.raises(ValueError, match="SHINKEN_READ_TIMEOUT"):
        float_settings_from_env(CoreConfig, {"SHINKEN_READ_TIMEOUT": "soon"})


def test_replay_settings_from_env_reach_the_core_and_the_router_workers() -> None:
    env = {"SHINKEN_BACKEND_URL": "http://b", "SHINKEN_ROUTING_REPLAY_LAYERS": "48", "SHINKEN_INDEXER_REPLAY": "true"}
    assert replay_settings_from_env(env) == {"routing_replay_layers": 48, "indexer_replay": True}
    assert replay_settings_from_env({"SHINKEN_INDEXER_REPLAY": "0"}) == {"indexer_replay": False}
    assert replay_settings_from_env({}) == {}
    core = RouterConfig.from_env(env).supervisor_config().core  # what each worker's CoreConfig gets
    assert CoreConfig(**core).routing_replay_layers == 48 and CoreConfig(**core).indexer_replay is True
    for key, bad in (("SHINKEN_ROUTING_REPLAY_LAYERS", "-1"), ("SHINKEN_ROUTING_REPLAY_LAYERS", "many"),
                     ("SHINKEN_INDEXER_REPLAY", "maybe")):
        with pytest.raises(ValueError, match=key):
            replay_settings_from_env({key: bad})


def test_number_settings_from_env_reads_int_fields_too() -> None:
    env = {"SHINKEN_MAX_SESSIONS": "3", "SHINKEN_MAX_PROMPT_TOKENS": "100", "SHINKEN_SESSION_IDLE_TTL": "2",
           "SHINKEN_READ_TIMEOUT": "0.5"}
    expected = {"max_sessions": 3, "max_prompt_tokens": 100, "session_idle_ttl": 2.0, "read_timeout": 0.5}
    assert number_settings_from_env(CoreConfig, env) == expected
    # the router holds them as optional ints (None: the core's default) and hands them to every worker
    core = RouterConfig.from_env({"SHINKEN_BACKEND_URL": "http://b", **env}).supervisor_config().core
    assert {k: core[k] for k in ("max_sessions", "max_prompt_tokens", "session_idle_ttl")} == {
        "max_sessions": 3, "max_prompt_tokens": 100, "session_idle_ttl": 2.0}
    assert "max_message_bytes" not in core
    with pytest.raises(ValueError, match="SHINKEN_MAX_SESSIONS must be an integer"):
        number_settings_from_env(CoreConfig, {"SHINKEN_MAX_SESSIONS": "1.5"})


def test_image_limits_are_settings_of_both_modes() -> None:
    env = {"SHINKEN_MAX_IMAGE_BYTES": "5000", "SHINKEN_MAX_IMAGES": "4"}
    assert number_settings_from_env(CoreConfig, env) == {"max_image_bytes": 5000, "max_images": 4}
    core = RouterConfig.from_env({"SHINKEN_BACKEND_URL": "http://b", **env}).supervisor_config().core
    assert (core["max_image_bytes"], core["max_images"]) == (5000, 4)
    assert "max_images" not in RouterConfig.from_env({"SHINKEN_BACKEND_URL": "http://b"}).supervisor_config().core
