"""Tool-call demonstrations for the tiny policy's warm-up: the calculator agent's conversation.

With ``model.tiny_warmup_tool_calls`` a scenario's ``rg:basic_arithmetic`` domains are warmed
up on the conversation the example agent (``examples/agent_calculator.py``) has with the model
(``system`` = `SYSTEM_PROMPT`, ``tools`` = [`CALCULATOR`]), instead of the gym loop's single
``\\boxed{}`` turn:

1. prompt: the chat template of ``[system, user(prompt_template.format(observation=...))]``
   with the tools and the generation prompt; completion: the hermes-format tool call
   ``<tool_call>{"name": "calculator", "arguments": {"expression": "<the task's expression>"}}
   </tool_call>`` (no text before it);
2. prompt: the conversation extended by that assistant turn (rendered by the template from the
   parsed call, which gives back exactly the completion's text: ``json.dumps`` of the arguments
   is what vLLM's hermes parser returns) and a ``tool`` message holding the result; completion:
   the solver's ``\\boxed{answer}``.

Every prompt is rendered with the same chat template the controller renders an agent's requests
with (``rollart.controller.agents.capture``), so the token sequence the model learns is the one
it sees at rollout (the second prompt's assistant turn is the first completion + ``<|im_end|>``,
as the engine generates it).
"""

from __future__ import annotations

import json
from typing import Any

from rollart.config import DomainConfig
from rollart.envhost.families import make_env
from rollart.envhost.solvers import next_action

#: the env whose tasks come with an arithmetic expression (``info.entry.metadata.expression``)
CALCULATOR_ENV = "rg:basic_arithmetic"
#: the example agent's system message: it shows a call for the model to copy (as the tiny model
#: copies ``\\boxed{}`` from the task's instructions; see warmup.TOOL_CALL_RECIPE)
SYSTEM_PROMPT = ('Call <tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}'
                 '</tool_call> with the expression, then answer.')
#: the example agent's one tool, in OpenAI's ``tools`` format
CALCULATOR: dict[str, Any] = {"type": "function", "function": {
    "name": "calculator",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def tool_call_text(expression: str) -> str:
    """The hermes-format text of one calculator call, as the tiny chat template renders it."""
    args = json.dumps({"expression": expression})
    return f'<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>'


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    return tokenizer.apply_chat_template(messages, tools=[CALCULATOR], tokenize=False,
                                         add_generation_prompt=True)


def play_tool_episode(domain: DomainConfig, seed: int, tokenizer: Any) -> list[tuple[str, str]]:
    """The two (prompt, completion) pairs of one calculator conversation on `domain`'s task of
    env `seed` (see the module docstring); the tool result is the task's reference answer.

    Raises:
        ValueError: `domain.env` is not ``rg:basic_arithmetic``.
        rollart.envhost.families.EnvSpecError: bad ``env_options``.
    """
    if domain.env != CALCULATOR_ENV:
        raise ValueError(f"domain {domain.name!r}: tool-call demonstrations need env "
                         f"{CALCULATOR_ENV!r}, not {domain.env!r}")
    env = make_env(domain.env, domain.env_options)
    try:
        obs, info = env.reset(seed)
    finally:
        env.close()
    expression = str(info["entry"]["metadata"]["expression"])
    call = tool_call_text(expression)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": domain.prompt_template.format(observation=obs)}]
    first = _render(tokenizer, messages)
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(info["reference"])}]
    second = _render(tokenizer, messages)
    return [(first, call), (second, next_action(domain.env, [obs], [], info))]
