"""Agent conversations: token-exact capture (chat-template deltas, the rewrite policy) and the
request validation of the OpenAI endpoint. Uses the project's byte-level tokenizer (its chat
template renders tools in the hermes format), no model."""

from __future__ import annotations

import array
import json

import pytest

from rollart.controller.agents.capture import Conversation, HistoryRewritten, normalize_messages
from rollart.controller.agents.params import BadParam, parse_request
from rollart.controller.rollout.tokens import ChatTokens
from rollart.models.tokenizer import build_char_tokenizer
from rollart.transport import tokenbytes as tb

TOK = build_char_tokenizer()
CALC = {"type": "function", "function": {
    "name": "calc", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}
CALL_TEXT = '<tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>'
REPLY = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "calc", "arguments": '{"expr": "1+2"}'}}]}


def render(messages, tools, gen: bool) -> list[int]:
    kw = {"tools": tools} if tools else {}
    return TOK.encode(TOK.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=gen, **kw),
                      add_special_tokens=False)


def generate(conv: Conversation, messages, tools, text: str, reply, *, eos: bool = True,
             version: int = 3) -> list[int]:
    ids = TOK.encode(text, add_special_tokens=False) + ([TOK.eos_token_id] if eos else [])
    conv.append_prompt(conv.delta(normalize_messages(messages), tools))
    conv.append_generated(normalize_messages(messages), tools, array.array("i", ids),
                          tb.pack_f32([-0.25] * len(ids)), array.array("i", [version] * len(ids)),
                          reply)
    return ids


