"""Token-exact capture of one agent conversation (OpenAI chat messages) as a training sequence.

The sequence is built the way the gym path builds it (``rollart.controller.rollout.tokens``), never by
re-tokenising the conversation at the end:

- the first request's messages (and ``tools``) are rendered with the model's chat template and
  the generation prompt, and tokenised once;
- each completion appends the engine's generated ids verbatim (loss mask 1, behaviour logprobs,
  per-token versions);
- each later request must *extend* the conversation: its messages start with the previous
  request's messages followed by the assistant message rollart returned (compared as messages:
  role, text content, tool-call names and parsed arguments, tool-call ids and names of tool
  results), with the same ``tools``. Only the delta is tokenised: the template text after the
  returned assistant turn's end-of-turn token (e.g. ``"\\n"`` closing it, the tool results, the
  next user message, the generation prompt), found by rendering the longer conversation and the
  shorter one (ending with that assistant turn, no generation prompt) and checking the first is
  an extension of the second. If the engine stopped without the end-of-turn token (``length``),
  it is inserted first, as the template would close the turn.

History-rewrite policy (documented in docs/agents.md): a request that does not extend the
conversation (the agent edited, dropped or reordered earlier messages, changed ``tools``, or the
template renders earlier turns differently once later ones follow) raises
:class:`HistoryRewritten`; the trajectory then *fails* with reason ``history_rewritten`` (counted,
retried, never scored 0), and the agent's call gets a 400 error with that code. No silently wrong
sequence is trained, and no conversation is split into samples the reward never scored.

Where the trained sequence differs from ``apply_chat_template(full conversation)``: the assistant
turns are the generated ids, so a turn whose text the template would render differently (tool-call
JSON spacing, a reasoning block the template drops) or whose ids do not round-trip through
decode/encode stays as generated; and the sequence ends with the last generated token (the
template's ``"\\n"`` after the final end-of-turn token is not part of it).
"""

from __future__ import annotations

import array
import json
from collections.abc import Sequence
from typing import Any

