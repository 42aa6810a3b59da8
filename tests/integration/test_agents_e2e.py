"""Agents written against the OpenAI API train token-exact (issue 15), on real services and the
tiny model, with the real ``openai`` client:

- the README's example (``examples/agent_calculator.py``: a multi-turn agent with a calculator
  tool on reasoning-gym arithmetic) trains two steps; its first request of each trajectory is a
  bad one (``top_p``), refused with a 400 naming the parameter, the trajectory going on;
- each trained sequence is the chat template applied to the whole conversation (tools, tool
  results, follow-ups, generation prompts) with the assistant turns being the generated ids
  verbatim, the documented difference (``rollart.controller.agents.capture``);
- the behaviour logprobs agree with the trainer's recompute, also after an update (``sync_plus``
  with alpha 0: step 2 trains version-1 tokens under version-1 weights);
- vLLM's ``hermes`` tool parser, as the worker runs it, reads the tiny template's tool calls.

Tolerance: float32 on both sides, as the weight-sync tests (1e-3 nats per token).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import openai
import pytest

from rollart.models.tokenizer import build_char_tokenizer

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = Path(__file__).parent / "scenarios" / "agent_run.toml"
TOL = 1e-3
TOK = build_char_tokenizer()


def load_example():
    spec = importlib.util.spec_from_file_location("agent_calculator",
                                                  ROOT / "examples" / "agent_calculator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_ids(sample) -> list[int]:
    """The chat template of the sample's conversation with each assistant turn replaced by the
    ids generated for it (the template's own end-of-turn token after a turn the engine closed
    is the generated one), less the template's final "\\n"."""
    ids, mask = sample.token_ids.tolist(), sample.loss_mask.tolist()
    spans, cur = [], None
    for t, k in zip(ids, mask, strict=True):
        if k and cur is None:
            cur = []
            spans.append(cur)
        if k:
            cur.append(t)
        elif cur is not None:
            cur = None
    marked, k = [], 0
    for msg in sample.metadata["messages"]:
        if msg["role"] == "assistant":
            marked.append({"role": "assistant", "content": f"@@{k}@@"})
            k += 1
        else:
            marked.append(msg)
    assert k == len(spans) == sample.num_turns
    text = TOK.apply_chat_template(marked, tools=sample.metadata["tools"], tokenize=False)
    pieces = re.split(r"@@(\d+)@@", text)
    out: list[int] = []
    closed = False
    for i, piece in enumerate(pieces):
        if i % 2:
            span = spans[int(piece)]
            out += span
            closed = span[-1] == TOK.eos_token_id
            continue
        if closed and piece.startswith(TOK.eos_token):
            piece = piece[len(TOK.eos_token):]
        out += TOK.encode(piece, add_special_tokens=False)
    # The sequence ends with the last generated token: the template's "\n" (and, after a turn
    # cut by length, its end-of-turn token) are not part of it.
    end = "\n" if closed else TOK.eos_token + "\n"
    tail = 1 if closed else 2
    assert TOK.decode(out[-tail:], skip_special_tokens=False) == end
    return out[:-tail]


async def test_the_calculator_agent_trains_token_exact_and_agrees_after_an_update(tmp_path):
    example = load_example()
    refused = []

    async def solve(client: openai.AsyncOpenAI, task: dict) -> float | None:
        try:
            await client.chat.completions.create(
                model="rollart-policy", messages=[{"role": "user", "content": "x"}], top_p=0.5)
        except openai.BadRequestError as exc:
            refused.append((exc.status_code, exc.code, exc.param))
        return await example_solve(client, task)

    example_solve, example.solve = example.solve, solve
    steps = await example.main(str(SCENARIO), run_dir=str(tmp_path / "run"), steps=2)
    assert [s.step for s in steps] == [1, 2]
    assert refused and set(refused) == {(400, "unsupported_value", "top_p")}
    samples = [s for step in steps for s in step.samples]
    assert len(samples) == 8
    assert any(s.num_turns >= 2 for s in samples)  # multi-turn: the check-it follow-up
    for s in samples:
        assert s.metadata["agent"] and s.metadata["tools"] == [example.CALCULATOR]
        assert s.token_ids.tolist() == expected_ids(s)
        lps = [lp for lp, k in zip(s.behaviour_logprobs.tolist(), s.loss_mask.tolist(),
                                   strict=True) if k]
        assert all(lp <= 0.0 for lp in lps) and len(lps) == s.num_generated
    # Step 2's tokens come from the updated weights, and the trainer agrees with them.
    assert {v for s in steps[1].samples for v, k in zip(s.versions.tolist(),
                                                        s.loss_mask.tolist(), strict=True)
            if k} == {1}
    for step in steps:
        mismatch = step.metrics.logprob_mismatch_by_worker
        assert mismatch and max(mismatch.values()) < TOL, mismatch


def test_vllms_hermes_parser_reads_the_tiny_templates_tool_calls() -> None:
    from rollart.inference.toolcalls import parse_tool_calls
    from rollart.transport.errors import RemoteError

    rendered = TOK.apply_chat_template(
        [{"role": "assistant", "content": "Let me compute. ", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]}],
        tokenize=False)
    text = rendered.split("assistant\n", 1)[1].rsplit("\n", 1)[0]  # the turn, with its eos
    content, calls = parse_tool_calls("hermes", TOK, TOK.encode(text, add_special_tokens=False))
    assert content == "Let me compute. "
    assert [(c.name, c.arguments) for c in calls] == [("calculator", '{"expression": "2*3"}')]
    plain = TOK.encode("42", add_special_tokens=False) + [TOK.eos_token_id]
    assert parse_tool_calls("hermes", TOK, plain) == ("42", [])
    with pytest.raises(RemoteError, match="unknown tool parser"):
        parse_tool_calls("no-such-parser", TOK, plain)
