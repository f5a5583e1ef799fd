"""The settings table (webapp.settings.SETTINGS) and everything derived from it: the launcher's
options and environment, the router's and the single-process app's configs, the workers'
config, HttpLimits and the docs table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import requests

from webapp.app import config_from_env
from webapp.core import CoreConfig
from webapp.http_limits import HttpLimits
from webapp.router import RouterConfig
from webapp.serve import build_parser
from webapp.settings import (
    SETTINGS,
    Scope,
    Setting,
    defaults,
    docs_table,
    given_values,
    launcher_env,
    parse_bind,
    values_from_env,
)
from webapp.supervisor import SupervisorConfig

OPS_DOC = Path(__file__).resolve().parents[2] / "docs" / "session-server-ops.md"
BACKEND = {"SHINKEN_BACKEND_URL": "http://127.0.0.1:9"}


@pytest.mark.parametrize("bind, expected", [("127.0.0.1:0", ("127.0.0.1", 0)), (":80", ("127.0.0.1", 80)),
                                            ("[::1]:9", ("::1", 9)), ("0.0.0.0:8000", ("0.0.0.0", 8000))])
def test_parse_bind(bind: str, expected: tuple[str, int]) -> None:
    assert parse_bind(bind) == expected


@pytest.mark.parametrize("bind", ["nope", "host:", "host:-1", "host:65536", "::1:80", "[::1:80"])
def test_parse_bind_refuses(bind: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bind(bind)


def _fields(cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in skip}


@pytest.mark.parametrize("cls, scope, skip", [(CoreConfig, Scope.CORE, ()), (HttpLimits, Scope.HTTP, ()),
                                              (RouterConfig, Scope.ROUTER, ("core",))])
def test_each_config_has_exactly_its_scopes_settings_with_the_tables_defaults(cls: type, scope: Scope,
                                                                              skip: tuple[str, ...]) -> None:
    expected = {s.name: s.default for s in SETTINGS if s.scope is scope}
    fields = _fields(cls, skip)
    if cls is CoreConfig:
        fields["backend_url"] = None  # required in CoreConfig; the table's None means "embedded backend"
    assert fields == expected


def test_supervisor_config_shares_the_router_defaults() -> None:
    router = _fields(RouterConfig, ("core", "workers", "api_key", "control_timeout", "chat_margin", "health_timeout",
                                    "chunk_timeout", "instance", "records_get_pace"))
    supervisor = _fields(SupervisorConfig, ("core", "workers", "restart_backoff", "restart_backoff_max"))
    assert supervisor == router


def test_turn_wait_has_one_rule() -> None:
    # 630 s in SessionCore and 635 s in build_session_core before: one rule now
    assert CoreConfig("u").turn_wait() == 5.0 + 600.0 + 30.0
    assert CoreConfig("u", connect_timeout=1, read_timeout=2).turn_wait() == 33.0
    assert CoreConfig("u", turn_wait_timeout=7.0).turn_wait() == 7.0


def _sample(setting: Setting) -> Any:
    """A legal value that differs from the default."""
    if setting.kind is bool:
        return not setting.default
    if setting.kind is str and setting.choices:
        return next(choice for choice in setting.choices if choice != setting.default)
    if setting.kind is str and setting.pattern:
        return "x1"  # matches the instance tag's pattern
    if setting.kind is str:
        return f"http://127.0.0.1:9/{setting.name}" if setting.name == "backend_url" else f"x-{setting.name}"
    base = setting.default if setting.default is not None else 1
    return setting.kind(base + 3) if setting.kind is int else float(base) + 2.5


def _argv(setting: Setting, value: Any) -> list[str]:
    assert setting.flag is not None
    return [setting.flag] if setting.kind is bool else [setting.flag, str(value)]


def _effective(setting: Setting, env: dict[str, str]) -> list[Any]:
    """The setting's value as each process that uses it would build it from ``env``: the
    single-process app, the router, the router's workers (the CoreConfig each builds from what
    the supervisor hands it), HttpLimits (both modes) or the launcher."""
    if setting.scope is Scope.CORE:
        worker_core = CoreConfig(**RouterConfig.from_env(env).supervisor_config().core)
        return [getattr(config_from_env(env), setting.name), getattr(worker_core, setting.name)]
    if setting.scope is Scope.ROUTER:
        config = RouterConfig.from_env(env)
        supervisor = config.supervisor_config()
        value = getattr(config, setting.name)
        return [value] + ([getattr(supervisor, setting.name)] if hasattr(supervisor, setting.name) else [])
    if setting.scope is Scope.HTTP:
        return [getattr(HttpLimits.from_env(env), setting.name)]
    return [values_from_env(env)[setting.name]]


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_every_setting_takes_effect_from_its_variable_and_its_flag(setting: Setting) -> None:
    value = _sample(setting)
    assert setting.env_var is not None
    shown = ("1" if value else "0") if setting.kind is bool else str(value)
    assert _effective(setting, {**BACKEND, setting.env_var: shown}) != []
    assert set(map(str, _effective(setting, {**BACKEND, setting.env_var: shown}))) == {str(value)}
    # the launcher: the flag -> the environment it hands gunicorn (router or single-process app)
    args = build_parser().parse_args(_argv(setting, value))
    env = launcher_env({**defaults(), "backend_url": BACKEND["SHINKEN_BACKEND_URL"], **given_values(args, {})}, {})
    assert env[setting.env_var] == shown
    assert {str(v) for v in _effective(setting, env)} == {str(value)}


def test_a_flag_wins_over_the_variable_which_wins_over_the_default() -> None:
    args = build_parser().parse_args(["--read-timeout", "3"])
    assert given_values(args, {"SHINKEN_READ_TIMEOUT": "4", "SHINKEN_CONNECT_TIMEOUT": "2"}) == {
        "read_timeout": 3.0, "connect_timeout": 2.0}
    env = launcher_env({**defaults(), **given_values(build_parser().parse_args([]), BACKEND)}, BACKEND)
    assert RouterConfig.from_env(env).core["read_timeout"] == 600.0 and "SHINKEN_TURN_WAIT_TIMEOUT" not in env


def test_turn_wait_timeout_reaches_the_workers() -> None:
    # a regression once: with --workers >= 1 the router dropped it on the way to its workers
    env = {**BACKEND, "SHINKEN_TURN_WAIT_TIMEOUT": "7"}
    assert CoreConfig(**RouterConfig.from_env(env).supervisor_config().core).turn_wait() == 7.0
    assert config_from_env(env).turn_wait() == 7.0


@pytest.mark.parametrize("key, raw, wanted", [
    ("SHINKEN_READ_TIMEOUT", "soon", "a number"), ("SHINKEN_MAX_SESSIONS", "1.5", "a whole number"),
    ("SHINKEN_ROUTING_REPLAY_LAYERS", "-1", ">= 0"), ("SHINKEN_INDEXER_REPLAY", "maybe", "a boolean"),
    ("SHINKEN_BODY_TIMEOUT", "-2", ">= 0")])
def test_a_bad_variable_is_named(key: str, raw: str, wanted: str) -> None:
    with pytest.raises(ValueError, match=f"{key} must be {re.escape(wanted)}"):
        values_from_env({key: raw})


def test_a_string_setting_may_name_its_choices() -> None:
    mode = Setting("mode", str, "a", Scope.CORE, "a mode", choices=("a", "b"))
    assert mode.parse(" b ") == "b"
    with pytest.raises(ValueError, match="must be one of a, b, got 'c'"):
        mode.parse("c")


def test_a_bad_flag_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--max-sessions", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--max-sessions: must be >= 1" in err


def test_every_flag_is_in_help() -> None:
    text = build_parser().format_help()
    for setting in SETTINGS:
        if setting.flag:
            assert setting.flag in text and str(setting.env_var) in text


def test_the_docs_table_is_the_generated_one() -> None:
    text = OPS_DOC.read_text(encoding="utf-8")
    begin, end = "<!-- settings-table:begin -->\n", "<!-- settings-table:end -->"
    assert begin in text and end in text, f"{OPS_DOC} lost its settings table markers"
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == docs_table(), "regenerate: python -c 'from webapp.settings import docs_table; " \
                                  "print(docs_table(), end=\"\")'"


@pytest.mark.integration
def test_real_workers_run_with_the_whole_config_from_the_environment(reference_backend_factory,
                                                                    tmp_path) -> None:
    """The router process reads SHINKEN_* as under the launcher; each real worker process echoes
    the CoreConfig it built (turn_wait_timeout was dropped on the way before)."""
    backend = reference_backend_factory()
    env = {**os.environ, "SHINKEN_BACKEND_URL": backend.url, "SHINKEN_WORKERS": "2",
           "SHINKEN_TURN_WAIT_TIMEOUT": "7", "SHINKEN_POOL_MAXSIZE": "5", "SHINKEN_MAX_SESSIONS": "9",
           "SHINKEN_INDEXER_REPLAY": "1", "SHINKEN_DATA_DIR": str(tmp_path / "data"), "SHINKEN_FSYNC": "1"}
    script = textwrap.dedent("""
        from gevent import monkey; monkey.patch_all()
        import json
        from webapp.router import create_app, start_supervisor, stop_supervisor
        app = create_app()
        start_supervisor(app)
        supervisor = app.extensions["shinken_supervisor"]
        assert supervisor.wait_ready(60), supervisor.status()
        print(json.dumps([slot["config"] for slot in supervisor.status()]))
        stop_supervisor(app)
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    configs = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {**dataclasses.asdict(CoreConfig(backend.url)), "turn_wait_timeout": 7.0, "pool_maxsize": 5,
                "max_sessions": 9, "indexer_replay": True, "data_dir": str(tmp_path / "data"), "fsync": True}
    assert configs == [expected, expected]


@pytest.mark.integration
@pytest.mark.parametrize("workers", [0, 1])
def test_a_variable_reaches_the_session_core_through_the_launcher(workers: int, reference_backend_factory,
                                                                  session_server_factory) -> None:
    backend = reference_backend_factory()
    server = session_server_factory.launch(workers, backend.url, env={"SHINKEN_MAX_SESSIONS": "1"})
    first = requests.post(f"{server.url}/sessions", timeout=30)
    second = requests.post(f"{server.url}/sessions", timeout=30)
    assert first.status_code == 200 and second.status_code == 429 and "max_sessions=1" in second.json()["error"]