def test_a_tool_calling_conversation_is_its_chat_template_token_for_token() -> None:
    conv = Conversation(ChatTokens(TOK))
    first = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "1+2?"}]
    gen1 = generate(conv, first, [CALC], CALL_TEXT, REPLY)
    # The agent echoes the reply as the openai client returns it (content None, arguments
    # re-serialised with other spacing) and adds the tool's result.
    echo = {**REPLY, "content": None, "tool_calls": [
        {**REPLY["tool_calls"][0], "function": {"name": "calc", "arguments": '{"expr":"1+2"}'}}]}
    second = [*first, echo, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    gen2 = generate(conv, second, [CALC], "It is 3.", {"role": "assistant", "content": "It is 3."},
                    version=4)
    # The conversation as rollart returned it (the echo's spacing is the agent's own).
    full = [*first, REPLY, second[-1], {"role": "assistant", "content": "It is 3."}]
    expected = render(full, [CALC], gen=False)
    # The template's "\n" after the last end-of-turn token is not generated, so not trained.
    assert conv.token_ids.tolist() == expected[:-1]
    mask = conv.loss_mask.tolist()
    assert sum(mask) == len(gen1) + len(gen2) == conv.num_generated
    first_len = len(render(first, [CALC], gen=True))
    assert conv.num_prompt_tokens == first_len
    assert mask[first_len:first_len + len(gen1)] == [1] * len(gen1)
    assert conv.token_ids[first_len:first_len + len(gen1)].tolist() == gen1
    assert conv.token_ids[-len(gen2):].tolist() == gen2 and mask[-len(gen2):] == [1] * len(gen2)
    # Logprobs and versions are kept for the generated tokens only, in order.
    assert conv.versions.tolist() == [3] * len(gen1) + [4] * len(gen2)
    assert conv.logprobs.tolist() == [-0.25] * sum(mask)
    assert conv.num_turns == 2


def test_generated_ids_are_kept_even_where_the_template_renders_the_turn_otherwise() -> None:
    conv = Conversation(ChatTokens(TOK))
    first = [{"role": "user", "content": "1+2?"}]
    spaced = '<tool_call>{"name":"calc","arguments":{"expr":"1+2"}}</tool_call>'  # no spaces
    gen = generate(conv, first, [CALC], spaced, REPLY)
    second = [*first, REPLY, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    delta = conv.delta(normalize_messages(second), [CALC])
    start = len(render(first, [CALC], gen=True))
    assert conv.token_ids[start:].tolist() == gen  # verbatim, not the template's spacing
    assert TOK.decode(delta) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_cut_by_length_is_closed_before_the_next_message() -> None:
    conv = Conversation(ChatTokens(TOK))
    first = [{"role": "user", "content": "hi"}]
    generate(conv, first, None, "hel", {"role": "assistant", "content": "hel"}, eos=False)
    second = [*first, {"role": "assistant", "content": "hel"}, {"role": "user", "content": "go"}]
    delta = conv.delta(normalize_messages(second), None)
    assert delta[0] == TOK.eos_token_id
    assert TOK.decode(delta) == "<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("change", "match"), [
    (lambda ms, tools: ([{**ms[0], "content": "2+2?"}, *ms[1:]], tools), r"messages\[0\]"),
    (lambda ms, tools: ([ms[0], {"role": "user", "content": "again"}], tools), "more than"),
    (lambda ms, tools: ([ms[0], {**REPLY, "tool_calls": [{**REPLY["tool_calls"][0], "function": {
        "name": "calc", "arguments": '{"expr": "2+2"}'}}]}, *ms[2:]], tools),
     "the assistant reply rollart returned"),
    (lambda ms, tools: (ms, None), "tools"),
])
def test_a_rewritten_history_is_refused_by_name(change, match) -> None:
    conv = Conversation(ChatTokens(TOK))
    first = [{"role": "user", "content": "1+2?"}]
    generate(conv, first, [CALC], CALL_TEXT, REPLY)
    ok = [*first, REPLY, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    conv.delta(normalize_messages(ok), [CALC])  # the honest continuation is accepted
    messages, tools = change(ok, [CALC])
    with pytest.raises(HistoryRewritten, match=match):
        conv.delta(normalize_messages(messages), tools)


@pytest.mark.parametrize(("body", "param"), [
    ({"top_p": 0.9}, "top_p"),
    ({"top_k": 20}, "top_k"),
    ({"stream": True}, "stream"),
    ({"n": 2}, "n"),
    ({"n": True}, "n"),
    ({"temperature": 0.5}, "temperature"),
    ({"stop": ["\n"]}, "stop"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"guided_json": {}}, "guided_json"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_unreproducible_or_malformed_parameters_are_refused_by_name(body, param) -> None:
    full = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(BadParam) as err:
        parse_request(full, temperature=1.0)
    assert err.value.param == param


def test_neutral_parameters_are_accepted() -> None:
    req = parse_request({"model": "any", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "temperature": 1.0, "top_p": 1.0, "n": 1, "stream": False, "max_tokens": 5,
        "tools": [CALC], "seed": 3, "user": "u"}, temperature=1.0)
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert req.max_tokens == 5 and req.tools == [CALC] and req.parse_tools
    none = parse_request({"messages": [{"role": "user", "content": "x"}], "tools": [CALC],
                          "tool_choice": "none"}, temperature=1.0)
    assert not none.parse_tools
    assert json.dumps(none.tools)  # kept: the template still lists them


def test_a_template_that_refuses_the_messages_is_a_named_error_and_captures_nothing() -> None:
    from rollart.controller.agents.capture import TemplateRefused

    conv = Conversation(ChatTokens(TOK))
    refusing = ChatTokens(TOK)

    def refuse(*_a, **_k):  # as Llama / Mistral templates do for roles that do not alternate
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant")

    object.__setattr__(refusing, "tokenizer", type("FakeRefusingTokenizer", (), {
        "apply_chat_template": staticmethod(refuse)})())
    conv.chat = refusing
    with pytest.raises(TemplateRefused, match="roles must alternate"):
        conv.delta([{"role": "user", "content": "x"}], None)
    assert len(conv.token_ids) == 0 and conv.num_turns == 0


def test_a_null_max_completion_tokens_falls_back_to_max_tokens() -> None:
    req = parse_request({"messages": [{"role": "user", "content": "x"}],
                         "max_completion_tokens": None, "max_tokens": 7}, temperature=1.0)
    assert req.max_tokens == 7
