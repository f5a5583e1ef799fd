"""The gunicorn worker reads its settings once (``webapp.gunicorn_worker.SettingsReadOnce``)."""

from __future__ import annotations

import os

import pytest
from gunicorn.config import Config

from webapp.gunicorn_worker import SessionServerWorker, SettingsReadOnce


def test_a_setting_is_read_from_the_config_once_then_kept() -> None:
    cfg = Config()
    cfg.set("keepalive", 7)
    settings = SettingsReadOnce(cfg)
    assert "keepalive" not in vars(settings)
    assert settings.keepalive == 7
    assert vars(settings)["keepalive"] == 7  # a plain attribute now: no __getattr__ on the next read
    assert settings.is_ssl is cfg.is_ssl  # Config's properties too
    assert settings.settings is cfg.settings


def test_an_unknown_setting_raises_and_nothing_is_kept_and_settings_are_read_only() -> None:
    settings = SettingsReadOnce(Config())
    with pytest.raises(AttributeError):
        _ = settings.no_such_setting
    assert "no_such_setting" not in vars(settings)
    with pytest.raises(AttributeError):
        settings.keepalive = 1


def test_the_session_server_worker_reads_its_settings_once(tmp_path: os.PathLike[str]) -> None:
    cfg = Config()
    cfg.set("worker_tmp_dir", str(tmp_path))
    cfg.set("worker_connections", 123)
    worker = SessionServerWorker(0, os.getpid(), [], None, 30, cfg, None)
    try:
        assert isinstance(worker.cfg, SettingsReadOnce)
        assert worker.worker_connections == 123
        assert worker.cfg.worker_connections == 123 and "worker_connections" in vars(worker.cfg)
    finally:
        worker.tmp.close()
