"""The session message matchers (miles' ``--session-message-matcher``): each built-in's rules,
the selector, and the server using the configured one for line (v1) and tree (v2) sessions in
both server modes.

The rules are miles' (``miles/utils/chat_template_utils/message_matcher_hub/funcs.py`` and its
tests at 31f1ca961), restated here case by case. Over HTTP the oracle of a continued session is
the chat template's own rendering of the STORED conversation (miles keeps the stored messages
inside the matched prefix), checked to differ from the rendering of the replayed one, so a
server that took the replayed spelling would fail.
"""

from __future__ import annotations

import copy
import operator
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import requests

from webapp.matchers import (
    MATCHERS,
    ConfiguredMatcher,
    MessageMatcherFailed,
    UnknownMatcher,
    loose_tool_call_message_matches,
    resolve_matcher,
    role_content_only_message_matches,
    strict_message_matches,
)
from webapp.reference_backend import reference_completion
from webapp.samples import TurnRecord
from webapp.session_errors import AppendOnlyViolation, RollbackTooDeep
from webapp.tito import INITIAL_STATE, commit_turn, normalize_messages, plan_turn
from webapp.tokenizers import load_tokenizer
from webapp.tree import SessionTree

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = load_tokenizer(None)  # the servers' (no --tokenizer): the byte tokenizer


def call(arguments: Any = '{"city":"Paris","units":"metric"}', *, call_id: str = "call-A",
         name: str = "lookup", **extra: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}, **extra}