from rollart.controller.rollout.tokens import ChatTokens

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadMessages(ValueError):
    """The request's messages or tools are malformed (``param`` names the field)."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(detail)
        self.param = param


class TemplateRefused(ValueError):
    """The model's chat template raised on the request's messages (e.g. roles that do not
    alternate); nothing was captured."""


class HistoryRewritten(Exception):
    """The request does not extend the conversation captured so far (see the module docstring)."""


def _text(content: Any, where: str) -> str:
    """OpenAI message content (a string, ``None`` or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadMessages(f"{where}.content[{i}]",
                                  f"content part of type {kind!r} is not supported (text only)")
            parts.append(part["text"])
        return "".join(parts)
    raise BadMessages(f"{where}.content", f"content must be a string or a list of text parts, "
                      f"not {type(content).__name__}")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise BadMessages(f"{where}.tool_calls", "tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
            fn.get("arguments"), str
        ):
            raise BadMessages(f"{where}.tool_calls[{i}]",
                              "a tool call needs function.name and function.arguments strings")
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` as plain dicts the chat template renders: ``role``,
    ``content`` (a string), and ``tool_calls`` (assistant) / ``tool_call_id`` (tool) / ``name``
    where given. Raises :class:`BadMessages` naming the first bad field."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages("messages", "messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadMessages(where, "a message must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise BadMessages(f"{where}.role", f"role {role!r} is not one of {list(ROLES)}")
        norm: dict[str, Any] = {"role": role, "content": _text(msg.get("content"), where)}
        if role == "assistant" and msg.get("tool_calls"):
            norm["tool_calls"] = _tool_calls(msg["tool_calls"], where)
        if role == "tool" and msg.get("tool_call_id") is not None:
            norm["tool_call_id"] = str(msg["tool_call_id"])
        if isinstance(msg.get("name"), str):
            norm["name"] = msg["name"]
        out.append(norm)
    return out


def _key(msg: dict[str, Any]) -> tuple:
    """What must not change in an earlier message (arguments compared as parsed JSON, so an
    agent re-serialising them with other spacing still extends the conversation)."""
    calls = []
    for c in msg.get("tool_calls", []):
        try:
            args: Any = json.loads(c["function"]["arguments"])
        except ValueError:
            args = c["function"]["arguments"]
        calls.append((c["id"], c["function"]["name"], json.dumps(args, sort_keys=True)))
    return (msg["role"], msg["content"], tuple(calls), msg.get("tool_call_id"), msg.get("name"))


class Conversation:
    """The training sequence of one agent trajectory, grown request by request.

    ``token_ids`` / ``loss_mask`` are ``array.array`` of typecodes ``i`` / ``b`` (int32 ids,
    0/1 mask), one item per token; ``logprobs`` / ``versions`` are ``array.array`` ``f`` / ``i``
    (float32 behaviour logprobs, int32 policy versions) of the generated tokens only, in order,
    as ``rollart.controller.buffer.sample.Sample`` keeps them.
    """

    def __init__(self, chat: ChatTokens) -> None:
        self.chat = chat
        self.token_ids = array.array("i")
        self.loss_mask = array.array("b")
        self.logprobs = array.array("f")
        self.versions = array.array("i")
        self.num_prompt_tokens = 0
        self.num_generated = 0
        self.num_turns = 0
        #: the messages of the last request plus the assistant message returned for it
        self.messages: list[dict[str, Any]] = []
        self.tools: list[Any] | None = None
        self._turn_closed = True

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None,
                gen: bool) -> str:
        kwargs = dict(self.chat.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.chat.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, **kwargs)
        except Exception as exc:  # jinja raises from inside user-facing templates
            raise TemplateRefused(f"the model's chat template refused these messages: "
                                  f"{type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def delta(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        """Token ids to append before generating for a request with normalised ``messages``
        and ``tools`` (the whole prompt for the first request). Changes nothing.

        Raises:
            HistoryRewritten: the request does not extend the conversation.
        """
        if not self.num_turns:
            return self.chat.encode(self._render(messages, tools, gen=True))
        prev = self.messages
        if (tools or None) != (self.tools or None):
            raise HistoryRewritten("the request's tools differ from the earlier requests'")
        if len(messages) <= len(prev):
            raise HistoryRewritten(
                f"the request has {len(messages)} messages; extending the conversation needs "
                f"more than the {len(prev)} so far (earlier messages + the returned reply)")
        for i, (old, new) in enumerate(zip(prev, messages, strict=False)):
            if _key(old) != _key(new):
                what = "the assistant reply rollart returned" if i == len(prev) - 1 else \
                    "the earlier request's"
                raise HistoryRewritten(f"messages[{i}] ({new['role']}) differs from {what}")
        shorter = self._render(prev, tools, gen=False)
        # Earlier messages as rollart holds them (equal by key to the agent's copies, which may
        # differ in ways the template would show, e.g. the spacing of tool-call arguments).
        longer = self._render([*prev, *messages[len(prev):]], tools, gen=True)
        if not longer.startswith(shorter):
            raise HistoryRewritten("the chat template renders the earlier turns differently "
                                   "once later messages follow")
        eos = self.chat.eos_token
        end = shorter.rfind(eos)
        if end < 0:
            raise HistoryRewritten(f"the chat template does not close the assistant turn with "
                                   f"{eos!r}")
        text = shorter[end + len(eos):] + longer[len(shorter):]
        return self.chat.encode(text if self._turn_closed else eos + text)

    def append_prompt(self, ids: Sequence[int]) -> None:
        """Append non-generated tokens (loss mask 0; no logprob or version)."""
        k = len(ids)
        self.token_ids.extend(ids)
        self.loss_mask.frombytes(bytes(k))
        if not self.num_turns:
            self.num_prompt_tokens = len(self.token_ids)

    def append_generated(self, messages: list[dict[str, Any]], tools: list[Any] | None,
                         token_ids: array.array, logprobs: bytes, versions: array.array,
                         reply: dict[str, Any]) -> None:
        """Append one completion: the engine's ids verbatim (``token_ids`` int32, ``logprobs``
        float32 little-endian bytes, ``versions`` int32, equal lengths) and remember the
        request's normalised ``messages`` + the returned assistant message ``reply``."""
        n = len(token_ids)
        self.token_ids.extend(token_ids)
        self.loss_mask.frombytes(b"\x01" * n)
        self.logprobs.frombytes(logprobs)
        self.versions.extend(versions)
        self.num_generated += n
        self.num_turns += 1
        self._turn_closed = bool(n) and token_ids[-1] == self.chat.eos_token_id
        self.messages = [*messages, reply]
        self.tools = tools
