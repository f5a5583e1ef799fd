"""The blocking Sandbox facade: parity with AsyncSandbox, and its behaviour
against a real fleet host (threads, fork, loop death, a wedged loop, exit).

Runs plain and (tox ``gevent`` env) patched; the gevent-only scenarios live in
test_sync_gevent.py.
"""

from __future__ import annotations

import inspect
import json
import threading

import pytest

from shinken_sync import client, client_protocol, sync
from shinken_sync.client import AsyncSandbox
from shinken_sync.errors import ActionError, AuthRefused, RPCTimeout, SandboxClosed
from shinken_sync.results import ExecResult, Frame, Screenshot, StepResult
from shinken_sync.sharedloop import LoopThreadDied, LoopTimeout, SharedLoop, _native_allocate_lock
from shinken_sync.sync import Sandbox, connect
from tests.support import clean_stdout, native_thread_count, run_script

FLEET = 256
SCREEN = (1024, 768)


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}




# -- parity (no daemon) --------------------------------------------------------


@pytest.mark.parametrize(
    ("facade", "source"), [(Sandbox, AsyncSandbox), (sync.ScreencastStream, client.ScreencastStream)]
)
def test_facade_mirrors_every_public_member_with_the_same_signature(facade, source):
    assert public(facade) == public(source)
    for name in public(source):
        original = inspect.getattr_static(source, name)
        mirrored = inspect.getattr_static(facade, name)
        if isinstance(original, property):
            assert isinstance(mirrored, property), name
            assert mirrored.__doc__ == original.__doc__, name
            continue
        assert inspect.signature(mirrored) == inspect.signature(original), name
        assert mirrored.__doc__ == original.__doc__, name
        assert not inspect.iscoroutinefunction(mirrored), name


def test_async_protocols_become_sync_ones():
    assert callable(Sandbox.__enter__) and callable(Sandbox.__exit__)
    assert callable(sync.ScreencastStream.__iter__) and callable(sync.ScreencastStream.__next__)
    assert Sandbox.__exit__.__doc__ == AsyncSandbox.__aexit__.__doc__


def test_connect_takes_every_aconnect_argument_plus_loop():
    params = dict(inspect.signature(connect).parameters)
    loop = params.pop("loop")
    assert loop.kind is inspect.Parameter.KEYWORD_ONLY and loop.default is None
    assert list(params.values()) == list(inspect.signature(client.aconnect).parameters.values())


def test_a_deadline_rule_for_a_missing_method_is_refused():
    class Facade(sync._Facade):
        __slots__ = ()

    with pytest.raises(TypeError, match="renamed"):
        sync._derive(Facade, AsyncSandbox, {"renamed": client_protocol._fixed(1.0)})


def test_derived_methods_take_and_check_arguments_like_the_async_ones():
    class Source:
        rpc_timeout = 1.0

        async def click(self, x, y, button="left", *, timeout=None):
            return (x, y, button, timeout)

        async def step(self, actions, observe=None, *, timeout=None):
            return actions

    class Facade(sync._Facade):
        __slots__ = ()

    sync._derive(Facade, Source, {"step": client_protocol._step_deadline})
    with SharedLoop("args-loop") as shared:
        facade = Facade(Source(), shared)
        assert facade.click(1, 2) == (1, 2, "left", None)
        assert facade.click(1, y=3, button="right", timeout=2) == (1, 3, "right", 2)
        for bad in (
            lambda: facade.click(1),
            lambda: facade.click(1, 2, "left", 4),
            lambda: facade.click(1, x=2, y=3),
            lambda: facade.click(1, 2, bogus=1),
            lambda: facade.step(),
        ):
            with pytest.raises(TypeError):
                bad()
        # An iterator of actions is read once, for the deadline and the call alike.
        assert facade.step(iter([{"verb": "click"}])) == [{"verb": "click"}]


def test_sandboxes_on_one_shared_loop_share_its_frame_budget():
    async def budget():
        return client.loop_frame_budget()

    with SharedLoop("budget-a") as a, SharedLoop("budget-b") as b:
        assert a.run(budget()) is a.run(budget())
        assert a.run(budget()) is not b.run(budget())


