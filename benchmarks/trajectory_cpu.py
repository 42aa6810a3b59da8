"""``trajectory_cpu``: the controller's own event-loop CPU per turn and per completed trajectory,
and the garbage-collector-tracked objects each running trajectory holds, this tree vs a git
ref (default ``main``), side by side in one run (measured, NOT simulated; no sockets).

    python -m benchmarks.trajectory_cpu [--quick] [--baseline REF] [--repeats K] [--json OUT]

The real ``Controller`` (``run_trajectory``, ``LLMProxy``, ``SampleBuffer``, completion with
``trainable_problem``, batch assembly with ``to_train_samples``) drives trajectories against
in-process stand-ins with no I/O: a worker that answers every ``Generate`` at once with
``RESPONSE`` tokens at its weight version, an env whose sessions open with a ``CONTEXT``-token
observation and step ``TURNS`` times with ``OBSERVATION``-token observations, the SIMULATED
reward (``SimReward`` with ``counter_rng``, as ``controller_overhead`` uses: its CPU counts)
and a trainer that builds the ``TrainSample`` batch and returns at once. The workload is
``controller_overhead``'s ``--quick`` 10k row per trajectory (16k-token prompt, 3 turns, 4
generated and 4 observation tokens per turn): what the lead profiled.

Each repeat runs two child processes, one on this tree and one on ``REF`` (``git archive`` of its
``src/`` into a temporary folder, first on ``PYTHONPATH``; this benchmark's own code is the same
in both), alternating which goes first. Both build the controller with ``build_controller``
(a ref that predates it gets the same wiring by hand, the run's send window included). Each child measures:

- ``loop_cpu_us_per_turn``: ``time.thread_time()`` of the event-loop thread over ``steps``
  training steps after one warm-up step, divided by the generate calls in that window (so it
  includes completions and batch assembly, amortised over the turns);
- ``loop_cpu_us_per_traj``: the same CPU divided by the trajectories completed in the window;
  the controller runs under the collector policy ``rollart run`` gives it (``tune_gc``, start-up
  objects frozen), and ``gc_pause_us_per_traj`` is the collection time in the window
  (``GcPauses``, wall clock) per completed trajectory;
- ``completion_us``: one completion's own work on a ``CONTEXT + 3 x 8``-token sequence, from
  the arrays a running trajectory keeps (``Sample`` construction and validation, and in trees
  whose ``Sample`` holds per-token logprobs and versions the ``spread_generated`` that builds
  them; ``trainable_problem``; its share of ``to_train_samples`` of its group of ``GROUP``),
  median over ``COMPLETION_ITERS`` groups. The samples are held, as the buffer holds them
  until they are trained, so each completion's allocations are fresh pages (a loop that
  freed each sample would reuse the same warm pages: 28 vs ~200 us for ``spread_generated``
  at 32k tokens on the dev machine). ``--baseline`` refs from before the running trajectory
  kept generated-only arrays (before 2026-12-02) are not supported by this figure;
- ``gc_objects_per_traj``: GC-tracked objects (``len(gc.get_objects())`` after
  ``gc.collect()``) held per running trajectory: every admitted trajectory parked in its first
  env step (where a real trajectory spends its time, the env's latency), measured at two
  in-flight counts; the slope cancels what does not grow with trajectories;
- ``held_bytes_per_prompt_token``: memory the same parked trajectories hold, per trajectory and
  per prompt token (``tracemalloc`` of everything allocated from before the controller starts
  to the parked state, slope over the two in-flight counts, divided by ``CONTEXT``): the
  per-token arrays of a running trajectory (the controller's goal: <= 16 bytes per held token), the
  prompt's other copies (the worker stand-in keeps none) included.

Ratios (before / after, per repeat, paired) are the mean over repeats with a Student-t 95%
interval (``benchmarks.common.ci95``). The machine is a noisy shared VM: thread CPU, not wall
time, and before/after alternate within each repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.common import ci95, emit, result

NAME = "trajectory_cpu"
#: controller_overhead --quick's 10k row: 16k-token prompts, 3 turns, 4 + 4 tokens per turn
CONTEXT = 16_384
TURNS = 3
RESPONSE = 4
OBSERVATION = 4
COMPLETION_ITERS = 30
#: samples per GRPO group (the batch's share of ``to_train_samples`` is per group)
GROUP = 8
_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ child: one measurement


def _child(n_inflight: int, steps: int, seed: int) -> dict[str, Any]:
    """One measurement on whatever ``rollart`` is first on the path (see the module docstring)."""
    import uvloop

    return uvloop.run(_measure(n_inflight, steps, seed))


def _stand_ins(hold: asyncio.Event | None) -> tuple[Any, Any, Any, list[int], Any]:
    """The worker, env and trainer stand-ins, ``counts`` = [generate calls, env steps parked
    on ``hold``] and the domain table."""
    from rollart.controller.ports import TrainResult
    from rollart.controller.training.remote import to_train_samples
    from rollart.sim.workload import DomainSpec, DomainTable, const, observation
    from rollart.transport import messages as m
    from rollart.transport import tokenbytes as tb

    table = DomainTable([DomainSpec("zero", prompt_tokens=const(CONTEXT))])
    counts = [0, 0]
    # Trees from before env hosts closed ended sessions have no EnvStepResult.closed.
    closes = "closed" in m.EnvStepResult.__struct_fields__

    class Worker:  # answers at once: no engine, no I/O
        name = address = "w0"
        last_stats = None
        dead = False

        def __init__(self) -> None:
            self.version = 0
            self._reply = self._replies(0)

        def _replies(self, version: int) -> tuple[bytes, bytes, bytes, m.WorkerStats]:
            # built once per version: the stand-in's own cost stays out of the figures
            return (tb.pack_i32([7] * RESPONSE), tb.pack_f32([-0.5] * RESPONSE),
                    tb.pack_i32([version] * RESPONSE), self._stats())

        async def generate(self, request: m.Generate, *, timeout_s: float | None = None
                           ) -> m.GenerateResult:
            counts[0] += 1
            ids, lps, versions, stats = self._reply
            return m.GenerateResult(
                request_id=request.request_id, token_ids=ids, logprobs=lps, versions=versions,
                finish_reason="stop", num_prompt_tokens=request.prefix_len
                + len(request.new_token_ids) // 4, stats=stats)

        async def abort(self, request_id: str) -> None:
            return None

        async def pause(self, mode: str = "keep") -> None:
            return None

        async def resume(self) -> None:
            return None

        def _stats(self) -> m.WorkerStats:
            return m.WorkerStats(worker="w0", num_running=0, num_waiting=0, version=self.version)

        async def apply_weights(self, version: int, *, reprefill: bool = False
                                ) -> m.WeightsApplied:
            self.version = version
            self._reply = self._replies(version)
            return m.WeightsApplied(version=version, apply_time_s=0.0, stats=self._stats())

        async def stats(self) -> m.WorkerStats:
            return self._stats()

    class Env:
        name = "env"
        dead = False

        def __init__(self) -> None:
            self.turns: dict[str, int] = {}
            self.next = 0

        async def open(self, env_name: str, seed: int, options: Any = None, *,
                       timeout_s: float | None = None) -> m.EnvOpened:
            sid = f"s{self.next}"
            self.next += 1
            self.turns[sid] = 0
            return m.EnvOpened(session_id=sid, observation=observation("zero", CONTEXT - 1, sid))

        async def step(self, session_id: str, action: str, *, timeout_s: float | None = None
                       ) -> m.EnvStepResult:
            if hold is not None:
                counts[1] += 1
                await hold.wait()
            k = self.turns[session_id] = self.turns[session_id] + 1
            done = k >= TURNS
            if done and closes:  # closed with its last step, as env hosts do
                del self.turns[session_id]
            return m.EnvStepResult(session_id=session_id,
                                   observation=observation("zero", OBSERVATION), reward=0.0,
                                   terminated=done, truncated=False,
                                   **({"closed": done} if closes else {}))

        async def close_session(self, session_id: str) -> None:
            self.turns.pop(session_id, None)

    class Trainer:  # builds the wire batch (the controller's work), trains nothing
        push_needs_pause = False

        def __init__(self) -> None:
            self.version = 0

        async def train(self, samples: Any) -> TrainResult:
            to_train_samples(samples)
            self.version += 1
            return TrainResult(version=self.version)

        async def set_workers(self, workers: Any) -> None:
            return None

        async def push_weights(self, version: int, workers: Any) -> None:
            return None

    return Worker(), Env(), Trainer(), counts, table


#: ``SimScenario`` fields of the previous default staleness policy (greedy admission, weights
#: applied at the pause, no fresh start, no hold)
LAZY_POLICY = {"weight_apply": "at_batch", "fresh_start": False, "admission": "greedy",
               "domain_mix": "weight", "hold_batch_for_groups": False}


def _controller(batch: int, alpha: int, steps: int, seed: int, hold: asyncio.Event | None
                ) -> tuple[Any, list[int]]:
    from rollart.sim.env import SimReward
    from rollart.sim.harness import SimDomain, SimPool, SimScenario, scenario_of
    from rollart.sim.workload import SimTokenizer, counter_rng

    worker, env, trainer, counts, table = _stand_ins(hold)
    # The previous default staleness policy, spelled out where the tree has the field: what
    # is measured runs the greedy (alpha + 1) x batch in flight, the same in both trees.
    known = {f.name for f in dataclasses.fields(SimScenario)}
    lazy = {k: v for k, v in LAZY_POLICY.items() if k in known}
    sim = SimScenario(pools=(SimPool("sim", "h800", 1),),
                      domains=(SimDomain(table.domains[0], "sim"),), mode="rollart",
                      alpha=alpha, steps=steps, batch_size=batch, group_size=8,
                      max_turns=TURNS, max_tokens_per_turn=64,
                      max_tokens_per_trajectory=CONTEXT + 4096, env_hosts=1, **lazy)
    scenario = scenario_of(sim, seed)
    reward, tokenizer = SimReward(rng=counter_rng), SimTokenizer(table)
    try:
        from rollart.controller.build import Backends, build_controller
    except ImportError:  # a --baseline tree from before build_controller: wired as it wires
        return _controller_by_hand(scenario, worker, env, reward, trainer, tokenizer), counts
    backends = Backends(pools={"sim": [worker]}, trainer=trainer, tokenizer=tokenizer,
                        env_hosts=[env], reward_service=reward)
    return build_controller(scenario, backends), counts


def _controller_by_hand(scenario: Any, worker: Any, env: Any, reward: Any, trainer: Any,
                        tokenizer: Any) -> Any:
    """``build_controller(scenario, backends)`` for baseline trees that predate it."""
    from rollart.controller.controller import Controller
    from rollart.controller.routing.proxy import LLMProxy
    from rollart.controller.routing.routers import EnvRouter, RewardRouter

    proxy = LLMProxy({"sim": ("h800", [worker])}, {"zero": "sim"},
                     max_generate_in_flight=scenario.run.max_generate_in_flight)
    return Controller(scenario, proxy=proxy, envs=EnvRouter([env]),
                      rewards=RewardRouter(service=reward), trainer=trainer, tokenizer=tokenizer)


async def _cpu(n_inflight: int, steps: int, seed: int) -> dict[str, float]:
    from rollart.controller.observe.loophealth import GcPauses, freeze_startup_objects, tune_gc

    batch = max(8, n_inflight // 2)
    controller, counts = _controller(batch, 1, steps + 1, seed, None)
    thresholds = gc.get_threshold()
    tune_gc()  # the collector policy `rollart run` gives the controller (launcher/run.py)
    pauses = GcPauses().install()
    try:
        await controller.start()
        freeze_startup_objects()
        await controller.step()  # warm-up: the first batch
        done0 = controller.buffer.stats().completed
        pauses.reset()
        gens0, cpu0 = counts[0], time.thread_time()
        for _ in range(steps):
            await controller.step()
        cpu = time.thread_time() - cpu0
        gc_s = pauses.total_s
        gens, done = counts[0] - gens0, controller.buffer.stats().completed - done0
    finally:
        await controller.close()
        pauses.remove()
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    return {"loop_cpu_us_per_turn": 1e6 * cpu / max(1, gens),
            "loop_cpu_us_per_traj": 1e6 * cpu / max(1, done), "turns": gens,
            "completed": done, "gc_pause_us_per_traj": 1e6 * gc_s / max(1, done)}


@contextlib.asynccontextmanager
async def _parked(n: int, seed: int) -> AsyncIterator[int]:
    """A controller with ``n`` admitted trajectories parked in their first env step (after a
    ``gc.collect()``); yields how many parked, and stops the controller on exit."""
    hold = asyncio.Event()
    controller, counts = _controller(n // 2, 1, 2, seed, hold)  # in flight: 2 x batch
    await controller.start()
    stepping = asyncio.create_task(controller.step())
    try:
        for _ in range(100_000):  # every admitted trajectory reaches its first env step
            await asyncio.sleep(0)
            if counts[1] >= n and controller.num_running >= n:
                break
        gc.collect()
        yield counts[1]
    finally:
        stepping.cancel()
        await asyncio.gather(stepping, return_exceptions=True)
        hold.set()
        await controller.close()


async def _parked_objects(n: int, seed: int) -> tuple[int, int]:
    """(GC-tracked objects, trajectories parked) with ``n`` admitted trajectories parked in
    their first env step."""
    async with _parked(n, seed) as parked:
        return len(gc.get_objects()), parked


async def _parked_bytes(n: int, seed: int) -> tuple[int, int]:
    """(bytes traced by ``tracemalloc`` and still held, trajectories parked) with ``n``
    admitted trajectories parked in their first env step."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        async with _parked(n, seed) as parked:
            return tracemalloc.get_traced_memory()[0] - base, parked
    finally:
        tracemalloc.stop()


