"""The project's own tiny policy model and character tokenizer.

- `rollart.models.tokenizer`: `build_char_tokenizer()`, `save_char_tokenizer(dir)`, `VOCAB`.
- `rollart.models.tiny`: `TinyModelSpec`, `build_tiny_model(dir, ...)`, `init_tiny_model(spec)`,
  `ensure_tiny_model(cache_dir, spec, demonstrations=..., sft=...)`.
- `rollart.models.sft`: `SFTConfig`, `sft_warmup(model, tokenizer, pairs, cfg)`.

Submodules are imported explicitly, so importing `rollart.models` itself stays cheap.
"""
