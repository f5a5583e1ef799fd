"""Shared webapp fixtures: real processes on 127.0.0.1 with OS-chosen ports.

- ``reference_backend_factory(tokenizer=None, r3_layers=0, r3_topk=8)`` -> a running
  ``webapp.reference_backend`` subprocess (``.url``, ``.close()``); ``backend``: one with the
  defaults per module.
- ``session_server_factory(argv=None, env=None, backend_url=None, ...)`` -> a running server
  (``.url``, ``.output()``, ``.close()``). Default argv: gunicorn with the gevent worker and
  ``webapp.app:create_app()``; pass ``argv`` to start anything else that prints gunicorn's
  ``Listening at: http://HOST:PORT`` line (or give ``ready_pattern``), e.g.
  ``shinken-session-server --workers 3 --bind 127.0.0.1:0``.
  ``session_server_factory.gunicorn_argv(app, workers)`` builds the default argv;
  ``session_server_factory.launch(workers, backend_url=None, *flags, env=None)`` starts the
  launcher (``webapp.serve``, 0 workers: single-process) on port 0 and waits for its ready line.
- ``hf_tokenizer_dir``: a directory with a small byte-level BPE ``tokenizer.json`` trained on
  the spot and a ChatML template in ``tokenizer_config.json`` (session-scoped).
- ``vl_tokenizer_dir``: the same for the vision path: the vision special tokens, Qwen2-VL's chat
  template and a ``preprocessor_config.json`` (session-scoped).
- ``stub_backend_factory(handler)`` -> the URL of an in-process HTTP server whose
  ``handler(request_dict)`` returns ``(status, body_bytes)``, or None to never answer (until the
  module ends); for failure tests.

The three factories are module-scoped: every process or server they started is stopped at module end.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.support import ServerProcess
from webapp.reference_backend import ReferenceBackendProcess, start_reference_backend
from webapp.serve import READY_URL_PATTERN, gunicorn_version_flags, server_argv

SERVER_READY_TIMEOUT = 60.0
GUNICORN_READY = r"Listening at: (http://\S+)"
HANG_LIMIT = 30.0  # a hanging stub handler gives up after this, so no test thread outlives its module


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '\\n<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    " + '\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> str:
    """A small byte-level BPE tokenizer.json trained here, plus a ChatML template."""
    path = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the agent clicks the button on the screen and types hello world"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": [{"name": "tool_use", "template": "unused"},
                          {"name": "default", "template": CHATML_TEMPLATE}],
    }))
    return str(path)


# Qwen2-VL's chat template (as its tokenizer_config.json ships it): each image part becomes
# <|vision_start|><|image_pad|><|vision_end|>, a default system turn opens the conversation.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     "<|image_pad|>", "<|video_pad|>"]
VL_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 401408, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}


@pytest.fixture(scope="session")
def vl_tokenizer_dir(tmp_path_factory) -> str:
    """A model directory laid out as Qwen2-VL's: a small byte-level BPE ``tokenizer.json`` with
    the vision special tokens, its chat template in ``tokenizer_config.json`` and a
    ``preprocessor_config.json`` (``max_pixels`` 401408, not the adapter's default)."""
    path = tmp_path_factory.mktemp("vltok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=VL_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the agent looks at the screenshot and clicks the button"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN2_VL_TEMPLATE}))
    (path / "preprocessor_config.json").write_text(json.dumps(VL_PREPROCESSOR))
    return str(path)


@pytest.fixture(scope="session")
def chatml_template() -> str:
    return CHATML_TEMPLATE


def gunicorn_argv(app: str = "webapp.app:create_app()", workers: int = 1) -> list[str]:
    return [sys.executable, "-m", "gunicorn", "-k", "gevent", *gunicorn_version_flags(), "-w", str(workers),
            "-b", "127.0.0.1:0", "--graceful-timeout", "5", app]


# Fixtures that start real processes: a test using one is an integration test whatever its
# module says, so the fast tiers on the other interpreters (-m "not integration") skip it.
PROCESS_FIXTURES = frozenset({"reference_backend_factory", "session_server_factory"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def reference_backend_factory() -> Iterator[Callable[..., ReferenceBackendProcess]]:
    started: list[ReferenceBackendProcess] = []

    def start(**kw) -> ReferenceBackendProcess:
        backend = start_reference_backend(**kw)
        started.append(backend)
        return backend

    yield start
    for backend in started:
        backend.close()


@pytest.fixture(scope="module")
def backend(reference_backend_factory) -> ReferenceBackendProcess:
    """The reference backend with its defaults, one per module (a module may override it)."""
    return reference_backend_factory()


@pytest.fixture(scope="module")
def session_server_factory(tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(argv: list[str] | None = None, env: dict[str, str] | None = None, *,
              backend_url: str | None = None, tokenizer: str | None = None,
              ready_pattern: str = GUNICORN_READY, timeout: float = SERVER_READY_TIMEOUT) -> ServerProcess:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
        # Each server its own data directory (one server per directory; pass one to share).
        full_env["SHINKEN_DATA_DIR"] = str(tmp_path_factory.mktemp("data"))
        if backend_url is not None:
            full_env["SHINKEN_BACKEND_URL"] = backend_url
        if tokenizer is not None:
            full_env["SHINKEN_TOKENIZER"] = tokenizer
        full_env.update(env or {})
        server = ServerProcess(argv or gunicorn_argv(), full_env, ready_pattern, timeout)
        started.append(server)
        return server

    def launch(workers: int, backend_url: str | None = None, *flags: str,
               env: dict[str, str] | None = None) -> ServerProcess:
        # The launcher (``webapp.serve``) on an OS-chosen port, ready once it prints its URL.
        return start(server_argv(workers, backend_url, "127.0.0.1:0", *flags), env=env,
                     ready_pattern=READY_URL_PATTERN)

    start.gunicorn_argv = gunicorn_argv
    start.launch = launch
    yield start
    for server in started:
        server.close()


class _StubServer(ThreadingHTTPServer):
    daemon_threads = True


@pytest.fixture(scope="module")
def stub_backend_factory() -> Iterator[Callable[[Callable[[dict], tuple[int, bytes] | None]], str]]:
    servers: list[ThreadingHTTPServer] = []
    release = threading.Event()

    def start(handler: Callable[[dict], tuple[int, bytes] | None]) -> str:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # it writes headers and body apart: no delayed-ACK stall

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                answer = handler(json.loads(body))
                if answer is None:
                    release.wait(HANG_LIMIT)
                    return
                status, reply = answer
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        server = _StubServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    release.set()
    for server in servers:
        server.shutdown()
        server.server_close()