def _completion_us(seed: int) -> float:
    import array

    from rollart.controller.buffer.sample import Sample
    from rollart.controller.rollout import trajectory as traj_mod
    from rollart.controller.training.remote import to_train_samples, trainable_problem

    n = CONTEXT + TURNS * (RESPONSE + OBSERVATION)
    mask = array.array("b", bytes(n))
    for t in range(TURNS):
        start = CONTEXT + t * (RESPONSE + OBSERVATION)
        for k in range(start, start + RESPONSE):
            mask[k] = 1
    ids = array.array("i", [1000]) * n
    gen_lps = array.array("f", [-0.5] * (TURNS * RESPONSE)).tobytes()
    gen_versions = bytes(4 * TURNS * RESPONSE)
    # Trees whose running trajectory kept generated-only arrays but whose Sample held them per
    # token spread them at completion (``trajectory.spread_generated``): that is their cost.
    spread = getattr(traj_mod, "spread_generated", None)
    times = []
    # A controller holds completed samples until a batch trains them, so each completion's
    # arrays are fresh memory (page faults included), not the pages the previous one freed.
    held = []
    for i in range(COMPLETION_ITERS):
        # fresh arrays per sample (a sample remembers its check), built outside the timing,
        # as the trajectory leaves them: ids and mask per token, logprobs and versions per
        # generated token (bytearrays)
        fields = [(array.array("i", ids), array.array("b", mask), bytearray(gen_lps),
                   bytearray(gen_versions)) for _ in range(GROUP)]
        t0 = time.thread_time()
        group = []
        for k, (ids_k, mask_k, lps_k, versions_k) in enumerate(fields):
            if spread is not None:
                lps_k, versions_k = spread(mask_k, lps_k, versions_k)
            group.append(Sample(sample_id=f"g{i}/{k}", group_key=f"g{i}", reward=float(k % 2),
                                token_ids=ids_k, loss_mask=mask_k, behaviour_logprobs=lps_k,
                                versions=versions_k))
        for s in group:
            trainable_problem(s)
        to_train_samples(group)
        times.append((time.thread_time() - t0) / GROUP)
        held.append(group)
    return 1e6 * statistics.median(times)


