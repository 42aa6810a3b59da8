"""Validation of an OpenAI ``chat.completions`` request body against what the trainer can
reproduce.

The trainer recomputes logprobs under ``logits / temperature`` of the full distribution
(``rollart.config.SamplingConfig``), so a request may only sample the way the domain's config
does: ``temperature`` absent or equal to ``domain.sampling.temperature``; ``top_p`` 1, ``top_k``
-1 (or 0), ``min_p`` 0, ``frequency_penalty`` / ``presence_penalty`` 0, ``repetition_penalty``
1, no ``logit_bias``, no ``stop`` strings (they would cut the generated ids at a text position),
no ``logprobs`` / ``top_logprobs``, ``response_format`` ``text`` only, ``tool_choice``
``"auto"`` / ``"none"`` (forcing a call needs guided decoding, which the trainer does not see).
``stream=true`` is refused (no streaming), ``n`` must be 1. Any other unknown parameter is
refused too: silently ignoring one would train on something the agent did not ask for.
Ignored (no effect on sampling): ``model`` (one policy is served), ``user``, ``metadata``,
``store``, ``parallel_tool_calls``, ``seed``, ``stream_options`` (with ``stream`` false).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollart.controller.agents.capture import BadMessages, normalize_messages

_IGNORED = frozenset({"model", "user", "metadata", "store", "parallel_tool_calls", "seed",
                      "stream_options"})
#: parameter -> the values that leave the sampling distribution unchanged
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1, 1.0),
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "stop": ([],),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "n": (1,),
    "stream": (False,),
}
_HANDLED = frozenset({"messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
                      "temperature", "response_format"})


class BadParam(ValueError):
    """An OpenAI ``invalid_request_error``: ``param`` names the field, ``code`` is a short
    machine-readable reason."""

    def __init__(self, param: str | None, detail: str, code: str = "invalid_parameter") -> None:
        super().__init__(detail)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated request: normalised ``messages``, ``tools`` (``None``: none), ``max_tokens``
    (``None``: the run's per-turn limit) and whether tool calls are parsed."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    parse_tools: bool


def parse_request(body: Any, temperature: float) -> ChatRequest:
    """Validate ``body`` (the decoded JSON) for a domain sampling at ``temperature``.

    Raises:
        BadParam: the first parameter the trainer cannot reproduce, or a malformed one.
    """
    if not isinstance(body, dict):
        raise BadParam(None, "the request body must be a JSON object")
    for name, value in body.items():
        if name in _IGNORED or name in _HANDLED or value is None:
            continue
        if name not in _NEUTRAL:
            raise BadParam(name, f"parameter {name!r} is not supported by rollart's endpoint",
                           "unsupported_parameter")
        if value not in _NEUTRAL[name] or isinstance(value, bool) != isinstance(
                _NEUTRAL[name][0], bool):
            why = {"stream": "streaming is not supported; send stream=false",
                   "n": "one choice per request (n=1): each completion extends one trajectory"}
            raise BadParam(name, why.get(name, (
                f"{name}={value!r} changes the sampling distribution, which the trainer cannot "
                f"reproduce; allowed: {list(_NEUTRAL[name])} (see rollart's SamplingConfig)")),
                "unsupported_value")
    temp = body.get("temperature")
    if temp is not None and (not isinstance(temp, (int, float)) or isinstance(temp, bool)
                             or not math.isclose(temp, temperature, abs_tol=1e-9)):
        raise BadParam("temperature", f"temperature={temp!r}: this domain samples at "
                       f"temperature {temperature:g} (the trainer recomputes logprobs under it)",
                       "unsupported_value")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadParam("response_format", "only response_format {'type': 'text'} is supported",
                       "unsupported_value")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadParam("tool_choice", f"tool_choice {choice!r}: only 'auto' and 'none' (forcing "
                       "a call needs guided decoding, which the trainer cannot reproduce)",
                       "unsupported_value")
    # an explicit null max_completion_tokens must not hide max_tokens (a per-turn limit)
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise BadParam("max_tokens", f"max_tokens must be a positive integer, not {max_tokens!r}")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools
        ):
            raise BadParam("tools", "tools must be a list of {'type': 'function', 'function': "
                           "{'name': ..., 'parameters': ...}}")
        tools = tools or None
    try:
        messages = normalize_messages(body.get("messages"))
    except BadMessages as exc:
        raise BadParam(exc.param, str(exc)) from None
    return ChatRequest(messages=messages, tools=tools, max_tokens=max_tokens,
                       parse_tools=tools is not None and choice != "none")
