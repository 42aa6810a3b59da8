"""The project's own tiny policy: a Qwen2-architecture causal LM over the character tokenizer.

Built deterministically from a seed (same spec -> byte-identical `model.safetensors`) and saved as
an ordinary Hugging Face checkpoint directory (config.json, model.safetensors, generation_config.json,
tokenizer files), so transformers, vLLM and any other HF-compatible tool load it by path.

Defaults: hidden 128, 2 layers, 2 heads (head_dim 64, because vLLM's CPU attention supports head
sizes 32..512 only), tied input/output embeddings, float32, vocabulary = the byte-level tokenizer's
261 ids (263 with `TinyModelSpec.tool_call_tokens`).

`ensure_tiny_model` is the cached entry point: the directory name hashes the spec, the optional
SFT config and the demonstrations, so a different recipe never reuses a stale checkpoint; building
happens in a temporary directory renamed into place, so a crash leaves no half-written cache entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import msgspec
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from rollart.config.validate import CPU_HEAD_SIZES
from rollart.models.sft import SFTConfig, cache_fields, sft_warmup
from rollart.models.tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    TOOL_CALL_VOCAB,
    VOCAB,
    save_char_tokenizer,
    vocab_size,
)

log = logging.getLogger(__name__)
# vLLM's CPU attention kernels accept these head sizes only.
MIN_HEAD_DIM = min(CPU_HEAD_SIZES)
MAX_HEAD_DIM = max(CPU_HEAD_SIZES)
SPEC_FILENAME = "rollart_tiny_spec.json"


class TinyModelSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Architecture and seed of the tiny model. Bounds are enforced by `validate_spec` and on
    decode; `hidden_size / num_heads` (the head size) must be one of `CPU_HEAD_SIZES`."""

    seed: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 0
    hidden_size: Annotated[int, msgspec.Meta(ge=32, le=4096)] = 128
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    num_heads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    num_kv_heads: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    intermediate_size: Annotated[int, msgspec.Meta(ge=8, le=16384)] = 512
    max_position_embeddings: Annotated[int, msgspec.Meta(ge=64, le=131072)] = 2048
    rope_theta: Annotated[float, msgspec.Meta(gt=0)] = 10000.0
    #: the tokenizer's ``<tool_call>`` / ``</tool_call>`` tokens (ids 261, 262; the tool-call
    #: warm-up's models, `rollart.models.tokenizer`): a vocabulary of 263
    tool_call_tokens: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        head_dim = self.hidden_size // self.num_heads
        if head_dim not in CPU_HEAD_SIZES:
            raise ValueError(
                f"head size hidden_size/num_heads = {head_dim} is not one of "
                f"{', '.join(map(str, CPU_HEAD_SIZES))} (the sizes vLLM's CPU attention runs)"
            )
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {kv}")


def validate_spec(spec: TinyModelSpec) -> TinyModelSpec:
    """Return `spec` after checking its `msgspec.Meta` bounds (which plain construction skips).

    Raises:
        msgspec.ValidationError: a field is out of bounds or the head size is unsupported; the
            message names the field.
    """
    return msgspec.convert(msgspec.structs.asdict(spec), TinyModelSpec)


def tiny_config(spec: TinyModelSpec) -> Qwen2Config:
    """The `Qwen2Config` for `spec`: tied embeddings, float32, special-token ids of the tokenizer."""
    return Qwen2Config(
        vocab_size=vocab_size(spec.tool_call_tokens),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads or spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        pad_token_id=VOCAB[PAD_TOKEN],
        eos_token_id=VOCAB[IM_END_TOKEN],
        bos_token_id=None,
        dtype="float32",
    )


def _generation_config() -> GenerationConfig:
    # Both the end of an assistant turn and the end of a plain document stop generation.
    return GenerationConfig(
        eos_token_id=[VOCAB[IM_END_TOKEN], VOCAB[EOS_TOKEN]],
        pad_token_id=VOCAB[PAD_TOKEN],
        bos_token_id=None,
    )