async def _measure(n_inflight: int, steps: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = await _cpu(n_inflight, steps, seed)
    half = n_inflight // 2
    a, pa = await _parked_objects(half, seed)
    b, pb = await _parked_objects(n_inflight, seed)
    out["gc_objects_per_traj"] = (b - a) / max(1, pb - pa)
    await _parked_bytes(half, seed)  # one-time allocations (caches, lazy imports) not counted
    a, pa = await _parked_bytes(half, seed)
    b, pb = await _parked_bytes(n_inflight, seed)
    out["held_bytes_per_prompt_token"] = (b - a) / max(1, pb - pa) / CONTEXT
    out["completion_us"] = _completion_us(seed)
    return out


# ------------------------------------------------------------------ parent: pairs of children


def _baseline_src(ref: str, into: Path) -> Path:
    """``ref``'s ``src/`` extracted under ``into``. Raises CalledProcessError for a bad ref."""
    archive = subprocess.run(["git", "-C", str(_ROOT), "archive", ref, "src"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def _run_child(src: Path, n: int, steps: int, seed: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{_ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.trajectory_cpu", "--child", str(n), str(steps),
         str(seed)], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child on {src} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


FIGURES = ("loop_cpu_us_per_turn", "loop_cpu_us_per_traj", "completion_us",
           "gc_objects_per_traj", "gc_pause_us_per_traj", "held_bytes_per_prompt_token")


def run(quick: bool, seed: int, baseline: str, repeats: int) -> dict[str, Any]:
    started = time.perf_counter()
    n, steps = (256, 4) if quick else (512, 8)
    sides: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": _baseline_src(baseline, Path(tmp)), "after": _ROOT / "src"}
        for r in range(repeats):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for side in order:
                sides[side].append(_run_child(trees[side], n, steps, seed + r))
    rows, ratios, intervals = [], {}, {}
    for side in ("before", "after"):
        row: dict[str, Any] = {"name": side, "tree": baseline if side == "before" else "this"}
        for fig in FIGURES:
            row[fig] = statistics.median(x[fig] for x in sides[side])
        row["turns_per_repeat"] = statistics.median(x["turns"] for x in sides[side])
        rows.append(row)
    for fig in FIGURES:
        paired = [b[fig] / a[fig] for b, a in zip(sides["before"], sides["after"], strict=True)
                  if a[fig] > 0]
        if paired:
            ratios[f"{fig} before/after"], intervals[f"{fig} before/after"] = ci95(paired)
    for side in ("before", "after"):
        for fig in FIGURES:
            ratios[f"{fig} {side}"], intervals[f"{fig} {side}"] = ci95(
                [x[fig] for x in sides[side]])
    return result(NAME, simulated=False, rows=rows, ratios=ratios, ci95=intervals, quick=quick,
                  seed=seed, started=started, seeds=[seed + r for r in range(repeats)],
                  notes=f"{n} trajectories in flight, {steps} measured steps per child; before "
                        f"= git {baseline}, after = this tree; {repeats} alternating repeats")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(_child(int(argv[1]), int(argv[2]), int(argv[3]))))
        return None
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__)
    p.add_argument("--quick", action="store_true", help="256 trajectories in flight, 4 steps")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default="main", help="git ref measured as 'before'")
    p.add_argument("--repeats", type=int, default=None,
                   help="alternating before/after pairs (default 3 with --quick, else 5)")
    args = p.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    if repeats < 2:
        p.error("--repeats must be >= 2 (an interval needs two)")
    check = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "--verify", "--quiet",
                            f"{args.baseline}^{{commit}}"], capture_output=True, check=False)
    if check.returncode != 0:
        p.error(f"--baseline {args.baseline!r} is not a commit of the git repository at "
                f"{_ROOT} (the 'before' side is that commit's src/)")
    res = run(args.quick, args.seed, args.baseline, repeats)
    emit(res, args.json)
    return res


if __name__ == "__main__":
    main()
