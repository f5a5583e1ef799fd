"""TITO accounting without I/O: prompt ids, append-only checks, rollback limits."""

from __future__ import annotations

import pytest

from webapp.session_errors import AppendOnlyViolation, InvalidField, RollbackTooDeep, TokenPrefixMismatch
from webapp.tito import INITIAL_STATE, commit_turn, normalize_message, plan_turn
from webapp.tokenizers import ByteChatTokenizer

TOK = ByteChatTokenizer()


class Session:
    """A session driven by hand: each turn's output is text chosen by the test."""

    def __init__(self) -> None:
        self.state = INITIAL_STATE
        self.previous = None

    def turn(self, messages, reply_text: str, *, eos: bool = True, tools=None):
        plan = plan_turn(self.state, self.previous, messages, tools, TOK)
        output = TOK.encode(reply_text) + ([TOK.eos_token_id] if eos else [])
        assistant = normalize_message({"role": "assistant", "content": reply_text})
        self.previous, self.state = plan.base, commit_turn(plan, assistant, output, TOK.eos_token_id)
        return plan, {"role": "assistant", "content": reply_text}


def test_first_turn_renders_the_template():
    plan = plan_turn(INITIAL_STATE, None, [{"role": "user", "content": "hi"}], None, TOK)
    assert TOK.decode(plan.prompt_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert plan.prompt_ids[0] == 257 and not plan.rollback


def test_ten_turns_with_tool_messages_accumulate_exactly():
    s = Session()
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "open the file ☃"}]
    previous_ids: tuple[int, ...] = ()
    for i in range(10):
        plan, reply = s.turn(msgs, f'{{"action": {{"verb": "click", "x": {i}, "y": 2}}}}')
        # earlier turns are never re-tokenized: the stored ids are a prefix of the new prompt
        assert tuple(plan.prompt_ids[: len(previous_ids)]) == previous_ids
        previous_ids = s.state.token_ids
        conversation = msgs + [reply]
        msgs = msgs + [
            {**reply, "tool_calls": None, "refusal": None},  # what an openai-model echo looks like
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"screenshot {i} taken"},
        ]
        if i % 3 == 0:
            msgs.append({"role": "user", "content": [{"type": "text", "text": f"step {i}"},
                                                     {"type": "image", "image": "sha256:00", "width": 56,
                                                      "height": 56}]})
    # the accumulated ids are exactly the whole conversation as the template renders it
    rendered = TOK.render(conversation, add_generation_prompt=False)
    assert s.state.token_ids[-1] == TOK.eos_token_id
    # (each image's pad run, 4 pads for a 56x56 image, is one pad in the rendered text)
    pad = "<|image_pad|>"
    assert TOK.decode(s.state.token_ids).replace(pad * 4, pad) + "\n" == rendered
    assert len(s.state.messages) == len(conversation)


def test_accumulated_ids_equal_last_prompt_plus_output():
    s = Session()
    plan, reply = s.turn([{"role": "user", "content": "a"}], "b")
    plan2, _ = s.turn([{"role": "user", "content": "a"}, reply, {"role": "user", "content": "c"}], "d")
    assert s.state.token_ids == (*plan2.prompt_ids, *TOK.encode("d"), TOK.eos_token_id)
    # the new ids: the template's closer after the model's <|im_end|>, then the new user turn
    suffix = plan2.prompt_ids[len(plan.prompt_ids) + 2:]
    assert TOK.decode(suffix) == "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"


def test_output_without_end_of_turn_gets_the_template_closer():
    s = Session()
    _, reply = s.turn([{"role": "user", "content": "a"}], "trunc", eos=False)
    plan, _ = s.turn([{"role": "user", "content": "a"}, reply, {"role": "user", "content": "b"}], "x")
    text = TOK.decode(plan.prompt_ids)
    assert text == ("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\ntrunc<|im_end|>\n"
                    "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n")


def test_rollback_of_one_assistant_step_is_allowed():
    s = Session()
    first = [{"role": "user", "content": "a"}]
    _, r1 = s.turn(first, "one")
    second = first + [r1, {"role": "user", "content": "b"}]
    plan2, _ = s.turn(second, "two")
    # retry the last turn with a different last user message: rolls back "two"
    retry = first + [r1, {"role": "user", "content": "B"}]
    plan3, _ = s.turn(retry, "three")
    assert plan3.rollback
    assert plan3.prompt_ids[: len(plan2.base.token_ids)] == list(plan2.base.token_ids)
    assert TOK.decode(s.state.token_ids).endswith("user\nB<|im_end|>\n<|im_start|>assistant\nthree<|im_end|>")


def test_rollback_deeper_than_one_step_is_refused():
    s = Session()
    first = [{"role": "user", "content": "a"}]
    _, r1 = s.turn(first, "one")
    _, r2 = s.turn(first + [r1, {"role": "user", "content": "b"}], "two")
    with pytest.raises(RollbackTooDeep):
        plan_turn(s.state, s.previous, first + [{"role": "user", "content": "z"}], None, TOK)
    with pytest.raises(RollbackTooDeep):  # editing an old message is also a deep rollback
        plan_turn(s.state, s.previous, [{"role": "user", "content": "A"}, r1, {"role": "user", "content": "b"},
                                        r2, {"role": "user", "content": "c"}], None, TOK)


def test_two_rollbacks_in_a_row_stay_one_step_deep():
    s = Session()
    first = [{"role": "user", "content": "a"}]
    _, r1 = s.turn(first, "one")
    s.turn(first + [r1, {"role": "user", "content": "b"}], "two")
    s.turn(first + [r1, {"role": "user", "content": "b2"}], "two-bis")  # rollback
    plan = plan_turn(s.state, s.previous, first + [r1, {"role": "user", "content": "b3"}], None, TOK)
    assert plan.rollback  # rolling back the just-regenerated step again is still one step
    with pytest.raises(RollbackTooDeep):
        plan_turn(s.state, s.previous, [{"role": "user", "content": "x"}], None, TOK)


