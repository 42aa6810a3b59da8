"""Tool-call parsing of generated ids with vLLM's own tool parsers, in the inference worker.

Why here and not in the controller: vLLM's parsers (``vllm.tool_parsers``) import vLLM, which
imports torch (measured: ~40 s and 4,500 modules on this machine), and the controller stays
free of torch; the worker has vLLM and the engine's tokenizer loaded anyway. Only requests that
name a parser (``Generate.tool_parser``) pay for the decode.

The text given to the parser is the generated ids decoded *with* special tokens (vLLM's
``adjust_request`` turns ``skip_special_tokens`` off for tool calls too, because some models mark
``<tool_call>`` special), less a final end-of-turn token (the engine's stop token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollart.transport import messages as m
from rollart.transport.errors import RemoteError


def parse_tool_calls(
    parser_name: str, tokenizer: Any, token_ids: Sequence[int]
) -> tuple[str | None, list[m.ToolCall]]:
    """Decode ``token_ids`` with ``tokenizer`` and run vLLM's tool parser ``parser_name`` on the
    text.

    Returns:
        ``(content, tool_calls)``: the text outside tool calls (``None`` when empty) and the calls
        in order (empty when the text holds none or the parser could not read them: vLLM's
        parsers then return the whole text as content).

    Raises:
        RemoteError: ``bad_request`` for a parser name vLLM does not know.
    """
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_cls = ToolParserManager.get_tool_parser(parser_name)
    except KeyError:
        raise RemoteError(
            "bad_request",
            f"unknown tool parser {parser_name!r}; vLLM has {ToolParserManager.list_registered()}",
        ) from None
    ids = list(token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if ids and eos is not None and ids[-1] == eos:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    # A fresh parser per call: parsers keep streaming state between calls on an instance.
    parser = parser_cls(tokenizer)
    # pyright reads ``seed = Field(None, ...)`` (default given positionally) as required; it is
    # optional at run time.
    request = ChatCompletionRequest(model="", messages=[])  # pyright: ignore[reportCallIssue]
    info = parser.extract_tool_calls(text, request)
    calls = [m.ToolCall(name=c.function.name, arguments=c.function.arguments)
             for c in info.tool_calls] if info.tools_called else []
    content = info.content if info.content else None
    return content, calls
