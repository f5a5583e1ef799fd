"""Starts miles' own session server for bench/miles_side_by_side.py; runs in the scratch venv.

    python miles_launch.py --miles-tree DIR --tokenizer DIR --backend URL --port P [--workers N]

Runs with the scratch venv's interpreter (FastAPI, uvicorn, httpx, transformers...), never with
ours: it imports only miles (from ``--miles-tree``) and the standard library. Before importing
miles it installs stand-ins for the heavy packages miles imports at module level but its session
server never calls (torch, ray, sglang, ...): each stand-in is an empty module whose every
attribute is a :class:`Standin`, which can be subclassed, decorated with and looked into, and
raises :class:`StandinCalled` when called for a value, so a session path that did use one fails
loudly instead of measuring a fake.

``--workers 0``: the single-process server, through miles' own entry point
``miles.rollout.session.server.run_session_server``. ``--workers N``: the multi-process data
plane of a tree that has it (``miles/rollout/session/router.py`` and ``worker.py``, the
data-plane commit that was later reverted): that change left the process launch to a later
change, so this file does the launching with the data plane's own pieces: N
``worker.run_worker`` processes (spawned), each on one end of a ``socket.socketpair``, and the
router app (``router.build_router_app``) over the other ends, served by uvicorn in this process.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import sys
import types

# Top-level packages miles' session-server modules import (directly or through miles.utils)
# that its request path never calls. Found by walking the imports of
# miles/rollout/session/{server,sessions,core}.py; the smoke test checks the list still suffices.
STANDIN_PACKAGES = ("torch", "ray", "sglang", "sglang_router", "deep_ep", "torch_memory_saver", "qwen_vl_utils",
                    "torch_npu", "megatron", "transformer_engine", "apex", "flash_attn", "wandb", "tensorboard")


class StandinCalled(RuntimeError):
    """A stand-in package was called on the session-server path: the bench would measure a fake."""


class Standin:
    """Any attribute of a stand-in module: a value miles may touch at import time only."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Standin:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Standin(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> object:
        # A decorator use (`@ray.remote`, `@torch.no_grad()`) passes the function through.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        if not args and not kwargs:
            return self  # `@torch.no_grad()` then decorates
        raise StandinCalled(f"{self._name} called: a stand-in, not the real package")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)  # `class X(torch.nn.Module)` becomes a plain class

    def __getitem__(self, item: object) -> Standin:
        return self  # type annotations such as torch.Tensor[...]

    def __or__(self, other: object) -> object:
        return object  # `torch.Tensor | None` annotations evaluated at import

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandinModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Standin:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Standin(f"{self.__name__}.{attr}")


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]) -> None:
        self.packages = packages

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandinModule(spec.name)
        module.__path__ = []
        module.__spec__ = spec
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_standins(packages: tuple[str, ...] = STANDIN_PACKAGES) -> None:
    """Make ``import torch`` (etc.) give a stand-in module; a real install is not consulted.

    And one switch-off (:func:`switch_off_aliases`): ``load_tokenizer`` first registers miles' model-type aliases with
    transformers (``miles.utils.hf_config.register_hf_config_aliases``), which subclasses
    transformers' torch model classes; without torch those do not exist. It concerns model
    configs only (the bench's tokenizer is no aliased model type), so it becomes a no-op.
    """
    sys.meta_path.insert(0, _StandinFinder(packages))


def switch_off_aliases() -> None:
    """See :func:`install_standins`: after it, with the miles tree on ``sys.path``."""
    import miles.utils.hf_config
    import miles.utils.processing_utils

    miles.utils.hf_config.register_hf_config_aliases = _no_aliases
    miles.utils.processing_utils.register_hf_config_aliases = _no_aliases  # imported by name there


def _no_aliases() -> None:
    pass


def miles_args(tokenizer: str, port: int, *, r3: bool, timeout: float = 600.0) -> argparse.Namespace:
    """The attributes miles' session server reads from its training args (``getattr`` with
    defaults in server.py, sessions.py, core.py), set for this bench."""
    return argparse.Namespace(
        hf_checkpoint=tokenizer,  # sessions.py skips every session route without it
        chat_template_path=None,
        apply_chat_template_kwargs=None,
        tito_model="default",
        session_message_matcher="strict",
        use_session_server=True,  # not "v2": the linear-trajectory SessionCore
        use_rollout_routing_replay=r3,  # asks the engine for return_routed_experts (R3)
        use_rollout_indexer_replay=False,
        pause_generation_mode=None,
        miles_router_timeout=timeout,
        session_server_ip="127.0.0.1",
        session_server_port=port,
        session_server_instance_id=None,
    )


def serve_single(args: argparse.Namespace, backend: str) -> None:
    from miles.rollout.session.server import run_session_server

    run_session_server(args, backend)


def serve_workers(args: argparse.Namespace, backend: str, workers: int) -> None:
    import asyncio
    import multiprocessing
    import socket

    import uvicorn
    from miles.rollout.session.ipc import open_unix_channel
    from miles.rollout.session.router import build_router_app
    from miles.rollout.session.worker import run_worker

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each, as a launcher would give
    router_ends, procs = [], []
    for index in range(workers):
        mine, theirs = socket.socketpair()
        proc = ctx.Process(target=run_worker, args=(args, backend, theirs, index), daemon=True,
                           name=f"miles-session-worker-{index}")
        proc.start()
        theirs.close()
        router_ends.append(mine)
        procs.append(proc)

    async def main() -> None:
        channels = [await open_unix_channel(sock) for sock in router_ends]
        app = build_router_app(channels, args.session_server_instance_id)
        config = uvicorn.Config(app, host=args.session_server_ip, port=args.session_server_port, log_level="warning")
        await uvicorn.Server(config).serve()

    try:
        asyncio.run(main())
    finally:
        for proc in procs:
            proc.terminate()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--miles-tree", required=True, help="a miles work tree (its top directory)")
    parser.add_argument("--tokenizer", required=True, help="an HF tokenizer directory (hf_checkpoint)")
    parser.add_argument("--backend", required=True, help="the SGLang-speaking engine URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=0, help="0: single process; N: the multi-process data plane")
    parser.add_argument("--no-r3", action="store_true", help="do not ask the engine for routed experts")
    parser.add_argument("--check-imports", action="store_true",
                        help="import the session-server modules with the stand-ins and exit (smoke test)")
    ns = parser.parse_args(argv)
    sys.path.insert(0, ns.miles_tree)
    install_standins()
    switch_off_aliases()
    args = miles_args(ns.tokenizer, ns.port, r3=not ns.no_r3)
    if ns.check_imports:
        import miles.rollout.session.server
        if ns.workers:
            import miles.rollout.session.router
            import miles.rollout.session.worker  # noqa: F401
        print("imports ok")
        return
    if ns.workers:
        serve_workers(args, ns.backend, ns.workers)
    else:
        serve_single(args, ns.backend)


if __name__ == "__mp_main__":
    install_standins()  # a spawned worker re-imports this file under this name (sys.path is set)
    switch_off_aliases()
elif __name__ == "__main__":
    main()
