"""``controller_overhead``: the controller's own cost per turn, measured (NOT simulated time).

The real controller runs on uvloop and talks over real ZeroMQ (``InferenceClient`` /
``EnvClient``) to worker and env processes serving simulated backends that answer at once
(``python -m rollart.sim.serve ... --time-scale 0``). Whatever time a turn takes is therefore
the controller plus transport: trajectory coroutine, LLM proxy routing, buffer bookkeeping,
message encode/decode and two RPC round trips (generate, env step).

Reported at N concurrent trajectories (rollart mode, alpha 1, batch N/2, so about N are in
flight): turns/s over the run, the generate round trip p50/p99, and the per-turn controller gap
p50/p99 = time from a generate reply to the same trajectory's next generate call (it contains
one env-step round trip plus the controller's bookkeeping). Default N = 1k and 10k; ``--quick``
256 and 1k. All processes share this machine's cores, so the numbers are an upper bound.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks.common import main_for, result
from rollart.controller.controller import Controller
from rollart.controller.proxy import LLMProxy
from rollart.controller.services import EnvRouter, RewardRouter
from rollart.envhost.client import EnvClient
from rollart.inference.client import InferenceClient
from rollart.sim.env import SimReward
from rollart.sim.hardware import H800
from rollart.sim.harness import SimDomain, SimPool, SimScenario, scenario_of
from rollart.sim.models import QWEN3_8B
from rollart.sim.trainer import SimTrainer
from rollart.sim.workload import DomainSpec, DomainTable, SimTokenizer, const
from rollart.transport import messages as m

NAME = "controller_overhead"
TURNS = 4
DOMAIN_ARGS = ["--domain", "zero", "--prompt-tokens", "64", "--obs-tokens", "16",
               "--response-tokens", "16", "--turns", str(TURNS)]


def _spec() -> DomainSpec:
    return DomainSpec("zero", prompt_tokens=const(64), obs_tokens=const(16),
                      response_tokens=const(16), num_turns=const(TURNS))


class TimedWorker:
    """Measures each generate round trip of a real client (delegates everything else)."""

    def __init__(self, client: InferenceClient, log: dict[str, tuple[float, float]]) -> None:
        self._client, self._log = client, log
        self.name = client.name

    @property
    def dead(self) -> bool:
        return self._client.dead

    @property
    def last_stats(self) -> m.WorkerStats | None:
        return self._client.last_stats

    async def generate(self, request: m.Generate, *, timeout_s: float | None = None
                       ) -> m.GenerateResult:
        t0 = time.perf_counter()
        res = await self._client.generate(request, timeout_s=timeout_s)
        self._log[request.request_id] = (t0, time.perf_counter())
        return res

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _spawn(kind: str, name: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rollart.sim.serve", kind, "--name", name, *DOMAIN_ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.match(r"ADDRESS (\S+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"{name}: expected 'ADDRESS ...', got {line!r}")
    return proc, match.group(1)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _measure(n: int, worker_addrs: list[str], env_addr: str, seed: int) -> dict[str, Any]:
    table = DomainTable([_spec()])
    batch = max(8, n // 2 // 8 * 8)
    sim = SimScenario(pools=(SimPool("sim", "h800", len(worker_addrs)),),
                      domains=(SimDomain(_spec(), "sim"),), mode="rollart", alpha=1, steps=3,
                      batch_size=batch, group_size=8, max_turns=TURNS,
                      max_tokens_per_turn=64, max_tokens_per_trajectory=4096)
    log: dict[str, tuple[float, float]] = {}
    clients = [InferenceClient(a, name=f"w{i}", liveness_timeout_s=60.0)
               for i, a in enumerate(worker_addrs)]
    workers = [TimedWorker(c, log) for c in clients]
    env = EnvClient(env_addr, name="env", liveness_timeout_s=60.0)
    trainer = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, time_scale=0.0,
                         weights=lambda: [("w", torch.zeros(16))])
    controller = Controller(
        scenario_of(sim, seed), proxy=LLMProxy({"sim": ("h800", workers)}, {"zero": "sim"}),
        envs=EnvRouter([env]), rewards=RewardRouter(service=SimReward()), trainer=trainer,
        tokenizer=SimTokenizer(table))
    t0 = time.perf_counter()
    peak = 0
    try:
        for _ in range(sim.steps):
            step = asyncio.ensure_future(controller.step())
            while not step.done():
                peak = max(peak, controller.num_running)
                await asyncio.sleep(0.05)
            await step
    finally:
        wall = time.perf_counter() - t0
        await controller.close()
        for c in clients:
            await c.close()
        await env.close()
    rtt = [end - start for start, end in log.values()]
    by_traj: dict[str, dict[int, tuple[float, float]]] = defaultdict(dict)
    for rid, span in log.items():
        traj, _, turn = rid.rpartition("/t")
        by_traj[traj][int(turn)] = span
    gaps = [turns[t][0] - turns[t - 1][1] for turns in by_traj.values() for t in turns
            if t - 1 in turns]
    return {"concurrent_target": n, "peak_running": peak, "turns": len(log), "wall_s": wall,
            "turns_per_s": len(log) / wall, "us_per_turn": 1e6 * wall / max(1, len(log)),
            "gen_rtt_p50_ms": 1e3 * _pct(rtt, 0.5),
            "gen_rtt_p99_ms": 1e3 * _pct(rtt, 0.99), "turn_gap_p50_ms": 1e3 * _pct(gaps, 0.5),
            "turn_gap_p99_ms": 1e3 * _pct(gaps, 0.99)}


def _one_size(n: int, seed: int, runner: Any) -> dict[str, Any]:
    procs = []
    try:
        worker_addrs = []
        for i in range(2):
            proc, addr = _spawn("worker", f"sim-worker-{i}")
            procs.append(proc)
            worker_addrs.append(addr)
        proc, env_addr = _spawn("env", "sim-env")
        procs.append(proc)
        return runner(_measure(n, worker_addrs, env_addr, seed))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(quick: bool, seed: int) -> dict:
    import uvloop

    started = time.perf_counter()
    # Fresh processes per size: the workers keep the weight version the last run reached.
    rows = [_one_size(n, seed, uvloop.run) for n in ((256, 1024) if quick else (1000, 10_000))]
    ratios = {f"turns/s at {r['concurrent_target']}": r["turns_per_s"] for r in rows}
    ratios.update({f"turn gap p99 ms at {r['concurrent_target']}": r["turn_gap_p99_ms"]
                   for r in rows})
    return result(NAME, simulated=False, rows=rows, ratios=ratios, quick=quick, seed=seed,
                  started=started, notes="measured wall time; backends are zero-latency "
                  "simulated processes over real ZeroMQ; controller on uvloop; 2 worker "
                  "processes + 1 env process share the machine's cores")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
