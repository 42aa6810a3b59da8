"""Exact token bookkeeping of a multi-turn conversation (chat-template deltas).

The training sequence of a trajectory is built incrementally and never re-tokenised:

- the first prompt is the chat template of the opening messages with the generation prompt,
  tokenised once;
- each assistant turn appends the very token ids the engine produced (loss mask 1, with their
  behaviour logprobs and versions);
- each new observation appends the tokens of *only the new text* the chat template adds after
  that assistant turn: the rest of the assistant turn's closing (e.g. ``"\\n"`` after
  ``<|im_end|>``), the new user message and the next generation prompt (loss mask 0).

Why not re-tokenise the whole conversation: decoding the generated ids and encoding the text again
can give different ids (merges across the boundary, normalisation, a reasoning block the template
drops from history), so the trainer would score tokens the engine never sampled.

The delta is found by rendering a probe conversation ``[user "x", assistant SENTINEL, user obs]``
with the generation prompt and taking the text after the first end-of-turn (eos) token that
follows the sentinel. Rendering with a fixed probe history keeps the delta independent of
templates that rewrite earlier turns (Qwen3 strips ``<think>`` blocks from history).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from rollart.controller.ports import Tokenizer
from rollart.transport import tokenbytes as tb

_SENTINEL = "<<rollart-assistant-turn>>"


class ChatTokens:
    """Chat-template rendering and delta tokenisation for one tokenizer.

    Args:
        tokenizer: a Hugging Face-style tokenizer with a chat template and an ``eos_token`` that
            ends an assistant turn (``<|im_end|>`` for ChatML / Qwen).
        template_kwargs: extra keyword arguments for ``apply_chat_template`` (for example
            ``{"enable_thinking": False}`` for Qwen3).

    Raises:
        ValueError: the tokenizer has no eos token, or its template does not end an assistant
            turn with it.
    """

    def __init__(self, tokenizer: Tokenizer, template_kwargs: Mapping[str, Any] | None = None):
        if not tokenizer.eos_token or tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos token; cannot delimit assistant turns")
        self.tokenizer = tokenizer
        self.eos_token: str = tokenizer.eos_token
        self.eos_token_id: int = tokenizer.eos_token_id
        self.template_kwargs = dict(template_kwargs or {})
        fast = getattr(tokenizer, "encode_i32", None)
        # Duck-typed: a tokenizer's optional ``encode_i32(text) -> bytes`` (SimTokenizer).
        self._encode_i32 = cast("Callable[[str], bytes]", fast) if callable(fast) else None
        self.observation_text("probe")  # fail at construction, not in the first trajectory

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added (those in the text are kept)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids if type(ids) is list else list(ids)  # a long prompt's copy costs

    def encode_i32(self, text: str) -> bytes:
        """Token ids of ``text`` (as :meth:`encode`) as little-endian int32 bytes: what the
        trajectory's arrays and the wire hold. A tokenizer with an ``encode_i32(text)`` method
        (``SimTokenizer``) answers in bytes directly; otherwise ``encode``'s list (or integer
        ndarray) is packed without a Python-list round trip. Raises OverflowError for an id
        outside int32."""
        if self._encode_i32 is not None:
            return self._encode_i32(text)
        return tb.pack_i32(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the opening ``messages`` plus the assistant generation prompt."""
        return self.encode(self._render(messages, add_generation_prompt=True))

    def prompt_i32(self, messages: list[dict[str, str]]) -> bytes:
        """:meth:`prompt_ids` as int32 bytes (see :meth:`encode_i32`)."""
        return self.encode_i32(self._render(messages, add_generation_prompt=True))

    def observation_text(self, content: str, *, turn_closed: bool = True) -> str:
        """Template text that follows an assistant turn when user message ``content`` arrives.

        ``turn_closed``: the generated ids already end with the eos token (the engine stopped on
        it); otherwise the eos token is prepended so the assistant turn is closed in the
        training sequence exactly as the template would close it.
        """
        probe = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": _SENTINEL},
            {"role": "user", "content": content},
        ]
        text = self._render(probe, add_generation_prompt=True)
        start = text.find(_SENTINEL)
        end = text.find(self.eos_token, start + len(_SENTINEL)) if start >= 0 else -1
        if end < 0:
            raise ValueError(
                f"chat template does not close an assistant turn with eos {self.eos_token!r}"
            )
        tail = text[end + len(self.eos_token) :]
        return tail if turn_closed else self.eos_token + tail

    def observation_ids(self, content: str, generated: Sequence[int]) -> list[int]:
        """Token ids to append after the assistant turn ``generated`` for user message
        ``content`` (the turn is closed iff ``generated`` ends with the eos id)."""
        closed = bool(generated) and generated[-1] == self.eos_token_id
        return self.encode(self.observation_text(content, turn_closed=closed))

    def observation_i32(self, content: str, generated: Sequence[int]) -> bytes:
        """:meth:`observation_ids` as int32 bytes (see :meth:`encode_i32`)."""
        closed = bool(generated) and generated[-1] == self.eos_token_id
        return self.encode_i32(self.observation_text(content, turn_closed=closed))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The action text of generated ids (special tokens such as eos removed)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
