"""The byte-level tokenizer: exact round trips, fixed vocabulary, loading through AutoTokenizer (as
vLLM does, which picks Qwen2Tokenizer for a qwen2 checkpoint), chat template."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rollart.models.tokenizer import (
    BYTE_SYMBOLS,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    UNK_TOKEN,
    VOCAB,
    VOCAB_SIZE,
    build_char_tokenizer,
    char_id,
)

PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7F)) + "\n\t"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def saved_tok(tmp_path_factory):
    # Loaded from a whole tiny checkpoint: config.json says qwen2, so AutoTokenizer (and vLLM)
    # build transformers' Qwen2Tokenizer from the files, not the class we saved.
    from rollart.models.tiny import build_tiny_model

    d = build_tiny_model(tmp_path_factory.mktemp("tok") / "m", seed=0)
    return AutoTokenizer.from_pretrained(str(d))


def test_vocabulary_is_small_and_fixed(tok):
    assert VOCAB_SIZE == len(tok) == 261
    assert len(set(BYTE_SYMBOLS)) == 256
    specials = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)
    assert [VOCAB[t] for t in specials] == [0, 1, 2, 3, 4]
    assert tok.pad_token_id == 0 and tok.eos_token_id == 3 and tok.unk_token_id == 4
    assert tok.bos_token_id is None


def test_one_token_per_character_no_bos_or_eos_added(tok):
    text = "a b\n  c"
    assert tok.encode(text) == [char_id(c) for c in text]
    assert char_id("a") == VOCAB["a"] and char_id(" ") == VOCAB["\u0120"]  # GPT-2's space


def test_round_trip_of_every_printable_character_with_spaces_and_newlines(tok, saved_tok):
    text = PRINTABLE + "  two  spaces \n\n trailing newline\n" + " . , ! ? 'quoted' "
    for t in (tok, saved_tok):
        ids = t.encode(text)
        assert len(ids) == len(text)
        assert t.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=PRINTABLE, max_size=200))
def test_round_trip_property(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_in_text_are_single_ids_and_skippable(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids == [VOCAB[IM_START_TOKEN], char_id("h"), char_id("i"), VOCAB[IM_END_TOKEN]]
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_non_ascii_text_round_trips_through_its_bytes(tok, saved_tok):
    text = "a\u00e9 \u4e2d\n"
    for t in (tok, saved_tok):
        ids = t.encode(text)
        assert len(ids) == len(text.encode()) and VOCAB[UNK_TOKEN] not in ids
        assert t.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=PRINTABLE, max_size=120))
def test_checkpoint_tokenizer_agrees_with_in_memory_one(tok, saved_tok, text):
    # The bug this guards against: the saved tokenizer loaded as Qwen2Tokenizer dropped spaces.
    text = f"<|im_start|>user\n{text}<|im_end|>\n"
    assert saved_tok.encode(text) == tok.encode(text)


def test_saved_tokenizer_matches_in_memory_one(tok, saved_tok):
    assert saved_tok.get_vocab() == tok.get_vocab()
    assert saved_tok.eos_token == IM_END_TOKEN and saved_tok.pad_token == PAD_TOKEN


def test_chat_template_renders_chatml_with_generation_prompt(saved_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = saved_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = saved_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen.endswith("2+2?<|im_end|>\n")


def test_tool_call_tags_are_one_token_each_in_the_tool_call_models_tokenizer(tmp_path):
    """The tool-call warm-up's models (``TinyModelSpec.tool_call_tokens``): ``<tool_call>`` and
    ``</tool_call>`` are ids 261 and 262 wherever they appear, kept by a decode that skips
    special tokens (vLLM's hermes parser reads them in the text); every other id is the plain
    tokenizer's, and the plain tokenizer still spells the tags byte by byte."""
    from rollart.models.tiny import build_tiny_model
    from rollart.models.tokenizer import TOOL_CALL_END, TOOL_CALL_START, vocab_size

    plain = build_char_tokenizer()
    d = build_tiny_model(tmp_path / "m", seed=0, tool_call_tokens=True)
    assert json.loads((d / "config.json").read_text())["vocab_size"] == vocab_size(True) == 263
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
    for t in (build_char_tokenizer(tool_call_tokens=True), AutoTokenizer.from_pretrained(str(d))):
        assert len(t) == 263
        assert t.convert_tokens_to_ids([TOOL_CALL_START, TOOL_CALL_END]) == [261, 262]
        ids = t.encode(call + IM_END_TOKEN)
        inner = call[len(TOOL_CALL_START):-len(TOOL_CALL_END)]
        assert ids == [261, *plain.encode(inner), 262, VOCAB[IM_END_TOKEN]]
        assert t.decode(ids, skip_special_tokens=True) == call
    assert plain.encode(TOOL_CALL_END) == [char_id(c) for c in TOOL_CALL_END]