@pytest.mark.parametrize("mutate, error", [
    (lambda m: m, AppendOnlyViolation),  # nothing new
    (lambda m: m + [{"role": "assistant", "content": "prefill"}], AppendOnlyViolation),
])
def test_append_only_violations(mutate, error):
    s = Session()
    first = [{"role": "user", "content": "a"}]
    _, r1 = s.turn(first, "one")
    stored = first + [r1]
    with pytest.raises(error):
        plan_turn(s.state, s.previous, mutate(stored), None, TOK)


def test_edited_assistant_reply_is_not_an_append():
    s = Session()
    first = [{"role": "user", "content": "a"}]
    s.turn(first, "one")
    s.previous = None  # no rollback target: only appends are possible
    with pytest.raises(AppendOnlyViolation) as info:
        plan_turn(s.state, s.previous, first + [{"role": "assistant", "content": "ONE"},
                                                {"role": "user", "content": "b"}], None, TOK)
    assert "message 1" in str(info.value)


def test_tools_may_change_between_turns_and_empty_is_absent():
    tools = [{"type": "function", "function": {"name": "computer", "parameters": {}}}]
    other = [{"type": "function", "function": {"name": "browser", "parameters": {}}}]
    s = Session()
    first, r1 = s.turn([{"role": "user", "content": "a"}], "one", tools=tools)
    stored = s.state.token_ids
    msgs = [{"role": "user", "content": "a"}, r1, {"role": "user", "content": "b"}]
    for new_tools in ([], None, other):  # as miles: tools may change; the stored ids stay as they were
        plan = plan_turn(s.state, s.previous, msgs, new_tools, TOK)
        assert plan.prompt_ids[:len(stored)] == list(stored) and not plan.rollback
        assert TOK.decode(plan.prompt_ids[len(stored):]) == \
            "\n<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n"
    # [] is no tools: the same key, and the same prompt as absent tools.
    assert plan_turn(INITIAL_STATE, None, msgs[:1], [], TOK) == plan_turn(INITIAL_STATE, None, msgs[:1], None, TOK)
    # A session without tools that gains some: its stored ids keep their rendering too.
    s2 = Session()
    _, r = s2.turn([{"role": "user", "content": "a"}], "one", tools=[])
    plan = plan_turn(s2.state, s2.previous, [{"role": "user", "content": "a"}, r, {"role": "user", "content": "b"}],
                     tools, TOK)
    assert plan.prompt_ids[:len(s2.state.token_ids)] == list(s2.state.token_ids)
    assert first.tools_key is not None and plan.tools_key is not None


class CountingTemplate(ByteChatTokenizer):
    """A template that is not append-only: its header counts the messages."""

    def render(self, messages, *, add_generation_prompt, tools=None):
        return f"[{len(messages)}]" + super().render(messages, add_generation_prompt=add_generation_prompt)


def test_template_that_rerenders_earlier_turns_is_a_prefix_mismatch():
    tok = CountingTemplate()
    plan = plan_turn(INITIAL_STATE, None, [{"role": "user", "content": "a"}], None, tok)
    state = commit_turn(plan, {"role": "assistant", "content": "b"}, tok.encode("b") + [tok.eos_token_id],
                        tok.eos_token_id)
    with pytest.raises(TokenPrefixMismatch):
        plan_turn(state, INITIAL_STATE, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                         {"role": "user", "content": "c"}], None, tok)


class ToolsSeen(ByteChatTokenizer):
    """Keeps the tools each render was given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def render(self, messages, *, add_generation_prompt, tools=None):
        self.seen.append(tools)
        return super().render(messages, add_generation_prompt=add_generation_prompt, tools=tools)


def test_the_template_gets_the_tools_keys_in_the_clients_order():
    """Templates render tool keys as given (Qwen2.5's ``tool | tojson``), so must the server:
    sorted keys made a prompt neither transformers nor the engine renders."""
    tok = ToolsSeen()
    tools = [{"type": "function", "function": {"name": "click", "description": "d", "parameters": {
        "type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}}}}]
    s = Session()
    s.turn([{"role": "user", "content": "a"}], "b", tools=tools)
    plan = plan_turn(s.state, s.previous, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                           {"role": "user", "content": "c"}], tools, tok)
    assert plan.tools_key == s.state.tools_key  # the same tools: no change between the turns
    assert tok.seen and all(seen == tools and list(seen[0]) == ["type", "function"]
                            and list(seen[0]["function"]) == ["name", "description", "parameters"]
                            and list(seen[0]["function"]["parameters"]["properties"]) == ["y", "x"]
                            for seen in tok.seen)


@pytest.mark.parametrize("messages", [
    None, [], "hi", [{"content": "no role"}], [{"role": 3, "content": "x"}], [{"role": "user", "content": 5}],
    [{"role": "assistant", "content": None, "tool_calls": [{"function": "x"}]}],
])
def test_bad_messages_are_invalid_fields(messages):
    with pytest.raises(InvalidField):
        plan_turn(INITIAL_STATE, None, messages, None, TOK)


def test_normalized_echo_equals_stored_message():
    stored = normalize_message({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "click", "arguments": '{"x": 1}'}}]})
    echo = {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [{"id": "c1", "type": "function",
                                                   "function": {"name": "click", "arguments": '{"x": 1}'}}]}
    assert normalize_message(echo) == stored
    assert normalize_message({"role": "assistant", "content": "x"}) != stored
