"""``token_path``: the cost of per-token data at 32k-token contexts, before vs after (measured,
NOT simulated; CPU only, no processes).

"Before" is the message and sample shapes rollart used until December 2026, rebuilt here
(``_OldGenerate``, ``_OldGenerateResult``, ``_OldSample``, ``_OldTrainSample``: per-token
``list[int]`` / ``list[float]`` fields and Python-loop validation, copied from the old code);
"after" is the code in ``rollart`` now: int32 / float32 / uint8 bytes on the wire, array-backed
``Sample`` (ids and mask per token, logprobs and versions per generated token), prompts sent
as deltas on a prefix the worker holds (``PrefixStore``).

One turn of a trajectory whose context holds ``CONTEXT`` tokens, with ``GENERATED`` tokens
generated and ``OBSERVATION`` observation tokens appended (the next turn's delta). Measured:

- bytes on the wire per turn: ``Generate`` (old: whole prompt as msgpack ints; new: whole prompt
  as bytes (a re-routed trajectory); new: delta) and ``GenerateResult``;
- ``Generate`` encode on the controller and decode + prompt assembly on the worker (up to the
  ``list[int]`` vLLM's ``TokensPrompt`` takes, which both paths must build), microseconds;
- the controller's per-turn token bookkeeping (copy the prompt into the request, append the
  reply's tokens, logprobs, versions and the observation), microseconds;
- per completion: ``Sample`` build + validation + ``min_version`` + ``num_generated``, and the
  ``TrainSample`` built from it, microseconds;
- controller memory per held token (``tracemalloc`` of a held sample whose per-token values
  came from decoded messages, i.e. distinct Python objects in the old shape), bytes.

Each timing is the median over ``iters`` calls; ``repeats`` repeats alternate before/after so
load drift hits both; each ratio is computed per repeat (paired) and reported as the geometric
mean over repeats with a Student-t 95% interval of the log ratio; "before" / "after" columns are
medians over repeats.

Workload constants (assumptions, not measurements): ``CONTEXT`` = 32,768 tokens (the issue's
32k contexts); ``GENERATED`` = 512 and ``OBSERVATION`` = 256 tokens per turn (an agentic turn;
wire bytes of the delta scale linearly with them); token ids uniform in ``[0, 151,936)``, the
vocabulary size of Qwen3 (``vocab_size`` in Qwen/Qwen3-8B ``config.json``), which sets how many
bytes msgpack spends per id in the old shape.
"""

from __future__ import annotations

import array
import math
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import numpy as np

from benchmarks.common import main_for, result
from rollart.controller.buffer.sample import Sample
from rollart.inference.prefixes import PrefixStore
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb

NAME = "token_path"
CONTEXT = 32_768
GENERATED = 512
OBSERVATION = 256
VOCAB = 151_936
#: Student-t 0.975 quantiles by degrees of freedom (two-sided 95% interval)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
         19: 2.093, 24: 2.064, 29: 2.045}


# ------------------------------------------------------------------ the old shapes, rebuilt


