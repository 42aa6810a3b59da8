"""Every number of the benchmarks' simulated domains names a public source or says it is
assumed, beside it, and the domains use those very numbers."""

from __future__ import annotations

import ast
import inspect

import pytest
from benchmarks import workloads

from rollart.sim import calibration

PREFIXES = ("REASONING_", "AGENTIC_")


def _comment_above(source: str, lineno: int) -> str:
    """The ``#`` comment block directly above line ``lineno`` (1-based)."""
    lines = source.splitlines()[:lineno - 1]
    block: list[str] = []
    for line in reversed(lines):
        if not line.lstrip().startswith("#"):
            break
        block.append(line)
    return "\n".join(reversed(block))


def _constants(module) -> list[tuple[str, str]]:
    """(name, comment above it) of every module-level UPPERCASE assignment."""
    source = inspect.getsource(module)
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names = ([target] if isinstance(target, ast.Name)
                         else list(getattr(target, "elts", [])))
                out += [(n.id, _comment_above(source, node.lineno)) for n in names
                        if isinstance(n, ast.Name) and n.id.isupper()]
    return out


def test_every_domain_number_names_a_source_or_says_assumed() -> None:
    found = [(n, c) for n, c in _constants(workloads) if n.startswith(PREFIXES)]
    assert len(found) >= 9
    for name, comment in found:
        assert "http" in comment or "ASSUMED" in comment or "arXiv" in comment, name


def test_domains_use_the_cited_numbers() -> None:
    r, a = workloads.reasoning(), workloads.agentic()
    assert r.prompt_tokens.mean == workloads.REASONING_PROMPT_TOKENS
    assert (r.response_tokens.mean, r.response_tokens.std) == (
        workloads.REASONING_MEAN_TOKENS, workloads.REASONING_STD_TOKENS)
    assert a.prompt_tokens.mean == workloads.AGENTIC_PROMPT_TOKENS
    assert a.obs_tokens.mean == workloads.AGENTIC_OBS_TOKENS
    assert (a.response_tokens.mean, a.response_tokens.std) == (
        workloads.AGENTIC_RESPONSE_MEAN, workloads.AGENTIC_RESPONSE_STD)
    assert a.num_turns.mean == workloads.AGENTIC_TURNS
    assert a.step_latency_s.mean == workloads.AGENTIC_STEP_LATENCY_S
    assert a.reset_latency_s.mean == workloads.AGENTIC_RESET_LATENCY_S


@pytest.mark.parametrize("name", ["NIM_LLAMA33_70B_TP2_5000_500", "QWEN_DOCS_H20_SGLANG_BS1",
                                  "LLAMA33_70B_FP8", "H100_FP8"])
def test_serving_references_name_their_page(name: str) -> None:
    comments = dict(_constants(calibration))
    assert "http" in comments[name] or "datasheet" in comments[name], name
