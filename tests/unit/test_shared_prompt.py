"""Shared-prompt forwards (`rollart.trainer.sharedprompt`): the full forward's logprobs, entropy,
loss and gradients, with each distinct prompt of a micro-batch run once."""

from __future__ import annotations

import copy

import pytest
import torch

from rollart.models.tiny import TinyModelSpec, init_tiny_model
from rollart.trainer.sharedprompt import prompt_groups, shared_prompt_logprobs_entropy
from rollart.trainer.step import (
    TrainSample,
    TrainStepConfig,
    accumulate_gradients,
    collate,
    pack_microbatches,
    token_logprobs,
    token_logprobs_entropy,
    train_step,
)

SPEC = TinyModelSpec(seed=5, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
# The two paths sum the same products in another order (a batch of one for the prompt, the
# prompt's keys and gradients repeated and summed per row): float32 rounding only. Measured
# here: |d logprob| <= 1e-6, relative gradient differences ~1e-6.
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture
def model():
    return init_tiny_model(SPEC)


def multi_turn_samples(model, n=8, *, seed=0):
    """Two prompts (of 30 and 31 tokens, the same first 10), each row 2..3 generated turns of
    3..6 tokens separated by observations of 4..8 tokens (loss mask 0), as a game's episodes;
    behaviour logprobs the model's own shifted by -0.3 / +0.1 so the IS weights vary."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(5, 102, (10,), generator=g).tolist()
    prompts = [head + torch.randint(5, 102, (20 + d,), generator=g).tolist() for d in (0, 1)]
    out = []
    for i in range(n):
        ids = list(prompts[i % 2])
        mask = [0] * len(ids)
        turns = 2 + int(torch.randint(0, 2, (1,), generator=g))
        for t in range(turns):
            k = 3 + int(torch.randint(0, 4, (1,), generator=g))
            ids += torch.randint(5, 102, (k,), generator=g).tolist()
            mask += [1] * k
            if t < turns - 1:
                o = 4 + int(torch.randint(0, 5, (1,), generator=g))
                ids += torch.randint(5, 102, (o,), generator=g).tolist()
                mask += [0] * o
        with torch.no_grad():
            x = torch.tensor([ids])
            lp = token_logprobs(model, x, torch.ones_like(x))[0].tolist()
        blp = [min(v + (-0.3, 0.1)[j % 2], 0.0) for j, (v, m) in enumerate(zip(lp, mask,
                                                                               strict=True)) if m]
        out.append(TrainSample.from_lists(
            token_ids=ids, loss_mask=mask, behaviour_logprobs=blp,
            advantage=(1.0, -0.5, 0.25, -1.0)[i % 4], sample_id=f"s{i}",
            domain=("a", "b")[i % 2]))
    return out


def test_rows_are_grouped_by_the_tokens_before_their_first_generated_one():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0],
                        [5, 6, 7, 3, 4, 4],
                        [5, 6, 9, 8, 9, 0],
                        [5, 6, 7, 8, 9, 9],   # row 0's prompt, its first loss token later
                        [5, 6, 7, 1, 0, 0]])
    attn = (torch.arange(6)[None, :] < torch.tensor([5, 6, 5, 6, 4])[:, None]).long()
    mask = torch.tensor([[0, 0, 0, 1, 1, 0],
                         [0, 0, 0, 1, 1, 1],
                         [0, 0, 0, 1, 1, 0],
                         [0, 0, 0, 0, 1, 1],
                         [0, 0, 0, 1, 0, 0]])
    # Prompt = tokens before f - 1 (f: first loss token): [5, 6] for rows 0, 1, 2, 4 (f = 3);
    # [5, 6, 7] for row 3 (f = 4), alone with it: a plain forward (prompt length 0).
    assert prompt_groups(ids, attn, mask) == [(2, [0, 1, 2, 4]), (0, [3])]
    assert prompt_groups(ids[[0, 2, 3]], attn[[0, 2, 3]], mask[[0, 2, 3]]) == [(2, [0, 1]),
                                                                              (0, [2])]
    assert prompt_groups(ids[[3, 1]], attn[[3, 1]], mask[[3, 1]]) == [(0, [0, 1])]


def test_logprobs_and_entropy_are_the_full_forwards_from_the_first_loss_token_on(model):
    # Two shared prompts and a row alone with its own (a plain forward).
    batch = collate(multi_turn_samples(model, n=7) + multi_turn_samples(model, n=1, seed=9))
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    assert [(p, len(rows)) for p, rows in prompt_groups(ids, attn, mask)] == [(29, 4), (30, 3),
                                                                              (0, 1)]
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    def run(fn):
        model.zero_grad(set_to_none=True)
        lp, ent = fn()
        (lp * weights * mask).sum().backward()
        return lp.detach(), ent, [p.grad.clone() for p in model.parameters()]

    full = run(lambda: token_logprobs_entropy(model, ids, attn, entropy_mask=mask))
    shared = run(lambda: shared_prompt_logprobs_entropy(model, ids, attn, mask))
    first = mask.int().argmax(dim=1)
    cols = torch.arange(ids.shape[1])[None, :]
    after = (cols >= first[:, None]) & attn.bool()
    torch.testing.assert_close(shared[0][after], full[0][after], rtol=RTOL, atol=ATOL)
    before = cols < first[:, None]
    assert not shared[0][:7][before[:7]].any()  # shared prompts: no logprob computed
    torch.testing.assert_close(shared[0][7], full[0][7], rtol=RTOL, atol=ATOL)  # plain forward
    assert not shared[0][~attn.bool()].any()
    assert shared[1] is not None and full[1] is not None
    torch.testing.assert_close(shared[1], full[1], rtol=RTOL, atol=ATOL)
    for a, b in zip(full[2], shared[2], strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert max(float(g.abs().max()) for g in shared[2]) > 1e-3  # a real gradient
    _, none = shared_prompt_logprobs_entropy(model, ids, attn, mask, entropy=False)
    assert none is None
    with pytest.raises(ValueError, match="loss_mask"):
        shared_prompt_logprobs_entropy(model, ids, attn, mask[:, :3])


class _TokenCounter:
    """Tokens the model is called on (its input_ids' elements), over every call."""

    def __init__(self, model):
        self.tokens = 0
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module, _args, kwargs):
        self.tokens += kwargs["input_ids"].numel()


def test_each_prompt_runs_once_per_micro_batch(model):
    samples = multi_turn_samples(model, n=8)
    cfg = TrainStepConfig(max_tokens_per_microbatch=4096)
    mbs = pack_microbatches(samples, cfg.max_tokens_per_microbatch)
    assert len(mbs) == 1
    batch = collate(mbs[0])
    lengths = batch["attention_mask"].sum(dim=1)
    # Per group: its prompt once, then every row's tokens after it, padded to the longest.
    expected = sum(p + len(rows) * (int(lengths[rows].max()) - p)
                   for p, rows in prompt_groups(batch["input_ids"], batch["attention_mask"],
                                                batch["loss_mask"]))
    counter = _TokenCounter(model)
    accumulate_gradients(model, mbs, None, cfg, share_prompts=True)
    assert counter.tokens == expected
    counter.tokens = 0
    accumulate_gradients(model, mbs, None, cfg, share_prompts=False)
    full = counter.tokens
    assert full == batch["input_ids"].numel()
    assert expected < 0.7 * full  # prompts of 30 tokens in rows of 42..58


@pytest.mark.parametrize(("kl_coef", "num_minibatches"), [(0.0, 1), (0.05, 2)])
def test_train_step_updates_as_the_full_forward_does(model, kl_coef, num_minibatches):
    samples = multi_turn_samples(model, n=8)
    cfg = TrainStepConfig(max_tokens_per_microbatch=150, kl_coef=kl_coef,
                          num_minibatches=num_minibatches, max_grad_norm=1e3)
    results = {}
    for share in (False, True):
        torch.manual_seed(0)
        m = copy.deepcopy(model)
        # Plain SGD at lr 1: the update is the (summed) gradient itself, which AdamW's
        # normalisation would blow up where a gradient is ~0.
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        agreement: list = []
        metrics = train_step(m, opt, samples, cfg, ref_model=copy.deepcopy(model),
                             share_prompts=share, agreement=agreement, weights_version=0)
        assert metrics["num_microbatches"] >= 2 * num_minibatches
        delta = [(a - b).detach() for a, b in zip(m.parameters(), model.parameters(),
                                                  strict=True)]
        results[share] = (metrics, delta, agreement)
    (m_full, d_full, a_full), (m_shared, d_shared, a_shared) = results[False], results[True]
    assert m_shared.keys() == m_full.keys()
    for key, v in m_full.items():
        assert m_shared[key] == pytest.approx(v, rel=RTOL, abs=ATOL), key
    for a, b in zip(d_full, d_shared, strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    for x, y in zip(a_full, a_shared, strict=True):
        assert y == pytest.approx(x, rel=RTOL, abs=ATOL)


def test_shared_prompts_are_refused_under_data_parallel(model):
    class OneRank:
        rank, world_size = 0, 1

        def all_reduce(self, values, op):
            return list(values)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="share_prompts=True needs one process"):
        train_step(model, opt, multi_turn_samples(model, n=2), TrainStepConfig(),
                   dp=OneRank(), share_prompts=True)


def test_packing_by_prompt_keeps_each_prompt_in_the_fewest_micro_batches(model):
    samples = multi_turn_samples(model, n=8)
    budget = 4 * max(s.num_tokens for s in samples)
    mixed = pack_microbatches(samples, budget)
    by_prompt = pack_microbatches(samples, budget, by_prompt=True)
    for mbs in (mixed, by_prompt):
        assert sorted(s.sample_id for mb in mbs for s in mb) == sorted(s.sample_id
                                                                       for s in samples)
        assert all(len(mb) * max(s.num_tokens for s in mb) <= budget for mb in mbs)
    assert [len({s.domain for s in mb}) for mb in mixed] == [2, 2]  # one prompt per domain
    assert [len({s.domain for s in mb}) for mb in by_prompt] == [1, 1]
    for mb in by_prompt:  # longest first within a prompt, as without by_prompt
        assert [s.num_tokens for s in mb] == sorted((s.num_tokens for s in mb), reverse=True)
    # train_step packs by prompt when it shares prompts: 2 model calls (prompt, rest) per
    # micro-batch, not 2 per prompt of each micro-batch.
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    m = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), samples,
                   TrainStepConfig(max_tokens_per_microbatch=budget), share_prompts=True)
    assert m["num_microbatches"] == 2
    assert len(calls) == 4


def test_a_model_with_sliding_window_layers_gets_the_full_forward():
    from transformers import Qwen2ForCausalLM

    from rollart.models.tiny import tiny_config

    config = tiny_config(SPEC)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 16, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    batch = collate(multi_turn_samples(model, n=4))
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    with torch.no_grad():
        full = token_logprobs_entropy(model, ids, attn, entropy_mask=mask)
        shared = shared_prompt_logprobs_entropy(model, ids, attn, mask)
    assert torch.equal(shared[0], full[0])  # the prompts' logprobs too: no prompt forward
    assert shared[1] is not None and full[1] is not None and torch.equal(shared[1], full[1])
