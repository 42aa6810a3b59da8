"""vLLM (CPU build here) loads the project's tiny checkpoint and agrees with transformers.

Tolerance: vLLM's prompt logprobs of a fixed token sequence match `token_logprobs` computed by
transformers on the same float32 weights to within 1e-4 nats absolute per token (different
attention / matmul kernels; the measured gap on the dev machine was 4.8e-7).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from rollart.models.tiny import build_tiny_model  # noqa: E402
from rollart.models.tokenizer import IM_END_TOKEN, VOCAB, char_id  # noqa: E402
from rollart.trainer.step import token_logprobs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir):
    from vllm import LLM

    engine = LLM(
        model=str(model_dir),
        dtype="float32",
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=512,
        seed=0,
        enforce_eager=True,
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine


def test_vllm_generates_from_chat_prompt(llm, model_dir):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Guess a number."}], tokenize=False, add_generation_prompt=True
    )
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))
    completion = out[0].outputs[0]
    assert 1 <= len(completion.token_ids) <= 6
    assert all(0 <= t < len(VOCAB) for t in completion.token_ids)
    assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
    assert all(
        lp[t].logprob <= 0.0
        for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)
    )


def test_vllm_prompt_logprobs_match_transformers(llm, model_dir):
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = [VOCAB["<|im_start|>"], *[char_id(c) for c in "user\n12 + 30 = 42"], VOCAB[IM_END_TOKEN]]
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    plp = out[0].prompt_logprobs
    assert plp[0] is None
    vllm_lp = torch.tensor([0.0] + [plp[t][ids[t]].logprob for t in range(1, len(ids))])

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        hf_lp = token_logprobs(model, x, torch.ones_like(x))[0]
    gap = (vllm_lp - hf_lp).abs().max().item()
    assert gap <= LOGPROB_ATOL, f"max |vLLM - transformers| logprob gap {gap} > {LOGPROB_ATOL}"
