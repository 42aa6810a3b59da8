"""Chat-template deltas: observation tokens come from the new text only, never re-tokenising."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.fakes import TOK, FakeTokenizer
from rollart.controller.rollout.tokens import ChatTokens
from rollart.transport import tokenbytes as tb


def test_delta_with_the_projects_char_tokenizer_matches_the_full_render() -> None:
    from rollart.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    chat = ChatTokens(tok)
    msgs = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Guess 1-10"}]
    ids = chat.prompt_ids(msgs)
    for answer, obs in [("5", "Higher"), ("8", "Lower"), ("7", "Correct!")]:
        generated = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
        ids += generated
        ids += chat.observation_ids(obs, generated)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": obs}]
    full = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ids == tok.encode(full, add_special_tokens=False)


class FakeThinkingTokenizer(FakeTokenizer):
    """Like Qwen3's template: earlier assistant turns lose their <think> block, so rendering a
    longer conversation is not an extension of a shorter one's text."""

    def apply_chat_template(self, conversation, *, tokenize=True, add_generation_prompt=False,
                            **kwargs):
        last_user = max(i for i, m in enumerate(conversation) if m["role"] == "user")
        out = []
        for i, msg in enumerate(conversation):
            content = msg["content"]
            if msg["role"] == "assistant" and i < last_user and "</think>" in content:
                content = content.split("</think>", 1)[1].lstrip()
            out.append({**msg, "content": content})
        return super().apply_chat_template(out, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt)


def test_delta_ignores_templates_that_rewrite_history() -> None:
    tok = FakeThinkingTokenizer()
    chat = ChatTokens(tok)
    generated = tok.encode("<think>hmm</think> 5") + [tok.eos_token_id]
    delta = chat.observation_ids("Higher", generated)
    assert tok.decode(delta) == "\n<|im_start|>user\nHigher<|im_end|>\n<|im_start|>assistant\n"
    # The thinking tokens the engine produced stay in the sequence (they were sampled).
    assert tok.decode(generated + delta).startswith("<think>hmm</think> 5<|im_end|>\n")


def test_unclosed_turn_gets_the_eos_prepended() -> None:
    chat = ChatTokens(TOK)
    assert chat.observation_text("x", turn_closed=False).startswith("<|im_end|>\n<|im_start|>user")
    assert chat.observation_ids("x", TOK.encode("cut"))[0] == TOK.eos_token_id
    assert chat.observation_ids("x", [])[0] == TOK.eos_token_id


def test_template_kwargs_are_passed_and_bad_tokenizers_rejected() -> None:
    seen = {}

    class Recording(FakeTokenizer):
        def apply_chat_template(self, conversation, **kwargs):
            seen.update(kwargs)
            return super().apply_chat_template(conversation, **kwargs)

    ChatTokens(Recording(), {"enable_thinking": False})
    assert seen["enable_thinking"] is False

    class NoEos(FakeTokenizer):
        eos_token = None
        eos_token_id = None

    with pytest.raises(ValueError, match="no eos token"):
        ChatTokens(NoEos())

    class OtherEnd(FakeTokenizer):
        eos_token = "<|pad|>"
        eos_token_id = 0

    with pytest.raises(ValueError, match="does not close an assistant turn"):
        ChatTokens(OtherEnd())


class FakeArrayTokenizer(FakeTokenizer):
    """Answers ``encode`` with an int64 ndarray (as a tokenizer asked for arrays does)."""

    def encode(self, text: str, *, add_special_tokens: bool = False):
        return np.array(super().encode(text), dtype=np.int64)


def test_int32_prompt_path_takes_lists_and_arrays_alike() -> None:
    msgs = [{"role": "user", "content": "Guess 1-10"}]
    by_list, by_array = ChatTokens(FakeTokenizer()), ChatTokens(FakeArrayTokenizer())
    want = tb.pack_i32(by_list.prompt_ids(msgs))
    assert by_list.prompt_i32(msgs) == want and by_array.prompt_i32(msgs) == want
    assert by_array.prompt_ids(msgs) == by_list.prompt_ids(msgs)  # list API still a list
    gen = [40, TOK.eos_token_id]
    assert by_array.observation_i32("Higher", gen) == tb.pack_i32(
        by_list.observation_ids("Higher", gen))
