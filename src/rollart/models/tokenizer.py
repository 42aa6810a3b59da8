"""The project's character-level tokenizer, saved as an ordinary Hugging Face tokenizer.

One token per character of printable ASCII (0x20-0x7E) plus newline and tab, and five special
tokens. The backend is a `tokenizers` WordLevel model over single characters (the pre-tokenizer
splits text into one piece per character, the `Fuse` decoder joins pieces without separators), so
`encode -> decode` is exact for any text over that alphabet. Wrapped as
`transformers.PreTrainedTokenizerFast` and written with `save_pretrained`, the directory loads with
`AutoTokenizer.from_pretrained(dir)` and in vLLM like any other checkpoint's tokenizer.

Turn format follows Qwen2's ChatML convention: `<|im_start|>{role}\\n{content}<|im_end|>\\n`;
`<|im_end|>` is the tokenizer's eos token (generation of an assistant turn stops there),
`<|eos|>` ends a plain document.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|eos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"

# Order fixes the ids: specials first (0..4), then the characters.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)
CHARACTERS: tuple[str, ...] = ("\n", "\t", *(chr(c) for c in range(0x20, 0x7F)))
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
VOCAB_SIZE: int = len(VOCAB)  # 102

# ChatML, as Qwen2 instruct models use it; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

assert VOCAB_SIZE <= 128, "the tiny model's embedding table is sized for at most 128 ids"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer in memory (deterministic: the vocabulary is fixed).

    Returns:
        A `PreTrainedTokenizerFast` with `len(tok) == VOCAB_SIZE` (102), pad `<|pad|>` (id 0),
        eos `<|im_end|>` (id 3), unk `<|unk|>` (id 4), the ChatML chat template, no BOS/EOS added
        on encode, and `clean_up_tokenization_spaces=False` so decoding never rewrites spaces.
    """
    backend = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK_TOKEN))
    # One piece per character, newline included ([\s\S] rather than '.' which skips '\n').
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # Registered as added special tokens so "<|im_start|>" in a prompt is one id, not 12 chars.
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=None,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="right",
    )
    tok.chat_template = CHAT_TEMPLATE
    if len(tok) != VOCAB_SIZE:
        raise RuntimeError(f"character tokenizer has {len(tok)} ids, expected {VOCAB_SIZE}")
    return tok


def save_char_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Build the character tokenizer and write it to `out_dir` with `save_pretrained`.

    Writes `tokenizer.json`, `tokenizer_config.json` (with the chat template) and friends; the
    directory is created if missing. Returns the in-memory tokenizer.
    """
    tok = build_char_tokenizer()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return tok
