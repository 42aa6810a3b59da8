"""The tiny Qwen2 model: deterministic build, HF checkpoint layout, spec bounds, cache, SFT hook."""

from __future__ import annotations

import hashlib
import json
import logging
import math

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollart.models.tiny as tiny
from rollart.models.sft import (
    SFTConfig,
    cache_fields,
    collate_sft,
    completion_nll,
    encode_pairs,
    lr_factor,
    pack_turns,
    sft_warmup,
)
from rollart.models.tiny import (
    TinyModelSpec,
    build_tiny_model,
    ensure_tiny_model,
    init_tiny_model,
    validate_spec,
)
from rollart.models.tokenizer import VOCAB, VOCAB_SIZE, build_char_tokenizer

# Small enough to build in well under a second on 2 cores; head size 32 is vLLM's CPU minimum.
SMALL = dict(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)


def test_same_seed_gives_byte_identical_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=7, **SMALL)
    b = build_tiny_model(tmp_path / "b", seed=7, **SMALL)
    c = build_tiny_model(tmp_path / "c", seed=8, **SMALL)
    wa = (a / "model.safetensors").read_bytes()
    assert wa == (b / "model.safetensors").read_bytes()
    assert wa != (c / "model.safetensors").read_bytes()


def test_build_does_not_consume_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    init_tiny_model(TinyModelSpec(**SMALL))
    assert torch.equal(torch.rand(3), expected)


def test_checkpoint_is_a_normal_hf_directory(tmp_path):
    d = build_tiny_model(tmp_path / "m", seed=0)
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == VOCAB_SIZE
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [VOCAB["<|im_end|>"], VOCAB["<|eos|>"]]
    spec = msgspec.json.decode((d / tiny.SPEC_FILENAME).read_bytes(), type=TinyModelSpec)
    assert spec == TinyModelSpec()

    model = AutoModelForCausalLM.from_pretrained(str(d))
    tok = AutoTokenizer.from_pretrained(str(d))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("hello")])
    assert model(input_ids=ids).logits.shape == (1, 5, VOCAB_SIZE)


def test_spec_rejects_unsupported_head_size_and_out_of_bound_fields():
    with pytest.raises(ValueError, match="head size"):
        TinyModelSpec(hidden_size=64, num_heads=4)  # head size 16 < 32
    with pytest.raises(ValueError, match="head size .* 50 is not one of"):
        TinyModelSpec(hidden_size=100, num_heads=2)  # in [32, 512], but no CPU kernel for it
    with pytest.raises(ValueError, match="not divisible"):
        TinyModelSpec(hidden_size=100, num_heads=3)
    with pytest.raises(msgspec.ValidationError, match="num_layers"):
        validate_spec(TinyModelSpec(num_layers=0))
    with pytest.raises(msgspec.ValidationError, match="nonsense"):
        msgspec.json.decode(b'{"nonsense": 1}', type=TinyModelSpec)