def test_deadlines_follow_the_async_cores_own():
    target = 30.0  # the connection's rpc_timeout
    DEFAULT = client_protocol.DEFAULT
    rules = client_protocol.SANDBOX_DEADLINES
    assert client_protocol.one_call("cursor")(target, {"timeout": DEFAULT}) == 30.0
    assert client_protocol.one_call("cursor")(target, {"timeout": 2.0}) == 2.0
    wait_deadline = 30.0 + 5.0 + client.WAITING_VERB_SLACK
    assert client_protocol.one_call("wait")(target, {"ms": 5000, "timeout": DEFAULT}) == wait_deadline
    actions = iter([{"verb": "click", "x": 1, "y": 1}, {"verb": "wait", "ms": 5000}])
    args = {"actions": actions, "timeout": DEFAULT, "observe": None}
    assert rules["act_batch"](target, args) == 30.0 + wait_deadline
    assert args["actions"] == [{"verb": "click", "x": 1, "y": 1}, {"verb": "wait", "ms": 5000}]
    assert rules["step"](target, {"actions": args["actions"], "timeout": DEFAULT, "observe": {}}) == wait_deadline
    # A step's calls run in order on the daemon: the last waits out every wait ahead of it.
    waits = [{"verb": "wait", "ms": 20_000}, {"verb": "wait", "ms": 20_000}]
    step = {"actions": waits, "timeout": DEFAULT, "observe": {}}
    assert rules["step"](target, step) == 30.0 + 40.0 + client.WAITING_VERB_SLACK
    assert rules["step"](target, {**step, "timeout": 2.0}) == 2.0  # the caller's bound on the whole step
    assert rules["read_file"](target, {"max_bytes": None, "timeout": DEFAULT}) is None
    assert rules["read_file"](target, {"max_bytes": 3 * client.READ_FILE_CHUNK, "timeout": 1.0}) == 3.0
    # None is no limit, on every rule (DEFAULT, or no timeout argument at all, inherits).
    assert client_protocol.one_call("cursor")(target, {}) == 30.0
    assert client_protocol.one_call("cursor")(target, {"timeout": None}) is None
    assert rules["step"](target, {**step, "timeout": None}) is None


# -- against a fleet host -----------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(module_shinkend):
    return module_shinkend(fleet=FLEET, screen=SCREEN)


@pytest.fixture
def urls(fleet):
    """A fresh slice of the fleet's sandboxes for each test (64 each)."""
    start = urls.next_slice * 64 % FLEET
    urls.next_slice += 1
    return fleet.urls[start : start + 64]


urls.next_slice = 0


@pytest.fixture
def shared():
    loop = SharedLoop("test-sync-loop")
    yield loop
    loop.close()


@pytest.mark.integration
def test_facade_calls_return_what_the_async_core_returns(fleet, urls, shared):
    with connect(urls[0], token=fleet.token, loop=shared) as sb:
        raw = sb._async  # the same connection, driven directly on its loop
        sb.move(100, 200)
        assert sb.cursor() == (100, 200) == shared.run(raw.cursor())
        assert sb.screen_size() == shared.run(raw.screen_size()) == SCREEN
        assert sb.screen == raw.screen and sb.sandbox_id == raw.sandbox_id
        result = sb.exec("echo hello")
        assert isinstance(result, ExecResult) and result.stdout == "hello\n" and result.exit_code == 0
        shot = sb.screenshot(max_long_edge=256)
        assert isinstance(shot, Screenshot) and max(shot.width, shot.height) == 256
        step = sb.step([{"verb": "click", "x": 5, "y": 5}], observe={"max_long_edge": 64})
        assert isinstance(step, StepResult) and [r.outcome for r in step.rows] == ["ok"]
        assert step.observation is not None
        sb.write_file("/tmp/shinken-sync-test.txt", b"data")
        assert sb.read_file("/tmp/shinken-sync-test.txt") == b"data"
        with pytest.raises(ActionError) as info:
            sb.read_file("/nonexistent/shinken")
        assert info.value.kind == "not_found"
    assert sb.closed
    with pytest.raises(SandboxClosed):
        sb.cursor()


@pytest.mark.integration
def test_screencast_iterates_with_a_plain_for_loop(fleet, urls, shared):
    with connect(urls[0], token=fleet.token, loop=shared) as sb:
        stream = sb.screencast(fps=20, max_long_edge=128)
        assert isinstance(stream, sync.ScreencastStream) and stream.stream_id
        frames = []
        for frame in stream:
            frames.append(frame)
            if len(frames) == 3:
                stream.stop()
            else:
                sb.click(10 + len(frames), 10)  # a changed screen makes the next frame
        assert len(frames) == 3 and all(isinstance(f, Frame) for f in frames)
        assert [f.seq for f in frames] == sorted(f.seq for f in frames)
        assert stream.ended and stream.next_frame(timeout=1) is None


@pytest.mark.integration
def test_a_wrong_token_raises_the_async_cores_error(fleet, urls, shared):
    with pytest.raises(AuthRefused):
        connect(urls[0], token="wrong", loop=shared)


