"""``pd``: prefill/decode (PD) disaggregation of one request: prefill on an H800 engine, KV
cache shipped over the cross-cluster link, decode on an H20 engine, against the same request
served entirely on H800 or entirely on H20 (SIMULATED engines; cost model only, no controller).

Per request (prompt ``P``, response ``R`` tokens, drawn from the agentic domain of
``benchmarks.workloads`` but with 8k-24k-token contexts, the multi-turn regime PD targets):

- colocated on X: ``prefill_s(X, P) + R x decode_step_s(X, B, B x (P + R / 2))``;
- PD: ``prefill_s(H800, P) + P x kv_bytes_per_token / link + R x decode_step_s(H20, ...)``

where ``B`` is the concurrent decode batch the request shares its steps with (32, or as many
such requests as the engine's KV pool holds, whichever is smaller) and ``link`` the paper's
200 Gb Ethernet across clusters (§7.1; the KV is read from the prefill engine's HBM and
written to the decode engine's, both far faster). The ratio is the mean latency over 64
requests, per seed, 3 (quick) / 5 seeds. Models: Qwen3-32B (TP 4) and Qwen3-30B-A3B (MoE,
TP 2). Paper Table 5: PD 1.03-1.05x (32B), 1.11-1.21x (MoE).
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, summarize
from benchmarks.workloads import TP
from rollart.sim import costs
from rollart.sim.hardware import H20, H800, HardwareProfile
from rollart.sim.models import ModelProfile, get_model
from rollart.sim.workload import Dist, seeded_rng

NAME = "pd"
MODELS = ("qwen3-32b", "qwen3-30b-a3b")
PROMPT = Dist("uniform", 16_000, 8_000 / 3 ** 0.5, 1024, 1e9)  # ~uniform on [8k, 24k]
RESPONSE = Dist("lognormal", 200, 150, 8, 1e9)
BATCH = 32
REQUESTS = 64


def _decode_s(model: ModelProfile, hw: HardwareProfile, tp: int, prompt: int,
              response: int) -> float:
    ctx = prompt + response / 2.0
    batch = max(1, min(BATCH, int(costs.kv_capacity_tokens(model, hw, tp=tp)
                                  // (prompt + response))))
    return response * costs.decode_step_s(model, hw, batch, batch * ctx, tp=tp)


def latencies(model_name: str, seed: int) -> dict[str, float]:
    """Mean per-request seconds of h800 / h20 / pd serving, and the mean KV transfer."""
    model, tp = get_model(model_name), TP[model_name]
    rng = seeded_rng(seed, f"pd-{model_name}")
    out: dict[str, list[float]] = {"h800_s": [], "h20_s": [], "pd_s": [], "kv_transfer_s": []}
    for _ in range(REQUESTS):
        p, r = PROMPT.sample_int(rng), RESPONSE.sample_int(rng)
        kv = costs.transfer_s(p * model.kv_bytes_per_token, H800.link_bytes_per_s)
        pre800 = costs.prefill_s(model, H800, p, tp=tp)
        out["h800_s"].append(pre800 + _decode_s(model, H800, tp, p, r))
        out["h20_s"].append(costs.prefill_s(model, H20, p, tp=tp) + _decode_s(model, H20, tp, p, r))
        out["pd_s"].append(pre800 + kv + _decode_s(model, H20, tp, p, r))
        out["kv_transfer_s"].append(kv)
    return {k: statistics.fmean(v) for k, v in out.items()}


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, samples = [], {}
    for model in MODELS:
        for sd in seeds:
            lat = latencies(model, sd)
            rows.append({"model": model, "tp": TP[model], **lat})
            samples.setdefault(f"{model}: pd vs h800 colocated", []).append(
                lat["h800_s"] / lat["pd_s"])
            samples.setdefault(f"{model}: pd vs h20 colocated", []).append(
                lat["h20_s"] / lat["pd_s"])
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("model",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes="paper Table 5: PD 1.03-1.05x (Qwen3-32B), 1.11-1.21x (Qwen3-30B-A3B)")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