def assistant(*calls: dict[str, Any], content: Any = "", **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": list(calls), **extra}


# -- strict ---------------------------------------------------------------------------------------

def test_strict_compares_the_template_keys_only():
    stored = {"role": "user", "content": "hi"}
    assert strict_message_matches(stored, {**stored, "provider_specific_fields": {"x": 1}, "name": "n"})
    assert not strict_message_matches(stored, {"role": "user", "content": "hi "})  # boundary text is kept
    assert not strict_message_matches(stored, {"role": "system", "content": "hi"})
    assert not strict_message_matches({"role": "assistant", "content": "a", "reasoning_content": "r"},
                                      {"role": "assistant", "content": "a", "reasoning_content": "r2"})


@pytest.mark.parametrize("empty", [None, "", []])
@pytest.mark.parametrize("other", [None, "", []])
def test_strict_takes_none_empty_string_and_empty_list_as_one(empty, other):
    assert strict_message_matches({"role": "assistant", "content": empty, "tool_calls": other},
                                  {"role": "assistant", "content": other, "tool_calls": empty})
    assert strict_message_matches({"role": "assistant", "content": "x"},
                                  {"role": "assistant", "content": "x", "reasoning_content": empty})


def test_strict_ignores_a_tool_calls_index_and_nothing_else_in_it():
    stored = assistant(call(index=0))
    assert strict_message_matches(stored, assistant(call()))
    assert strict_message_matches(stored, assistant(call(index=3)))
    assert not strict_message_matches(stored, assistant(call('{"units":"metric","city":"Paris"}')))
    assert not strict_message_matches(stored, assistant(call(call_id="call-B")))


# -- loose_tool_call ------------------------------------------------------------------------------

@pytest.mark.parametrize(("stored", "replayed"), [
    ('{"city":"Paris","units":"metric"}', '{"units": "metric", "city": "Paris"}'),  # key order, spacing
    ('{"a":{"y":1,"x":[1,{"q":2,"p":3}]}}', '{"a": {"x": [1, {"p": 3, "q": 2}], "y": 1}}'),  # nested
    ('{"n":1}', '{"n":1.0}'),  # one exact number
    ('{"n":12345678901234567890123}', '{"n": 12345678901234567890123}'),
    ({"city": "Paris"}, '{"city":"Paris"}'),  # a dict and its JSON text
    (None, ""), ("", {}), ({}, "{}"), ("{}", "{ }"),  # the empty object, however spelled
])
def test_loose_tool_call_accepts_any_spelling_of_the_same_json_object(stored, replayed):
    assert not strict_message_matches(assistant(call(stored)), assistant(call(replayed))) or stored == replayed
    assert loose_tool_call_message_matches(assistant(call(stored)), assistant(call(replayed)))


@pytest.mark.parametrize(("stored", "replayed"), [
    ('{"v":true}', '{"v":1}'), ('{"v":null}', '{"v":"null"}'), ('{"v":[1,2]}', '{"v":[2,1]}'),
    ('{"v":{"x":1}}', '{"v":[["x",1]]}'), ('{"v":1}', '{"v":2}'),
    (" ", "{}"), ("{bad}", "{ bad }"), ('{"x":1,"x":2}', '{"x":1, "x":2}'), ('{"x":NaN}', '{"x": NaN}'),
    ('{"x":Infinity}', '{"x": Infinity}'), ("[]", "[ ]"), ("1", "1.0"),
    ({1: "v"}, {"1": "v"}), ({"v": Decimal(1)}, '{"v":1}'),  # a Decimal is no JSON value of a dict
])
def test_loose_tool_call_keeps_json_types_order_and_compares_non_objects_raw(stored, replayed):
    assert not loose_tool_call_message_matches(assistant(call(stored)), assistant(call(replayed)))


def test_loose_tool_call_equal_raw_non_objects_still_match():
    assert loose_tool_call_message_matches(assistant(call("{bad}")), assistant(call("{bad}")))
    assert loose_tool_call_message_matches(assistant(call("[1]")), assistant(call("[1]")))


def test_loose_tool_call_still_compares_call_identity_and_every_other_field():
    stored = assistant(call())
    respelled = '{"units": "metric", "city": "Paris"}'
    assert loose_tool_call_message_matches(stored, assistant(call(respelled)))
    for replayed in (assistant(call(respelled, call_id="call-B")),
                     {**assistant(call(respelled)), "tool_calls": [{**call(respelled), "type": "other"}]},
                     assistant(call(respelled, name="other")),
                     assistant(call(respelled, provider="x")),  # an unknown call field must be present in both
                     assistant(call(respelled), call(respelled)),  # the count
                     assistant(call(respelled), content="text"),
                     assistant(call(respelled), reasoning_content="thought")):
        assert not loose_tool_call_message_matches(stored, replayed), replayed
    with_fn_field = assistant({**call(), "function": {**call()["function"], "provider": "x"}})
    assert not loose_tool_call_message_matches(stored, with_fn_field)
    assert not loose_tool_call_message_matches(assistant({"id": "call-A", "type": "function",
                                                          "function": {"name": "lookup"}}),
                                               assistant(call("{}")))  # missing is not the empty object


def test_loose_tool_call_keeps_call_order():
    first, second = call('{"x":1}', call_id="A", name="f"), call('{"x":2}', call_id="B", name="g")
    assert loose_tool_call_message_matches(assistant(first, second),
                                           assistant(call({"x": 1}, call_id="A", name="f"),
                                                     call({"x": 2}, call_id="B", name="g")))
    assert not loose_tool_call_message_matches(assistant(first, second), assistant(second, first))


def test_loose_tool_call_on_very_deep_json_falls_back_without_raising():
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    assert loose_tool_call_message_matches(assistant(call(deep)), assistant(call(deep)))
    assert not loose_tool_call_message_matches(assistant(call(deep)), assistant(call(deep.replace("1", "2"))))


# -- role_content_only ----------------------------------------------------------------------------

def test_role_content_only_ignores_every_other_field():
    stored = {**assistant(call()), "reasoning_content": "thought"}
    assert role_content_only_message_matches(stored, {"role": "assistant", "content": None})
    assert role_content_only_message_matches(stored, assistant(call("{broken", call_id="call-B")))
    assert role_content_only_message_matches({"role": "tool", "content": "ok", "tool_call_id": "A"},
                                             {"role": "tool", "content": "ok", "tool_call_id": "B"})


@pytest.mark.parametrize(("field", "stored", "replayed"), [
    ("role", "assistant", "user"), ("content", "text", " text"), ("content", "Text", "text"),
    ("content", "é", "e\u0301"), ("content", '{"x":1}', '{"x": 1}'), ("content", ["a", "b"], ["b", "a"]),
])
def test_role_content_only_adds_no_other_normalization(field, stored, replayed):
    base = {"role": "user", "content": "c"}
    assert not role_content_only_message_matches({**base, field: stored}, {**base, field: replayed})


def test_each_matcher_accepts_what_the_stricter_one_does_and_mutates_nothing():
    pairs = [(assistant(call()), assistant(call())),
             (assistant(call()), assistant(call('{"units":"metric", "city":"Paris"}'))),
             (assistant(call()), assistant(call(call_id="call-B"), reasoning_content="x")),
             ({"role": "user", "content": "a"}, {"role": "user", "content": "b"})]
    accepted = {name: [fn(copy.deepcopy(a), copy.deepcopy(b)) for a, b in pairs] for name, fn in MATCHERS.items()}
    assert accepted == {"strict": [True, False, False, False], "loose_tool_call": [True, True, False, False],
                        "role_content_only": [True, True, True, False]}
    for fn in MATCHERS.values():
        a, b = pairs[1]
        before = copy.deepcopy((a, b))
        fn(a, b)
        assert (a, b) == before


# -- the selector ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MATCHERS))
def test_a_builtin_name_and_miles_paths_of_it_resolve_to_it(name):
    fn = MATCHERS[name]
    assert resolve_matcher(name).fn is fn
    assert resolve_matcher(f"miles.utils.chat_template_utils.message_matcher_hub.{fn.__name__}").fn is fn
    assert resolve_matcher(f"miles.utils.chat_template_utils.message_matcher_hub.funcs.{fn.__name__}").fn is fn


def test_the_default_is_strict():
    assert resolve_matcher(None).fn is strict_message_matches
    assert resolve_matcher("").name == "strict"


def test_a_custom_matcher_by_import_path_in_either_spelling():
    from tests.webapp import matcher_hooks

    assert resolve_matcher("tests.webapp.matcher_hooks:same_content").fn is matcher_hooks.same_content
    assert resolve_matcher("tests.webapp.matcher_hooks.same_content").fn is matcher_hooks.same_content
    assert resolve_matcher("operator.eq").fn is operator.eq


@pytest.mark.parametrize(("selector", "words"), [
    ("Strict", "unknown session message matcher 'Strict'"),  # exact and case-sensitive, as miles
    ("LOOSE_TOOL_CALL", "use one of strict, loose_tool_call, role_content_only"),
    ("role-content-only", "unknown"),
    ("no_such_module_xyz.matcher", "cannot import 'no_such_module_xyz'"),
    ("operator.missing_matcher", "has no 'missing_matcher'"),
    ("tests.webapp.matcher_hooks:NOT_CALLABLE", "str is not callable"),
    ("tests.webapp.matcher_hooks:async_matcher", "an async function"),
])
def test_a_selector_naming_no_matcher_is_unknown_matcher(selector, words):
    with pytest.raises(UnknownMatcher) as caught:
        resolve_matcher(selector)
    assert words in str(caught.value)
    assert caught.value.status == 500 and isinstance(caught.value, ValueError)


def test_a_matcher_that_raises_or_returns_a_non_bool_is_message_matcher_failed():
    message = {"role": "user", "content": "x"}
    with pytest.raises(MessageMatcherFailed, match="matcher_hooks:exploding raised RuntimeError: matcher asked") as c:
        resolve_matcher("tests.webapp.matcher_hooks:exploding")(message, message)
    assert c.value.status == 500 and c.value.matcher == "tests.webapp.matcher_hooks:exploding"
    with pytest.raises(MessageMatcherFailed, match="must return bool, got int"):
        resolve_matcher("tests.webapp.matcher_hooks:truthy")(message, message)
    assert resolve_matcher("strict")(message, message) is True


# -- plan_turn and find_attach_point with a matcher -------------------------------------------------

SYS = {"role": "system", "content": "You look up the weather."}
USER = {"role": "user", "content": "Weather in Paris?"}
SEED = assistant(call())  # a client-supplied (not generated) assistant turn with a tool call
TOOL = {"role": "tool", "content": "18C", "tool_call_id": "call-A"}
RESPELLED = assistant(call('{"units": "metric", "city": "Paris"}'))  # key order and spacing
RENAMED = assistant(call('{"units": "metric", "city": "Paris"}', call_id="call-B"))  # ... and another call id
TOOL_RENAMED = {**TOOL, "tool_call_id": "call-B"}
LOOSE, RCO, STRICT = (resolve_matcher(name) for name in ("loose_tool_call", "role_content_only", "strict"))


def _run(state, previous, messages, matcher):
    plan = plan_turn(state, previous, messages, None, TOKENIZER, matcher)
    reply = reference_completion(plan.prompt_ids, TOKENIZER)
    out = [tid for _lp, tid in reply["choices"][0]["meta_info"]["output_token_logprobs"]]
    message = reply["choices"][0]["message"]
    return plan, commit_turn(plan, normalize_messages([message])[0], out, TOKENIZER.eos_token_id), message


def _two_turns(matcher: ConfiguredMatcher):
    _p1, s1, r1 = _run(INITIAL_STATE, None, [SYS, USER, SEED, TOOL], matcher)
    _p2, s2, r2 = _run(s1, INITIAL_STATE, [SYS, USER, SEED, TOOL, r1, {"role": "user", "content": "more"}], matcher)
    return s1, s2, [SYS, USER, SEED, TOOL, r1, {"role": "user", "content": "more"}, r2]


def canonical(messages: list[dict[str, Any]]) -> list[int]:
    return TOKENIZER.encode(TOKENIZER.render(normalize_messages(messages), add_generation_prompt=True))


def test_plan_turn_keeps_the_stored_messages_where_the_matcher_says_equal():
    s1, s2, history = _two_turns(LOOSE)
    replay = [*history, {"role": "user", "content": "again"}]
    replay[2] = RESPELLED
    assert canonical(replay) != canonical([*history, {"role": "user", "content": "again"}])  # the test can fail
    plan = plan_turn(s2, s1, replay, None, TOKENIZER, LOOSE)
    assert not plan.rollback and plan.base is s2
    assert plan.messages[2] == normalize_messages([SEED])[0]  # the stored spelling
    assert plan.prompt_ids == canonical([*history, {"role": "user", "content": "again"}])
    with pytest.raises(RollbackTooDeep, match="message 2 differs"):
        plan_turn(s2, s1, replay, None, TOKENIZER, STRICT)
    with pytest.raises(RollbackTooDeep):  # a call id is identity to loose_tool_call ...
        plan_turn(s2, s1, [*history[:2], RENAMED, TOOL_RENAMED, *history[4:], USER], None, TOKENIZER, LOOSE)
    plan = plan_turn(s2, s1, [*history[:2], RENAMED, TOOL_RENAMED, *history[4:], USER], None, TOKENIZER, RCO)
    assert plan.prompt_ids == canonical([*history, USER])  # ... not to role_content_only: the stored ids stay


def test_plan_turn_rolls_back_one_step_and_refuses_a_respelled_replay_as_a_verbatim_one():
    s1, s2, history = _two_turns(LOOSE)
    retry = [SYS, USER, RESPELLED, TOOL, history[4], {"role": "user", "content": "other"}]
    plan = plan_turn(s2, s1, retry, None, TOKENIZER, LOOSE)
    assert plan.rollback and plan.base is s1 and plan.messages[2] == normalize_messages([SEED])[0]
    refusals = []
    for seed in (SEED, RESPELLED):  # a whole-history replay without news: one refusal for both spellings
        with pytest.raises(AppendOnlyViolation) as caught:
            plan_turn(s2, s1, [SYS, USER, seed, *history[3:]], None, TOKENIZER, LOOSE)
        refusals.append(str(caught.value))
    assert refusals[0] == refusals[1] and "assistant" in refusals[0]


def test_plan_turn_passes_a_matcher_failure_through_and_the_default_is_strict():
    s1, s2, history = _two_turns(STRICT)
    with pytest.raises(MessageMatcherFailed):
        plan_turn(s2, s1, [*history, USER], None, TOKENIZER, resolve_matcher("tests.webapp.matcher_hooks:exploding"))
    replay = [*history, USER]
    replay[2] = RESPELLED
    with pytest.raises(RollbackTooDeep):
        plan_turn(s2, s1, replay, None, TOKENIZER)


def test_find_attach_point_uses_the_matcher():
    tree = SessionTree()
    s1, s2, history = _two_turns(STRICT)
    turn = TurnRecord(prompt_len=0, output_ids=(), logprobs=(), finish_reason="stop", meta={}, timestamp=0.0,
                      request_timestamp=0.0, replay=())  # positioning reads the nodes' messages only
    root = tree.add(None, s1, turn, response_id="r0", committed_at=0.0)
    child = tree.add(root, s2, turn, response_id="r1", committed_at=0.0)
    replay = normalize_messages([*history[:2], RESPELLED, *history[3:], USER])
    assert tree.find_attach_point(replay, STRICT).node is None
    point = tree.find_attach_point(replay, LOOSE)
    assert point.node is child and point.matched == len(history)


# -- over HTTP, both server modes, both session modes -------------------------------------------------

HOOK_ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
EXPLODING = "tests.webapp.matcher_hooks:exploding"


class Servers:
    """Servers of one server mode, started on first use: (session mode, matcher) -> URL."""

    def __init__(self, workers: int, backend_url: str, factory: Any) -> None:
        self.workers, self.backend_url, self.factory = workers, backend_url, factory
        self.urls: dict[tuple[str, str], str] = {}

    def __call__(self, mode: str, matcher: str) -> str:
        if (mode, matcher) not in self.urls:
            self.urls[mode, matcher] = self.factory.launch(
                self.workers, self.backend_url, "--session-mode", mode, "--session-message-matcher", matcher,
                env=HOOK_ENV).url
        return self.urls[mode, matcher]


@pytest.fixture(scope="module", params=[0, 2], ids=["workers0", "router"])
def servers(request, session_server_factory, backend) -> Servers:
    return Servers(request.param, backend.url, session_server_factory)


class Harness:
    """An agent whose history the harness re-serializes before each request (``respell``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        reply = requests.post(f"{url}/sessions", timeout=30)
        assert reply.status_code == 200, reply.text
        self.sid = reply.json()["session_id"]

    def post(self, messages: list[dict[str, Any]]) -> requests.Response:
        return requests.post(f"{self.url}/sessions/{self.sid}/v1/chat/completions", json={"messages": messages},
                             timeout=60)

    def turn(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        reply = self.post(messages)
        assert reply.status_code == 200, reply.text
        message: dict[str, Any] = reply.json()["choices"][0]["message"]
        return {k: v for k, v in message.items() if v is not None}

    def get(self) -> dict[str, Any]:
        reply = requests.get(f"{self.url}/sessions/{self.sid}", timeout=30)
        assert reply.status_code == 200, reply.text
        body: dict[str, Any] = reply.json()
        return body


def two_turns(h: Harness) -> list[dict[str, Any]]:
    """The canonical history after two turns (the first one carries the client's SEED call)."""
    r1 = h.turn([SYS, USER, SEED, TOOL])
    more = {"role": "user", "content": "And tomorrow?"}
    r2 = h.turn([SYS, USER, SEED, TOOL, r1, more])
    return [SYS, USER, SEED, TOOL, r1, more, r2]


AGAIN = {"role": "user", "content": "Thanks. And in Lyon?"}


def respelled(history: list[dict[str, Any]], *, ids: bool = False) -> list[dict[str, Any]]:
    """The harness's re-serialization: arguments' key order and spacing, and with ``ids`` the
    call's id too (templates render no call id: the arguments make the renderings differ)."""
    out = list(history)
    out[2], out[3] = (RENAMED, TOOL_RENAMED) if ids else (RESPELLED, TOOL)
    return out


def check_continued(h: Harness, history: list[dict[str, Any]], replay: list[dict[str, Any]]) -> dict[str, Any]:
    """The replay continued the session on its stored conversation: the prompt is the template's
    rendering of the stored messages (not of the replay), and the stored messages still agree
    with the ids (``tito_session_mismatch`` re-renders them)."""
    stored_prompt = canonical([*history, AGAIN])
    assert canonical([*replay, AGAIN]) != stored_prompt  # the replay's own spelling renders otherwise
    h.turn([*replay, AGAIN])
    body = h.get()
    assert len(body["records"]) == 3
    assert body["records"][2]["request"]["input_ids"] == stored_prompt
    assert body["records"][1]["request"]["input_ids"] == stored_prompt[:len(body["records"][1]["request"]
                                                                            ["input_ids"])]
    assert body["metadata"]["tito_session_mismatch"] == []
    return body


@pytest.mark.integration
def test_v1_strict_answers_400_for_a_respelled_history(servers):
    h = Harness(servers("v1", "strict"))
    history = two_turns(h)
    for replay in (respelled(history), respelled(history, ids=True)):
        reply = h.post([*replay, AGAIN])
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "rollback_too_deep"
    assert len(h.get()["records"]) == 2  # nothing stored


@pytest.mark.integration
def test_v1_loose_tool_call_continues_a_respelled_history_on_the_stored_one(servers):
    h = Harness(servers("v1", "loose_tool_call"))
    history = two_turns(h)
    reply = h.post([*respelled(history, ids=True), AGAIN])  # a call id is still identity
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "rollback_too_deep", reply.text
    body = check_continued(h, history, respelled(history))
    assert body["metadata"]["num_rollbacks"] == 0  # one line: no record dropped


@pytest.mark.integration
def test_v1_role_content_only_continues_a_history_with_other_call_ids(servers):
    h = Harness(servers("v1", "role_content_only"))
    history = two_turns(h)
    body = check_continued(h, history, respelled(history, ids=True))
    assert body["metadata"]["num_rollbacks"] == 0


@pytest.mark.integration
def test_v2_strict_makes_a_respelled_history_a_new_root(servers):
    h = Harness(servers("v2", "strict"))
    history = two_turns(h)
    h.turn([*respelled(history), AGAIN])
    nodes = h.get()["metadata"]["tree"]["nodes"]
    assert [n["parent"] for n in nodes] == [None, 0, None]


@pytest.mark.integration
def test_v2_loose_tool_call_attaches_a_respelled_history_at_its_node(servers):
    h = Harness(servers("v2", "loose_tool_call"))
    history = two_turns(h)
    body = check_continued(h, history, respelled(history))
    assert [n["parent"] for n in body["metadata"]["tree"]["nodes"]] == [None, 0, 1]
    h.turn([*respelled(history, ids=True), AGAIN])  # other ids: a branch where the call was made
    assert [n["parent"] for n in h.get()["metadata"]["tree"]["nodes"]] == [None, 0, 1, None]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_a_failing_matcher_is_a_typed_500_and_stores_nothing(servers, mode):
    h = Harness(servers(mode, EXPLODING))
    r1 = h.turn([SYS, USER])  # nothing stored yet: the matcher is not asked
    reply = h.post([SYS, USER, r1, AGAIN])
    assert reply.status_code == 500, reply.text
    error = reply.json()["error"]
    assert error["code"] == "message_matcher_failed"
    assert EXPLODING in error["message"] and "matcher asked to explode" in error["message"]
    assert "Traceback" not in reply.text
    assert len(h.get()["records"]) == 1


@pytest.mark.integration
def test_a_restart_serves_the_stored_spelling_not_the_replayed_one(servers, session_server_factory, backend,
                                                                    tmp_path):
    """The journal keeps what the session holds: after a loose turn and a restart under
    ``strict``, the verbatim stored history extends the session and the respelled one does not."""
    env = {**HOOK_ENV, "SHINKEN_DATA_DIR": str(tmp_path)}

    def launch(matcher: str) -> Any:
        return session_server_factory.launch(servers.workers, backend.url, "--session-message-matcher", matcher,
                                             env=env)

    loose = launch("loose_tool_call")
    h = Harness(loose.url)
    history = two_turns(h)
    r3 = h.turn([*respelled(history), AGAIN])
    loose.close()
    h.url = launch("strict").url
    assert h.post([*respelled(history), AGAIN, r3, USER]).status_code == 400
    h.turn([*history, AGAIN, r3, USER])
    body = h.get()
    assert body["records"][-1]["request"]["input_ids"] == canonical([*history, AGAIN, r3, USER])
    assert len(body["records"]) == 4 and body["metadata"]["tito_session_mismatch"] == []


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SHINKEN_")}
    full.update(HOOK_ENV)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "webapp.serve", "--bind", "127.0.0.1:0", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False, env=full)


@pytest.mark.integration
@pytest.mark.parametrize("workers", ["0", "2"])
@pytest.mark.parametrize(("args", "env", "words"), [
    (["--session-message-matcher", "Strict"], {}, ["UnknownMatcher", "'Strict'", "strict, loose_tool_call"]),
    ([], {"SHINKEN_SESSION_MESSAGE_MATCHER": "tests.webapp.matcher_hooks:async_matcher"},
     ["UnknownMatcher", "async"]),
    (["--session-message-matcher", "no_such_module_xyz:fn"], {}, ["UnknownMatcher", "cannot import"]),
])
def test_an_unknown_matcher_refuses_start_up_naming_the_error(workers, args, env, words):
    result = _serve("--workers", workers, *args, env=env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("usage:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "--session-message-matcher" in lines[0] and all(word in lines[0] for word in words), lines[0]
    assert result.stdout == ""  # nothing started
