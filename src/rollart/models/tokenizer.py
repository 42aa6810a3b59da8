"""The project's byte-level tokenizer, saved as an ordinary Hugging Face tokenizer.

One token per byte (256 ids, GPT-2's byte-to-unicode symbols, so every UTF-8 text round-trips
exactly) plus five special tokens, and no merges: characters of ASCII text are single tokens,
which keeps the tiny model's job small. The backend is exactly the pipeline that transformers'
``Qwen2Tokenizer`` builds (NFC normaliser, Qwen2's split regex, ByteLevel pre-tokenizer and
decoder, BPE model) because ``AutoTokenizer`` loads any ``qwen2`` checkpoint's tokenizer with
that class whatever ``tokenizer_config.json`` says; vLLM does the same. A character-level
WordLevel tokenizer loaded that way silently lost every space and newline.

Turn format follows Qwen2's ChatML convention: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``;
``<|im_end|>`` is the tokenizer's eos token (generation of an assistant turn stops there),
``<|eos|>`` ends a plain document.

With ``tool_call_tokens`` (the tool-call warm-up's models) the tokenizer also has
``<tool_call>`` and ``</tool_call>`` as single (added, not special) tokens, ids 261 and 262, as
Qwen2.5's tokenizer has them: spelled byte by byte, the closing tag after a variable-length
argument was where the tiny model's calls broke (``</tol_cal>``; warmup.TOOL_CALL_RECIPE).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|eos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-symbol table (Radford et al. 2019, encoder.py), the
    # alphabet of every ByteLevel pre-tokenizer: printable bytes map to themselves.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# Order fixes the ids: specials first (0..4), then the 256 byte symbols in byte order.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)
BYTE_SYMBOLS: tuple[str, ...] = tuple(_bytes_to_unicode()[b] for b in range(256))
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *BYTE_SYMBOLS))}
VOCAB_SIZE: int = len(VOCAB)  # 261
#: added after every byte, so a model with them keeps the ids of one without
TOOL_CALL_TOKENS: tuple[str, ...] = (TOOL_CALL_START, TOOL_CALL_END)
TOOL_CALL_VOCAB: dict[str, int] = {
    **VOCAB, **{tok: VOCAB_SIZE + i for i, tok in enumerate(TOOL_CALL_TOKENS)}}


def vocab_size(tool_call_tokens: bool = False) -> int:
    """Number of token ids: 261, or 263 with the tool-call tokens."""
    return len(TOOL_CALL_VOCAB) if tool_call_tokens else VOCAB_SIZE


def char_id(ch: str) -> int:
    """Token id of a single ASCII character (e.g. ``char_id(" ")``)."""
    (byte,) = ch.encode()
    return VOCAB[BYTE_SYMBOLS[byte]]


# ChatML, as Qwen2 instruct models use it; `add_generation_prompt` opens the assistant turn.
# With `tools=`, Qwen2.5's tool format (which vLLM's `hermes` tool parser reads): a system turn
# listing the tools as JSON, an assistant turn's calls as `<tool_call>{"name": ...,
# "arguments": {...}}</tool_call>`, and each `tool` message as a `tool` turn. Without tools the
# text is exactly the plain ChatML above (older checkpoints and tests render the same).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- 'Call a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\n"
    "<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for tc in message['tool_calls'] %}"
    "{%- set f = tc['function'] if tc.get('function') else tc %}"
    "{{- '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}"
    "{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

def build_char_tokenizer(tool_call_tokens: bool = False) -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer in memory (deterministic: the vocabulary is fixed).

    Args:
        tool_call_tokens: also ``<tool_call>`` (id 261) and ``</tool_call>`` (id 262), each one
            token wherever it appears in a text (added tokens, kept when decoding with
            ``skip_special_tokens``).

    Returns:
        A ``PreTrainedTokenizerFast`` with ``len(tok) == vocab_size(tool_call_tokens)``, pad
        ``<|pad|>`` (id 0), eos ``<|im_end|>`` (id 3), unk ``<|unk|>`` (id 4, never produced: every byte has an
        id), the ChatML chat template, no BOS/EOS added on encode, and
        ``clean_up_tokenization_spaces=False`` so decoding never rewrites spaces.
    """
    vocab = TOOL_CALL_VOCAB if tool_call_tokens else VOCAB
    backend = Tokenizer(models.BPE(vocab=dict(vocab), merges=[], dropout=None, unk_token=None,
                                   continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    # Registered as added special tokens so "<|im_start|>" in a prompt is one id, not 12 bytes.
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    if tool_call_tokens:
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t in TOOL_CALL_TOKENS])
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
    if len(tok) != len(vocab) or any(tok.convert_tokens_to_ids(t) != i
                                     for t, i in vocab.items() if len(t) > 1):
        raise RuntimeError(f"character tokenizer has {len(tok)} ids, expected {len(vocab)}")
    return tok


def save_char_tokenizer(out_dir: str | Path,
                        tool_call_tokens: bool = False) -> PreTrainedTokenizerFast:
    """Build the character tokenizer (`build_char_tokenizer`'s `tool_call_tokens`) and write it
    to `out_dir` with `save_pretrained`.

    Writes `tokenizer.json`, `tokenizer_config.json` (with the chat template) and friends; the
    directory is created if missing. Returns the in-memory tokenizer.
    """
    tok = build_char_tokenizer(tool_call_tokens)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return tok