def init_tiny_model(spec: TinyModelSpec) -> Qwen2ForCausalLM:
    """Instantiate the randomly initialised model for `spec` in memory (float32, CPU).

    Deterministic: weights depend only on `spec` (the global torch RNG is forked, not consumed).
    """
    spec = validate_spec(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(tiny_config(spec))
    model.generation_config = _generation_config()
    # transformers wraps ``PreTrainedModel.to`` in a decorator pyright reads as unbound.
    return model.to(torch.float32)  # pyright: ignore[reportArgumentType]


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int | None = None,
    intermediate_size: int = 512,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    tool_call_tokens: bool = False,
) -> Path:
    """Build the tiny model from a seed and save it as a Hugging Face checkpoint directory.

    Args:
        out_dir: directory to write (created; existing files with the same names are replaced).
        seed, hidden_size, ...: the fields of `TinyModelSpec` (see its bounds).

    Returns:
        `Path(out_dir)`, holding config.json, model.safetensors (float32, tied embeddings stored
        once), generation_config.json (eos ids `<|im_end|>`, `<|eos|>`), the tokenizer files and
        `rollart_tiny_spec.json` (the spec, for provenance).

    Raises:
        ValueError: the head size `hidden_size / num_heads` is not one of `CPU_HEAD_SIZES`, or
            `num_heads` is not a multiple of `num_kv_heads`.
        msgspec.ValidationError: a spec field is out of bounds (the message names it).
    """
    spec = TinyModelSpec(
        seed=seed,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tool_call_tokens=tool_call_tokens,
    )
    model = init_tiny_model(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    save_char_tokenizer(out, tool_call_tokens)
    (out / SPEC_FILENAME).write_bytes(msgspec.json.format(msgspec.json.encode(spec)))
    return out


def _cache_key(
    spec: TinyModelSpec, sft: SFTConfig | None, demos: list[tuple[str, str]] | None
) -> str:
    h = hashlib.sha256()
    fields = msgspec.structs.asdict(spec)
    # A spec without the tool-call tokens hashes as before the field existed: a plain model's
    # checkpoint is unchanged by it, so its cache entry (and warm-up) is kept.
    h.update(msgspec.json.encode({k: v for k, v in fields.items() if k != "tool_call_tokens"}))
    if spec.tool_call_tokens:
        h.update(json.dumps(TOOL_CALL_VOCAB, sort_keys=True).encode())
    # A tokenizer change (new ids for the same text) must never reuse an old checkpoint.
    h.update(json.dumps(VOCAB, sort_keys=True).encode())
    # ... and a checkpoint saved with an older chat template (no tools) is not reused either.
    h.update(CHAT_TEMPLATE.encode())
    if demos is not None:
        h.update(msgspec.json.encode(cache_fields(sft or SFTConfig())))
        # JSON of the pairs keeps prompt/completion boundaries unambiguous in the hash.
        h.update(json.dumps(demos, ensure_ascii=True).encode())
    return h.hexdigest()[:16]


def ensure_tiny_model(
    cache_dir: str | Path,
    spec: TinyModelSpec | None = None,
    *,
    demonstrations: Iterable[tuple[str, str]] | None = None,
    sft: SFTConfig | None = None,
) -> Path:
    """Return the cached checkpoint directory for `spec` (+ optional SFT warm-up), building it
    if missing.

    The warm-up hook: pass `demonstrations` as (prompt, completion) text pairs (prompts already
    rendered, e.g. with `tokenizer.apply_chat_template(..., add_generation_prompt=True)`) and the
    freshly built model is trained on them with `sft_warmup` before it is cached. The cache entry
    is `cache_dir/tiny-<hash>` where the hash covers the spec, `sft` and the demonstrations.

    Atomicity: the checkpoint is written into a temporary directory inside `cache_dir` and then
    renamed; if another process finished the same entry first, its copy is kept and ours deleted.

    Raises:
        msgspec.ValidationError: bad spec or SFT config.
        ValueError: an empty demonstrations iterable.
    """
    spec = validate_spec(spec or TinyModelSpec())
    demos = None
    if demonstrations is not None:
        demos = [(str(p), str(c)) for p, c in demonstrations]
        if not demos:
            raise ValueError("demonstrations is empty; pass None to skip the SFT warm-up")
    if sft is not None:
        sft = msgspec.convert(msgspec.structs.asdict(sft), SFTConfig)
    cache = Path(cache_dir)
    final = cache / f"tiny-{_cache_key(spec, sft, demos)}"
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    log.info("not cached: building %s%s", final.name,
             f" and warming it up on {len(demos)} demonstrations" if demos else "")
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        build_tiny_model(tmp, **msgspec.structs.asdict(spec))
        if demos is not None:
            _warm_up_in_place(tmp, demos, sft or SFTConfig())
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost the race to a concurrent builder: its entry is equivalent, keep it.
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _warm_up_in_place(model_dir: Path, demos: list[tuple[str, str]], cfg: SFTConfig) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    history = sft_warmup(model, tokenizer, demos, cfg)
    model.save_pretrained(str(model_dir))
    (model_dir / "rollart_sft_history.json").write_text(
        json.dumps({"num_demonstrations": len(demos), "loss_history": history})
    )
