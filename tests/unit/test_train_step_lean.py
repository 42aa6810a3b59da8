"""The lean training step (no proximal recompute with one optimizer step) and policy entropy."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rollart.models.tiny import TinyModelSpec, init_tiny_model
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

SPEC = TinyModelSpec(seed=3, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
# The lean path's proximal logprobs are the training forward's own; the recompute path's come
# from a separate no-grad forward of the same weights on the same micro-batches. On CPU both
# forwards run the same kernels (measured: bit-identical here), so the only slack allowed is
# float32 rounding: rtol 1e-5, atol 1e-7 (max |grad| is ~0.35).
RTOL, ATOL = 1e-5, 1e-7


@pytest.fixture
def model():
    return init_tiny_model(SPEC)


def make_samples(model, n=6, *, domains=("",), seed=0, noise=(0.0, 0.3, -2.0)):
    """Random sequences of 6..16 tokens, second half generated; behaviour logprobs are the
    model's own shifted per token by `noise` (cycled), so some importance weights exceed the
    default cap of 5 (e^2 > 5) and some fall below 1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 6 + (i * 5) % 11
        ids = torch.randint(5, 102, (length,), generator=g).tolist()
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        with torch.no_grad():
            x = torch.tensor([ids])
            lp = token_logprobs(model, x, torch.ones_like(x))[0].tolist()
        blp = [min(v + noise[t % len(noise)], 0.0) if m else 0.0
               for t, (v, m) in enumerate(zip(lp, mask, strict=True))]
        out.append(TrainSample.from_lists(
            token_ids=ids, loss_mask=mask, behaviour_logprobs=blp,
            advantage=(1.0, -0.5, 0.25)[i % 3], sample_id=f"s{i}",
            domain=domains[i % len(domains)]))
    return out


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def test_lean_accumulation_has_the_recompute_paths_loss_and_gradients(model):
    samples = make_samples(model, n=7)
    cfg = TrainStepConfig(max_tokens_per_microbatch=40)
    mbs = pack_microbatches(samples, cfg.max_tokens_per_microbatch)
    assert len(mbs) >= 3
    with torch.no_grad():
        prox = [token_logprobs(model, c["input_ids"], c["attention_mask"])
                for c in (collate(mb) for mb in mbs)]
    model.zero_grad(set_to_none=True)
    m_recompute = accumulate_gradients(model, mbs, prox, cfg)
    g_recompute = _grads(model)
    model.zero_grad(set_to_none=True)
    m_lean = accumulate_gradients(model, mbs, None, cfg)
    g_lean = _grads(model)
    for a, b in zip(g_recompute, g_lean, strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert any(float(g.abs().max()) > 1e-3 for g in g_lean)  # a real gradient, not zeros
    for key in ("loss", "pg_loss", "iw_mean", "iw_max", "iw_capped_fraction",
                "logprob_mismatch", "ratio_mean", "entropy_mean"):
        assert m_lean[key] == pytest.approx(m_recompute[key], rel=RTOL, abs=ATOL), key
    assert m_lean["iw_capped_fraction"] > 0  # the truncation is exercised


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_lean_train_step_makes_the_recompute_paths_update(model, kl_coef):
    # SGD with lr 1: the update is minus the (clipped) gradient, so equal updates mean equal
    # gradients; the reference model (KL term) is an independently perturbed copy.
    samples = make_samples(model, n=6, domains=("a", "b"))
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)
    cfg = TrainStepConfig(max_tokens_per_microbatch=48, kl_coef=kl_coef, max_grad_norm=1e6)
    results = {}
    for recompute in (True, None):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        agreement: list = []
        metrics = train_step(m, opt, samples, cfg, ref_model=ref if kl_coef else None,
                             recompute_proximal=recompute, agreement=agreement,
                             weights_version=0)
        delta = [(a - b).detach() for a, b in zip(m.parameters(), model.parameters(),
                                                  strict=True)]
        results[recompute] = (metrics, delta, agreement)
    (m_re, d_re, a_re), (m_lean, d_lean, a_lean) = results[True], results[None]
    for a, b in zip(d_re, d_lean, strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert m_lean.keys() == m_re.keys()
    for key, v in m_re.items():
        assert m_lean[key] == pytest.approx(v, rel=RTOL, abs=ATOL), key
    assert (m_lean["kl"] > 0) == (kl_coef > 0)
    # The engine/trainer agreement is reported either way, from the same logprobs.
    assert len(a_lean) == len(a_re) == len(samples)
    for x, y in zip(a_lean, a_re, strict=True):
        assert x == pytest.approx(y, rel=RTOL, abs=ATOL)


class _ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.no_grad_calls = 0
        model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1
        self.no_grad_calls += not torch.is_grad_enabled()


@pytest.mark.parametrize(
    ("num_minibatches", "recompute", "passes_per_microbatch"),
    [(1, None, 1), (1, True, 2), (2, None, 2), (3, True, 2)],
)
@pytest.mark.parametrize("share_prompts", [False, True])
def test_the_no_grad_pass_runs_only_with_several_optimizer_steps(
        model, num_minibatches, recompute, passes_per_microbatch, share_prompts):
    samples = make_samples(model, n=6)
    counter = _ForwardCounter(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = train_step(model, opt, samples,
                   TrainStepConfig(max_tokens_per_microbatch=40,
                                   num_minibatches=num_minibatches),
                   recompute_proximal=recompute, share_prompts=share_prompts)
    assert m["num_microbatches"] >= 2
    # A shared-prompt pass calls the model twice per prompt group (prompt, then the rest).
    if not share_prompts:
        assert counter.calls == passes_per_microbatch * m["num_microbatches"]
    assert (counter.no_grad_calls > 0) == (passes_per_microbatch > 1)


def test_a_reference_model_is_not_run_without_a_kl_term(model):
    ref = copy.deepcopy(model)
    counter = _ForwardCounter(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, make_samples(model, n=4), TrainStepConfig(kl_coef=0.0),
               ref_model=ref)
    assert counter.calls == 0
    train_step(model, opt, make_samples(model, n=4), TrainStepConfig(kl_coef=0.1),
               ref_model=ref)
    assert counter.calls > 0


def test_skipping_the_pass_with_several_optimizer_steps_is_refused(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="recompute_proximal=False needs num_minibatches 1"):
        train_step(model, opt, make_samples(model, n=4), TrainStepConfig(num_minibatches=2),
                   recompute_proximal=False)


# ---------------------------------------------------------------------------------- entropy


def _reference_entropy(model, samples, temperature):
    """Per sample: (sum of entropies over its generated tokens, their count), from
    torch.distributions on the model's logits, one sample at a time (no padding)."""
    out = []
    with torch.no_grad():
        for s in samples:
            c = collate([s])
            logits = model(input_ids=c["input_ids"]).logits[0, :-1].double() / temperature
            h = torch.distributions.Categorical(logits=logits).entropy()
            at = c["loss_mask"][0, 1:]
            out.append((float(h[at].sum()), int(at.sum())))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_mean_overall_and_by_domain_matches_a_direct_computation(model, temperature):
    samples = make_samples(model, n=7, domains=("math", "", "code"))
    ref = _reference_entropy(model, samples, temperature)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    m = train_step(model, opt, samples,
                   TrainStepConfig(max_tokens_per_microbatch=40, temperature=temperature))

    def mean(keep):
        pairs = [r for s, r in zip(samples, ref, strict=True) if keep(s)]
        return sum(h for h, _ in pairs) / sum(n for _, n in pairs)

    assert m["entropy_mean"] == pytest.approx(mean(lambda s: True), rel=1e-5)
    assert m["entropy_mean/math"] == pytest.approx(mean(lambda s: s.domain == "math"), rel=1e-5)
    assert m["entropy_mean/code"] == pytest.approx(mean(lambda s: s.domain == "code"), rel=1e-5)
    # A sample without a domain counts in the total only; no "entropy_mean/" key for it.
    assert sorted(k for k in m if k.startswith("entropy_mean/")) == [
        "entropy_mean/code", "entropy_mean/math"]
    # An untrained model over ~100 live tokens of a 261-token vocabulary: near log(V).
    assert 0 < m["entropy_mean"] <= math.log(261) + 1e-6


def test_token_entropy_is_zero_off_the_mask_and_for_a_one_hot_policy(model, monkeypatch):
    ids = torch.tensor([[5, 9, 12, 40], [7, 8, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    mask = torch.tensor([[0, 1, 0, 1], [0, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        lp, ent = token_logprobs_entropy(model, ids, attn, entropy_mask=mask)
        monkeypatch.setattr("rollart.trainer.logprobs._ENTROPY_CHUNK", 2)  # 3 tokens: 2 chunks
        _, chunked = token_logprobs_entropy(model, ids, attn, entropy_mask=mask)
    assert chunked is not None and ent is not None
    torch.testing.assert_close(chunked, ent, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(lp, token_logprobs(model, ids, attn))
    assert ent is not None and torch.equal(ent[~mask], torch.zeros(int((~mask).sum())))
    assert bool((ent[mask] > 0).all())
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)  # near one-hot next-token distributions
        _, cold = token_logprobs_entropy(model, ids, attn, entropy_mask=mask)
    assert cold is not None and float(cold[mask].max()) < 1e-3
    _, none = token_logprobs_entropy(model, ids, attn)
    assert none is None
    with pytest.raises(ValueError, match="entropy_mask"):
        token_logprobs_entropy(model, ids, attn, entropy_mask=mask[:, :2])


class _OneRank:
    """A data-parallel group of one rank: every reduction returns its input."""

    rank, world_size = 0, 1

    def all_reduce(self, values, op):
        assert op in ("sum", "max")
        return list(values)


def test_entropy_survives_the_data_parallel_reduction(model):
    samples = make_samples(model, n=5, domains=("x", "y"))
    cfg = TrainStepConfig(max_tokens_per_microbatch=40)
    plain = train_step(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.0),
                       samples, cfg)
    m = copy.deepcopy(model)
    reduced = train_step(m, torch.optim.SGD(m.parameters(), lr=0.0), samples, cfg,
                         dp=_OneRank())
    for key in ("entropy_mean", "entropy_mean/x", "entropy_mean/y", "loss", "num_tokens"):
        assert reduced[key] == pytest.approx(plain[key], rel=1e-6), key


def test_the_simulated_trainer_charges_the_lean_step() -> None:
    # The simulator follows the real trainer's default (one optimizer step per batch, no
    # proximal pass): 6 FLOPs per parameter per token, not 8.
    import asyncio
    from types import SimpleNamespace

    from rollart.sim import costs
    from rollart.sim.hardware import H800
    from rollart.sim.models import QWEN3_8B
    from rollart.sim.trainer import SimTrainer

    scale = 1e-9  # keep the simulated sleep negligible; step_times_s records it scaled
    lean = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, time_scale=scale)
    full = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, time_scale=scale,
                      extra_forward=True)
    batch = [SimpleNamespace(num_tokens=100_000)]
    for t in (lean, full):
        asyncio.run(t.train(batch))
    assert lean.step_times_s[0] == pytest.approx(
        scale * costs.train_step_s(QWEN3_8B, H800, 100_000, num_gpus=8, extra_forward=False,
                                   seq_lens=[100_000]))
    assert lean.step_times_s[0] / full.step_times_s[0] == pytest.approx(6 / 8)