@pytest.mark.integration
def test_64_threads_each_drive_a_sandbox_on_one_loop_thread(fleet, urls, shared):
    shared.run(client.asyncio.sleep(0))  # the loop thread exists before counting
    before = native_thread_count()
    counts: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(urls))

    def drive(url: str, n: int) -> None:
        try:
            with connect(url, token=fleet.token, loop=shared) as sb:
                barrier.wait(30)  # every sandbox open at once
                counts.append(native_thread_count())
                for i in range(5):
                    sb.move(n, i)
                    assert sb.cursor() == (n, i)
                step = sb.step([{"verb": "click", "x": n, "y": n}], observe={"max_long_edge": 64})
                assert step.ok, step.outcomes
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(url, n)) for n, url in enumerate(urls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    # 64 open sandboxes cost the 64 caller threads and nothing more: no thread per connection.
    assert max(counts) <= before + len(urls)
    assert native_thread_count(settle_to=before) == before


@pytest.mark.integration
def test_thread_count_stays_constant_as_sandboxes_grow(fleet, urls, shared):
    opened = [connect(urls[0], token=fleet.token, loop=shared)]
    with_one = native_thread_count()
    opened += [connect(url, token=fleet.token, loop=shared) for url in urls[1:]]
    assert len(opened) == 64
    assert native_thread_count() == with_one
    for sb in opened:
        sb.close()


@pytest.mark.integration
def test_loop_thread_death_fails_every_blocked_sandbox_call(fleet, urls, shared):
    sandboxes = [connect(url, token=fleet.token, loop=shared) for url in urls[:4]]
    errors: list[BaseException] = []
    started = threading.Barrier(5)

    def blocked(sb: Sandbox) -> None:
        started.wait(10)
        try:
            sb.wait(60_000)  # the daemon would answer in a minute
        except BaseException as exc:  # noqa: BLE001 -- collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=blocked, args=(sb,)) for sb in sandboxes]
    for t in threads:
        t.start()
    started.wait(10)
    assert shared.run(client.asyncio.sleep(0.2)) is None  # the waits are on the wire

    def die() -> None:
        raise SystemExit("simulated crash of the loop thread")

    shared.loop.call_soon_threadsafe(die)
    for t in threads:
        t.join(30)
    assert len(errors) == 4 and all(isinstance(e, LoopThreadDied) for e in errors), errors
    with pytest.raises(LoopThreadDied):
        sandboxes[0].cursor()


@pytest.mark.integration
def test_a_wedged_loop_cannot_hang_the_caller(fleet, urls, shared, monkeypatch):
    monkeypatch.setattr(sync, "CALLER_MARGIN", 0.2)
    with connect(urls[0], token=fleet.token, loop=shared) as sb:
        wedge = _native_allocate_lock()
        wedge.acquire()
        # Blocks the loop thread itself (a native lock), as a buggy callback would.
        shared.loop.call_soon_threadsafe(lambda: wedge.acquire(True, 30))
        try:
            with pytest.raises(RPCTimeout) as info:
                sb.cursor(timeout=0.3)
            assert isinstance(info.value.__cause__, LoopTimeout)
            assert info.value.verb == "cursor"
        finally:
            wedge.release()
        assert sb.cursor() is not None  # the loop turns again


FORK_SCRIPT = """
    import json, os, sys, warnings
    # Python >= 3.12 warns on fork() in a multi-threaded process; that is the point here.
    warnings.filterwarnings("ignore", ".*multi-threaded.*fork", DeprecationWarning)
    from shinken_sync import connect
    from shinken_sync.sharedloop import LoopThreadDied

    urls, token = json.loads(sys.argv[1])
    parent_sb = connect(urls[0], token=token)
    parent_sb.move(7, 7)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            try:
                parent_sb.cursor()
                code = 3
            except LoopThreadDied:
                pass
            with connect(urls[1], token=token) as child_sb:
                child_sb.move(3, 4)
                assert child_sb.cursor() == (3, 4)
        except BaseException:
            import traceback; traceback.print_exc()
            code = 2
        sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    # The child never touched the parent's connection.
    assert parent_sb.cursor() == (7, 7)
    parent_sb.close()
    print("ok")
"""


@pytest.mark.integration
def test_fork_then_use_in_the_child(fleet, urls):
    result = run_script(FORK_SCRIPT, json.dumps([urls[:2], fleet.token]))
    assert clean_stdout(result).strip() == "ok"


EXIT_SCRIPT = """
    import json, sys, threading
    if sys.argv[2] == "patch-first":
        from gevent import monkey; monkey.patch_all()
    from shinken_sync import connect
    from shinken_sync.sharedloop import LoopClosed
    if sys.argv[2] == "patch-after":
        from gevent import monkey; monkey.patch_all()

    urls, token = json.loads(sys.argv[1])
    sandboxes = [connect(url, token=token) for url in urls]   # never closed
    stream = sandboxes[0].screencast(fps=10)                  # never stopped
    assert stream.next_frame(timeout=10) is not None
    started = threading.Event()

    def blocked():                                            # a call in flight at exit
        started.set()
        try:
            sandboxes[1].wait(60_000)
        except LoopClosed:
            print("blocked call released")

    threading.Thread(target=blocked).start()
    started.wait(10)
    print("exiting")
"""


@pytest.mark.integration
@pytest.mark.parametrize("patching", ["plain", "patch-first", "patch-after"])
def test_interpreter_exit_with_open_sandboxes_is_clean(fleet, urls, patching):
    result = run_script(EXIT_SCRIPT, json.dumps([urls[:8], fleet.token]), patching)
    assert clean_stdout(result).splitlines() == ["exiting", "blocked call released"]


@pytest.mark.integration
def test_providers_connect_from_sync_code():
    from shinken_sync.providers.local import LocalFleetProvider

    with LocalFleetProvider(2, screen=SCREEN) as provider, provider.connect(provider.create()) as sb:
        assert isinstance(sb, Sandbox)
        sb.move(9, 8)
        assert sb.cursor() == (9, 8)