class _OldGenerate(m.Msg, tag="Generate"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: m.SamplingParams


class _OldGenerateResult(m.Msg, tag="GenerateResult"):
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    num_prompt_tokens: int
    stats: m.WorkerStats
    prompt_logprobs: list[float | None] | None = None


class _OldSample(msgspec.Struct, kw_only=True):
    """``rollart.controller.buffer.sample.Sample`` before: lists and Python-loop checks."""

    sample_id: str
    group_key: str
    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    reward: float

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        lens = (len(self.loss_mask), len(self.behaviour_logprobs), len(self.versions))
        if any(k != n for k in lens):
            raise ValueError("lengths differ")
        if any(x not in (0, 1) for x in self.loss_mask):
            raise ValueError("loss_mask values must be 0 or 1")
        for t, (x, v) in enumerate(zip(self.loss_mask, self.versions, strict=True)):
            if x and v < 0:
                raise ValueError(f"generated token {t} has version {v}")
        if not math.isfinite(self.reward):
            raise ValueError("reward not finite")

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_version(self) -> int | None:
        gen = [v for x, v in zip(self.loss_mask, self.versions, strict=True) if x]
        return min(gen) if gen else None


class _OldTrainSample(msgspec.Struct, kw_only=True):
    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    sample_id: str

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError("lengths differ")
        if any(x not in (0, 1) for x in self.loss_mask):
            raise ValueError("loss_mask values must be 0 or 1")
        if self.loss_mask[0] or not any(self.loss_mask):
            raise ValueError("bad loss_mask")
        if any(t < 0 for t in self.token_ids):
            raise ValueError("negative token id")
        for x, lp in zip(self.loss_mask, self.behaviour_logprobs, strict=True):
            if x and not (math.isfinite(lp) and lp <= 0.0):
                raise ValueError("bad logprob")


# ------------------------------------------------------------------------------ workload


class _Workload:
    """One trajectory at ``CONTEXT`` tokens: its sequence (old lists, new arrays) and one turn."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        n, g = CONTEXT, GENERATED
        self.ids = [rng.randrange(VOCAB) for _ in range(n)]
        mask = [0] * n
        for start in range(1000, n - g, 4 * g):  # generated stretches between observations
            mask[start : start + g] = [1] * g
        self.mask = mask
        self.lps = [-rng.random() * 3 if x else 0.0 for x in mask]
        self.versions = [rng.randrange(3, 6) if x else -1 for x in mask]
        self.gen = [rng.randrange(VOCAB) for _ in range(g)]
        self.gen_lps = [-rng.random() * 3 for _ in range(g)]
        self.gen_versions = [5] * g
        self.obs = [rng.randrange(VOCAB) for _ in range(OBSERVATION)]
        self.sampling = m.SamplingParams(max_tokens=g, temperature=1.0)
        self.stats = m.WorkerStats(worker="w0", num_running=100, num_waiting=3, version=5)
        self.a_ids = array.array("i", self.ids)
        self.a_mask = array.array("b", mask)
        # now: logprobs and versions of the generated tokens only (``Sample``'s form)
        self.a_lps = array.array("f", [lp for lp, x in zip(self.lps, mask, strict=True) if x])
        self.a_versions = array.array(
            "i", [v for v, x in zip(self.versions, mask, strict=True) if x])

    def old_generate(self) -> _OldGenerate:
        return _OldGenerate(request_id="g0/0/7/t12", prompt_token_ids=list(self.ids),
                            sampling=self.sampling)

    def new_generate(self, delta: bool) -> m.Generate:
        held = CONTEXT - OBSERVATION if delta else 0
        return m.Generate(request_id="g0/0/7/t12", new_token_ids=self.a_ids[held:].tobytes(),
                          sampling=self.sampling, trajectory_id="g0/0/7", prefix_len=held)

    def old_result(self) -> _OldGenerateResult:
        return _OldGenerateResult(request_id="g0/0/7/t12", token_ids=self.gen,
                                  logprobs=self.gen_lps, versions=self.gen_versions,
                                  finish_reason="stop", num_prompt_tokens=CONTEXT,
                                  stats=self.stats)

    def new_result(self) -> m.GenerateResult:
        return m.GenerateResult(request_id="g0/0/7/t12", token_ids=tb.pack_i32(self.gen),
                                logprobs=tb.pack_f32(self.gen_lps),
                                versions=tb.pack_i32(self.gen_versions), finish_reason="stop",
                                num_prompt_tokens=CONTEXT, stats=self.stats)


def _time_us(fn: Callable[[], float], iters: int) -> float:
    """Median microseconds of ``fn``'s timed part over ``iters`` calls (each call returns its
    own elapsed seconds); the median keeps a call preempted on a shared machine from setting
    the figure."""
    fn()  # warm caches and lazy imports
    return statistics.median(fn() for _ in range(iters)) * 1e6


def _timed(fn: Callable[[], Any]) -> Callable[[], float]:
    def call() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return call


def _held_bytes_per_token(build: Callable[[], Any]) -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = build()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del held
    return (after - before) / CONTEXT


def _ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-repeat ratios and its Student-t 95% interval (low, high),
    computed on log ratios (a ratio's errors are multiplicative)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.exp(mean), math.exp(mean)
    df = len(logs) - 1
    # a missing df takes the next smaller one's quantile: a slightly wider interval
    t = 1.96 if df > 29 else _T975[max(k for k in _T975 if k <= df)]
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _measures(w: _Workload) -> dict[str, tuple[Callable[[], float], Callable[[], float]]]:
    """name -> (before, after) callables, each doing one unit of work and returning the
    seconds it took (set-up excluded)."""
    enc = msgspec.msgpack.Encoder()
    old_dec = msgspec.msgpack.Decoder(_OldGenerate)
    new_dec = msgspec.msgpack.Decoder(m.Request)
    old_res_dec = msgspec.msgpack.Decoder(_OldGenerateResult)
    new_res_dec = msgspec.msgpack.Decoder(m.Reply)
    old_wire = enc.encode(w.old_generate())
    delta_wire = enc.encode(w.new_generate(delta=True))
    old_res_wire = enc.encode(w.old_result())
    new_res_wire = enc.encode(w.new_result())
    held = w.a_ids[: CONTEXT - OBSERVATION].tobytes()
    generated = tb.pack_i32(w.gen)
    store = PrefixStore()

    def worker_new() -> list[int]:
        msg = new_dec.decode(delta_wire)
        store.keep(msg.trajectory_id, held, b"")  # set-up: what the last turn left held
        prompt = store.take_prompt(msg)
        ids = tb.view_i32(prompt).tolist()
        store.keep(msg.trajectory_id, prompt, generated)  # after the turn (counted)
        return ids

    def turn_old() -> float:
        ids, mask, lps, vers = list(w.ids), list(w.mask), list(w.lps), list(w.versions)
        t0 = time.perf_counter()
        _OldGenerate(request_id="r", prompt_token_ids=list(ids), sampling=w.sampling)
        res = old_res_dec.decode(old_res_wire)
        n = len(res.token_ids)
        ids += res.token_ids
        mask += [1] * n
        lps += res.logprobs
        vers += res.versions
        ids += w.obs
        mask += [0] * len(w.obs)
        lps += [0.0] * len(w.obs)
        vers += [-1] * len(w.obs)
        return time.perf_counter() - t0

    def turn_new() -> float:
        ids, mask, lps, vers = w.a_ids[:], w.a_mask[:], w.a_lps[:], w.a_versions[:]
        t0 = time.perf_counter()
        with memoryview(ids) as view:
            m.Generate(request_id="r", new_token_ids=view[CONTEXT - OBSERVATION :].tobytes(),
                       sampling=w.sampling, trajectory_id="t", prefix_len=CONTEXT - OBSERVATION)
        res = new_res_dec.decode(new_res_wire)
        n = res.num_tokens
        ids.frombytes(res.token_ids)
        mask.frombytes(b"\x01" * n)
        lps.frombytes(res.logprobs)
        vers.frombytes(res.versions)
        ids.extend(w.obs)
        mask.frombytes(bytes(len(w.obs)))  # observations have no logprob or version
        return time.perf_counter() - t0

    def completion_old() -> None:
        s = _OldSample(sample_id="s", group_key="g", token_ids=w.ids, loss_mask=w.mask,
                       behaviour_logprobs=w.lps, versions=w.versions, reward=1.0)
        s.min_version, s.num_generated  # noqa: B018 - the cost measured

    def completion_new() -> None:
        s = Sample(sample_id="s", group_key="g", token_ids=w.a_ids, loss_mask=w.a_mask,
                   behaviour_logprobs=w.a_lps, versions=w.a_versions, reward=1.0)
        s.min_version, s.num_generated  # noqa: B018 - the cost measured

    new_sample = Sample(sample_id="s", group_key="g", token_ids=w.a_ids, loss_mask=w.a_mask,
                        behaviour_logprobs=w.a_lps, versions=w.a_versions, reward=1.0)
    mask0 = [0, *w.mask[1:]]
    a_mask0 = array.array("b", mask0)

    return {
        "Generate encode (controller), us": (
            _timed(lambda: enc.encode(w.old_generate())),
            _timed(lambda: enc.encode(w.new_generate(delta=True))),
        ),
        "Generate decode + prompt list + keep prefix (worker), us": (
            _timed(lambda: list(old_dec.decode(old_wire).prompt_token_ids)),
            _timed(worker_new),
        ),
        "GenerateResult decode (controller), us": (
            _timed(lambda: old_res_dec.decode(old_res_wire)),
            _timed(lambda: new_res_dec.decode(new_res_wire)),
        ),
        "token bookkeeping per turn (controller), us": (turn_old, turn_new),
        "Sample build+validate+min_version per completion, us": (
            _timed(completion_old), _timed(completion_new)),
        "TrainSample build+validate per completion, us": (
            _timed(lambda: _OldTrainSample(token_ids=w.ids, loss_mask=mask0,
                                           behaviour_logprobs=w.lps, advantage=0.5,
                                           sample_id="s")),
            _timed(lambda: m.TrainSample(token_ids=new_sample.token_ids, loss_mask=a_mask0,
                                         behaviour_logprobs=new_sample.behaviour_logprobs,
                                         advantage=0.5, sample_id="s")),
        ),
    }


def run(quick: bool, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    repeats, iters = (5, 7) if quick else (20, 21)
    w = _Workload(seed)
    enc = msgspec.msgpack.Encoder()
    wire = {
        "Generate bytes per turn": (
            len(enc.encode(w.old_generate())), len(enc.encode(w.new_generate(delta=True)))),
        "Generate bytes, whole prompt (re-routed)": (
            len(enc.encode(w.old_generate())), len(enc.encode(w.new_generate(delta=False)))),
        "GenerateResult bytes per turn": (
            len(enc.encode(w.old_result())), len(enc.encode(w.new_result()))),
    }

    def old_held() -> Any:
        # per-token values as a decoder makes them: one Python object per id / logprob
        dec = msgspec.msgpack.Decoder(_OldSample)
        return dec.decode(msgspec.msgpack.encode(_OldSample(
            sample_id="s", group_key="g", token_ids=w.ids, loss_mask=w.mask,
            behaviour_logprobs=w.lps, versions=w.versions, reward=1.0)))

    def new_held() -> Any:
        return Sample(sample_id="s", group_key="g", token_ids=array.array("i", w.a_ids),
                      loss_mask=array.array("b", w.a_mask),
                      behaviour_logprobs=array.array("f", w.a_lps),
                      versions=array.array("i", w.a_versions), reward=1.0)

    measures = _measures(w)
    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in measures}
    memory: tuple[list[float], list[float]] = ([], [])
    for r in range(repeats):
        for name, (before, after) in measures.items():
            pair = (before, after) if r % 2 == 0 else (after, before)
            times = [_time_us(fn, iters) for fn in pair]
            if r % 2:
                times.reverse()
            samples[name][0].append(times[0])
            samples[name][1].append(times[1])
        if r < 3:  # allocation sizes are deterministic; three repeats show that
            memory[0].append(_held_bytes_per_token(old_held))
            memory[1].append(_held_bytes_per_token(new_held))
    samples["controller bytes per held token"] = memory

    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    ci95: dict[str, list[float]] = {}
    for name, (old, new) in wire.items():
        rows.append({"measure": name, "before": old, "after": new, "before/after": old / new,
                     "ci95": "exact (deterministic)"})
        ratios[f"{name}: before/after"] = old / new
        ci95[f"{name}: before/after"] = [old / new, old / new]  # byte counts: exact
    for name, (old, new) in samples.items():
        per_repeat = [a / b for a, b in zip(old, new, strict=True)]
        mean, lo, hi = _ratio_interval(per_repeat)
        om, nm = statistics.median(old), statistics.median(new)
        rows.append({"measure": name, "before": round(om, 2), "after": round(nm, 2),
                     "before/after": round(mean, 2), "ci95": f"[{lo:.2f}, {hi:.2f}]"})
        ratios[f"{name}: before/after"] = mean
        ci95[f"{name}: before/after"] = [lo, hi]
        ratios[f"{name}: after"] = nm
    per_completion = statistics.median(samples[
        "Sample build+validate+min_version per completion, us"][1])
    ratios["per completion us at 32k (goal <= 200)"] = per_completion
    ratios["controller bytes per held token (goal <= 16)"] = statistics.fmean(memory[1])
    notes = (f"context {CONTEXT} tokens, {GENERATED} generated + {OBSERVATION} observation "
             f"tokens per turn; {repeats} repeats x {iters} calls; numpy {np.__version__}")
    return result(NAME, simulated=False, rows=rows, ratios=ratios, ci95=ci95, quick=quick,
                  seed=seed, notes=notes, started=started)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return main_for(NAME, "per-token data at 32k contexts: wire bytes, encode/decode, per "
                    "completion and memory, before vs after", run, argv)


if __name__ == "__main__":
    main()