def test_ensure_builds_once_then_reuses(tmp_path, monkeypatch):
    spec = TinyModelSpec(seed=1, **SMALL)
    first = ensure_tiny_model(tmp_path, spec)
    assert (first / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp dir left behind

    def fail(*a, **k):
        raise AssertionError("must not rebuild a cached model")

    monkeypatch.setattr(tiny, "build_tiny_model", fail)
    assert ensure_tiny_model(tmp_path, spec) == first


def test_ensure_keys_on_spec(tmp_path):
    a = ensure_tiny_model(tmp_path, TinyModelSpec(seed=1, **SMALL))
    b = ensure_tiny_model(tmp_path, TinyModelSpec(seed=2, **SMALL))
    assert a != b


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def broken(out_dir, **kw):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "build_tiny_model", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_tiny_model(tmp_path, TinyModelSpec(**SMALL))
    assert list(tmp_path.iterdir()) == []


def test_concurrent_builder_wins_race_and_its_copy_is_kept(tmp_path, monkeypatch):
    spec = TinyModelSpec(**SMALL)
    real_build = tiny.build_tiny_model
    final = tmp_path / f"tiny-{tiny._cache_key(spec, None, None)}"

    def build_then_other_process_finishes(out_dir, **kw):
        real_build(out_dir, **kw)
        final.mkdir()
        (final / "marker").write_text("other")

    monkeypatch.setattr(tiny, "build_tiny_model", build_then_other_process_finishes)
    assert ensure_tiny_model(tmp_path, spec) == final
    assert (final / "marker").read_text() == "other"
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


DEMOS = [
    (f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n", str(a + b))
    for a in range(4)
    for b in range(4)
]


def test_sft_targets_are_completion_tokens_only():
    tok = build_char_tokenizer()
    cfg = SFTConfig()
    enc = encode_pairs(tok, [("ab", "cd"), ("x", "y")], cfg)
    assert enc == [
        ([VOCAB["a"], VOCAB["b"], VOCAB["c"], VOCAB["d"], tok.eos_token_id], 2),
        ([VOCAB["x"], VOCAB["y"], tok.eos_token_id], 1),
    ]
    ids, attn, target = collate_sft(enc, pad_token_id=0)
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert target.tolist() == [[False, False, True, True, True], [False, True, True, False, False]]
    with pytest.raises(ValueError, match="max_length"):
        encode_pairs(tok, [("abc", "def")], SFTConfig(max_length=4))


def test_sft_warmup_loss_decreases(caplog):
    torch.manual_seed(0)
    model = init_tiny_model(TinyModelSpec(seed=0, **SMALL))
    tok = build_char_tokenizer()
    cfg = SFTConfig(epochs=15, batch_size=8, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    with caplog.at_level(logging.INFO, logger="rollart.models.sft"):
        history = sft_warmup(model, tok, DEMOS, cfg)
    assert len(history) == 15 * 2
    # progress for whoever waits on a long warm-up: every step of 30 (fewer than 50), the last
    steps = [r.progress for r in caplog.records if hasattr(r, "progress")]
    assert steps == [(k, 30) for k in range(1, 31)]
    assert caplog.records[-1].getMessage() == f"warm-up step 30/30, loss {history[-1]:.3f}"
    assert all(torch.isfinite(torch.tensor(history)))
    first, last = sum(history[:2]) / 2, sum(history[-2:]) / 2
    assert last < 0.5 * first, (first, last)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_ensure_with_demonstrations_runs_the_warm_up(tmp_path):
    spec = TinyModelSpec(**SMALL)
    plain = ensure_tiny_model(tmp_path, spec)
    warmed = ensure_tiny_model(tmp_path, spec, demonstrations=DEMOS, sft=SFTConfig(epochs=2))
    assert warmed != plain
    hist = json.loads((warmed / "rollart_sft_history.json").read_text())
    assert hist["num_demonstrations"] == len(DEMOS) and len(hist["loss_history"]) == 2
    assert (warmed / "model.safetensors").read_bytes() != (plain / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="empty"):
        ensure_tiny_model(tmp_path, spec, demonstrations=[])


def test_cosine_schedule_warms_up_then_decays_to_zero():
    cos = SFTConfig(lr_schedule="cosine")
    total = 100  # warm-up: ceil(5% of 100) = 5 steps
    assert [lr_factor(cos, s, total) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lr_factor(cos, 5, total) == pytest.approx(1.0)
    assert lr_factor(cos, 5 + 95 // 2, total) == pytest.approx(0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert lr_factor(cos, 99, total) == pytest.approx(0.5 * (1 + math.cos(math.pi * 94 / 95)))
    assert all(lr_factor(SFTConfig(), s, total) == 1.0 for s in range(total))


def test_sft_warmup_applies_the_schedule_and_restores_the_thread_count():
    tok = build_char_tokenizer()
    finals = []
    threads = torch.get_num_threads()
    for schedule in ("constant", "cosine"):
        torch.manual_seed(0)
        model = init_tiny_model(TinyModelSpec(seed=0, **SMALL))
        sft_warmup(model, tok, DEMOS, SFTConfig(epochs=3, batch_size=8, lr=1e-2,
                                                lr_schedule=schedule, num_threads=1))
        assert torch.get_num_threads() == threads
        finals.append([p.detach().clone() for p in model.parameters()])
    assert any(not torch.equal(a, b) for a, b in zip(*finals, strict=True))


def test_new_sft_fields_at_their_defaults_leave_cache_keys_unchanged():
    # The quickstart's cached checkpoints were keyed on these fields only.
    old = ["epochs", "lr", "weight_decay", "batch_size", "max_grad_norm", "seed", "append_eos",
           "max_length"]
    assert list(cache_fields(SFTConfig(epochs=1, lr=3e-3))) == old
    assert list(cache_fields(SFTConfig(lr_schedule="cosine", num_threads=1))) == [
        *old, "lr_schedule", "num_threads"]
    assert list(cache_fields(SFTConfig(pack_turns=True))) == [*old, "pack_turns"]
    spec, demos = TinyModelSpec(**SMALL), [("a", "b")]
    assert tiny._cache_key(spec, SFTConfig(), demos) != tiny._cache_key(
        spec, SFTConfig(lr_schedule="cosine"), demos)


def test_the_tool_call_tokens_field_keys_only_the_models_that_have_them():
    # Plain specs hash as before the field existed (their checkpoints did not change): the
    # spec encoded without it. A spec with the tokens is another model, and the recipe that
    # warms up on tool calls asks for them.
    from rollart.models.warmup import TOOL_CALL_RECIPE, warmup_spec

    plain = TinyModelSpec(**SMALL)
    fields = msgspec.structs.asdict(plain)
    del fields["tool_call_tokens"]
    h = hashlib.sha256(msgspec.json.encode(fields))
    h.update(json.dumps(VOCAB, sort_keys=True).encode())
    h.update(tiny.CHAT_TEMPLATE.encode())
    assert tiny._cache_key(plain, None, None) == h.hexdigest()[:16]
    tools = msgspec.structs.replace(plain, tool_call_tokens=True)
    assert tiny._cache_key(tools, None, None) != tiny._cache_key(plain, None, None)
    assert tiny.tiny_config(tools).vocab_size == 263 == tiny.tiny_config(plain).vocab_size + 2
    assert warmup_spec(3, TOOL_CALL_RECIPE).spec.tool_call_tokens


def _conversation(turns: int, tag: str) -> list[tuple[str, str]]:
    """The (prompt, completion) pairs of one multi-turn chat: each prompt holds every earlier
    pair's whole text (with the eos the engine ends a turn with)."""
    pairs, text = [], f"<|im_start|>user\n{tag}<|im_end|>\n<|im_start|>assistant\n"
    for k in range(turns):
        completion = f"{tag}{k}" * (k + 1)
        pairs.append((text, completion))
        text += f"{completion}<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    return pairs


def test_pack_turns_merges_only_a_pair_that_begins_the_next_prompt():
    tok = build_char_tokenizer()
    pairs = [*_conversation(3, "a"), ("x", "y"), *_conversation(2, "b")]
    enc = encode_pairs(tok, pairs, SFTConfig())
    packed = pack_turns(enc)
    assert [ids for ids, _ in packed] == [enc[2][0], enc[3][0], enc[5][0]]
    assert packed[0][1] == [(n, len(ids)) for ids, n in enc[:3]]
    assert packed[1][1] == [(1, 3)] and packed[2][1] == [(n, len(ids)) for ids, n in enc[4:]]
    # a next prompt holding another reply than the pair's completion does not continue it
    (first, reply), (second, later) = _conversation(2, "a")
    other = encode_pairs(tok, [(first, reply + "!"), (second, later)], SFTConfig())
    assert len(pack_turns(other)) == 2


def test_packed_turns_have_the_same_targets_and_losses_as_separate_pairs():
    torch.manual_seed(0)
    model = init_tiny_model(TinyModelSpec(seed=0, **SMALL)).eval()
    tok = build_char_tokenizer()
    enc = encode_pairs(tok, [*_conversation(3, "a"), *_conversation(2, "bc")], SFTConfig())
    packed = pack_turns(enc)
    assert len(packed) == 2
    sums = []
    for data in (enc, packed):
        ids, attn, target = collate_sft(data, pad_token_id=0)
        nll, count = completion_nll(model, ids, target, attn)
        sums.append((float(nll), int(count)))
    (nll_a, count_a), (nll_b, count_b) = sums
    assert count_a == count_b == sum(len(ids) - n for ids, n in enc)
    assert nll_b == pytest.approx(nll_a, rel=1e-5)
    # sft_warmup with pack_turns trains one step per packed batch
    history = sft_warmup(model, tok, [*_conversation(3, "a"), *_conversation(2, "bc")],
                         SFTConfig(epochs=2, batch_size=1, pack_turns=True))
    assert len(history) == 2 * 2
