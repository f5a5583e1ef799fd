"""Instance tags and the nginx config (webapp.scaleout) on loopback; the multi-host behaviour
behind nginx is tested in tests/scaleout (network namespaces, root)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import pytest

from webapp.scaleout import Instance, full_config, nginx_config, parse_instance
from webapp.serve import start_session_server
from webapp.sharding import mint_session_id

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "webapp.serve", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_tagged_session_id_starts_with_its_instance_and_fits_the_session_id_pattern():
    from webapp.core import SESSION_ID_PATTERN

    sid = mint_session_id("east")
    assert sid.startswith("east-") and SESSION_ID_PATTERN.fullmatch(sid)
    assert "-" not in mint_session_id()


@pytest.mark.parametrize(("text", "problem"), [
    ("east", "TAG=HOST:PORT"), ("East=127.0.0.1:80", "must match"), ("a-b=127.0.0.1:80", "must match"),
    ("east=127.0.0.1:0", "real port"),
])
def test_a_bad_instance_is_one_usage_line(text, problem):
    result = _cli("nginx-config", text)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert problem in line, line


def test_duplicate_tags_are_refused():
    result = _cli("nginx-config", "a=127.0.0.1:1", "a=127.0.0.1:2")
    assert result.returncode == 2 and "unique" in result.stderr


def test_the_config_routes_each_tag_to_its_own_upstream_only():
    text = nginx_config([parse_instance("a=10.0.0.2:8000"), Instance("b", "::1", 9000)])
    assert "upstream shinken_a {\n    server 10.0.0.2:8000 max_fails=0;" in text
    assert "upstream shinken_b {\n    server [::1]:9000 max_fails=0;" in text
    assert "~^/sessions/a-  a;" in text and "~^/sessions/b-  b;" in text
    assert "proxy_pass http://shinken_$shinken_owner;" in text and "return 503" in text


@pytest.mark.skipif(NGINX is None, reason="needs nginx (Debian package nginx)")
def test_nginx_accepts_the_printed_config(tmp_path):
    out = tmp_path / "nginx.conf"
    result = _cli("nginx-config", "a=127.0.0.1:8001", "b=127.0.0.1:8002", "--listen", "127.0.0.1:18080",
                  "--listen", f"unix:{tmp_path}/n.sock", "--full", str(tmp_path), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_text() == full_config(nginx_config(
        [parse_instance("a=127.0.0.1:8001"), parse_instance("b=127.0.0.1:8002")],
        ["127.0.0.1:18080", f"unix:{tmp_path}/n.sock"]), str(tmp_path))
    check = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", str(out)], capture_output=True, text=True,
                           timeout=30, check=False)
    assert check.returncode == 0, check.stderr


@pytest.mark.integration
@pytest.mark.parametrize("workers", [0, 1])
def test_an_instance_mints_its_tag_into_every_session_id(workers):
    # --workers 0 is the same router over an in-process shard: the tag works there too
    with start_session_server(workers, None, "127.0.0.1:0", "--instance", "east") as server:
        assert server.ready_line["instance"] == "east"
        for _ in range(3):
            req = urllib.request.Request(server.url + "/sessions", method="POST")
            with urllib.request.urlopen(req, timeout=30) as reply:
                assert json.loads(reply.read())["session_id"].startswith("east-")
        with urllib.request.urlopen(server.url + "/health", timeout=30) as reply:
            assert json.loads(reply.read())["instance"] == "east"
