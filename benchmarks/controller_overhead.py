"""``controller_overhead``: what one controller process costs per turn, measured (NOT simulated).

The real controller (uvloop, the launcher's garbage-collection policy) drives N concurrent
trajectories over the real ZeroMQ RPC to two backend processes (``benchmarks.overhead_serve``):
a SIMULATED inference worker that answers at once with 4 tokens, and a SIMULATED env host whose
steps really sleep (asyncio) a lognormal latency, mean 10 s and std 10 s (the mean is issue
11's "realistic env latency"; std 10 s is the widest setting of the paper's Fig. 11b). Each
trajectory opens with a ``context_tokens`` prompt (32k: long agentic contexts, where per-token
costs show) and runs ``turns`` turns; batches of 512 samples (groups of 8) with alpha just large
enough that all N trajectories fit the in-flight bound. Session opens sleep uniform(0, 20 s), so
trajectories start spread out, and each turn's latency is drawn independently: the offered load
(about N / 10 s turns per second) does not depend on how fast the controller answers (open
loop), so the latency below is the controller's, not queueing behind a closed loop, as long as
the controller keeps up. Only the window after ``warmup_s`` counts.

Per N it reports:

- ``cpu_us_per_turn``: controller-process CPU seconds (``time.process_time``: all its threads,
  ZeroMQ's I/O thread included) / turns started (generate calls, less those resent after
  ``prefix_unknown``), over the window; percentile-bootstrap
  ci95 over 5 s sub-windows. ``loop_sleeps_per_turn``: how often the event-loop thread blocked
  with nothing to do and was woken again (its voluntary context switches, ``getrusage``) per
  turn: near 0 the loop is busy and each wake-up handles many messages (the per-message
  costs of a wake-up are shared); near 1 or more messages trickle in one per wake-up and each
  pays them alone. The same work costs several times more CPU per RPC in the second regime
  (``rpc_overhead``: 1 vs 1024 calls in flight). Trajectory completions and training steps in
  the window are included (and the in-process SIMULATED trainer and reward, which cost next
  to nothing).
  ``loop_thread_cpu_us_per_turn``: the event-loop thread's share of it (the rest is ZeroMQ's
  I/O thread, CURVE encryption included, and helper threads).
- ``added_latency_p50/p99_ms``: a backend's reply leaving its handler -> the same trajectory's
  next request entering the other backend's handler (env step reply -> next generate; generate
  reply -> env step), ``time.monotonic`` of one host in both processes; it contains both RPC
  legs' encode / transport / decode and the controller's work. ci95 of the p99: distribution-
  free order-statistic interval. A turn the staleness check told to ``wait`` for new weights
  waits by design, not for the controller: the time it spent in ``wait_for_weights`` is taken
  out of its gap and reported apart (``weight_wait_turns``, ``weight_wait_share`` of the env ->
  generate gaps, ``weight_wait_p50_ms``).
- ``prefix_resends`` / ``prefix_resends_per_turn``: turns the SIMULATED worker refused with
  ``prefix_unknown`` and the controller sent again with the whole context (a turn counts
  once either way). The worker's prefix store holds every in-flight trajectory's whole
  sequence (``(alpha + 1) x batch x (context + 4096)`` tokens), so this is 0; until
  2026-12-02 it kept its default 16 Mi tokens, evicted at 10k trajectories, and nearly every
  later turn was a refused call plus a resend of the whole context, counted as two turns.
- ``lost_replies``: calls whose reply never came: calls of the controller's two RPC clients
  that ended in ``RemoteTimeoutError`` (generate 20 s, env 90 s, heartbeats included) less
  those whose reply arrived after the timeout (``late_replies``: slow, e.g. read by a starved
  loop, not lost; ``RpcClient.num_late_replies``), counted once the generate calls open at
  the window's end have ended (they get their timeout + 15 s), plus those still open then.
  ``timeouts``: all the calls that timed out, late replies included.
- ``rss_bytes_per_traj`` / ``rss_bytes_per_token``: controller RSS growth (peak in the window
  minus before start) per trajectory / per context token of N trajectories;
  ``worker_rss_bytes_per_token``: the SIMULATED worker process's peak RSS per context token
  (it keeps every trajectory's prefix for delta prompts, 4 bytes per token; for the memory
  estimate only).
- ``loop_lag_p99_ms`` (:class:`~rollart.controller.observe.loophealth.LoopLagMonitor`) and garbage
  collection pause seconds per generation / longest pause (``gc.callbacks``).
- ``load_processes`` / ``loadavg_1min`` (rows and ratios): ``--load N`` starts N pure-Python
  busy loops (other processes, normal priority) for the whole run, to show that overload
  slows the controller but loses no reply; the 1-minute load average (``/proc/loadavg``) is
  read at the end of each size.
- the floor beside it (``benchmarks.rpc_floor.measure_floor``): a bare uvloop
  ``asyncio.Protocol`` echo of length-prefixed msgspec frames in a child process, the client's
  CPU per call at 256 in flight (``floor_cpu_us_per_rpc``) and at one in flight
  (``floor_cpu_us_per_rpc_one_in_flight``: the floor for replies that trickle in one per
  wake-up), its calls/s, and the mean round trip at one in flight; one turn is two RPCs, so
  ``2 x floor_cpu_us_per_rpc`` is the transport floor of ``cpu_us_per_turn``.

Capacity: at low load (N = 1000 at 10 s per env step) replies trickle in one per wake-up,
and each RPC pays a wake-up's fixed costs alone (``loop_sleeps_per_turn`` above 1): that is
the cost of a turn at that load, not what bounds scale. The last size of each run is meant to
saturate the controller instead: N = 2000 with 0.2 s env steps (mean = std, sessions opened
over 0.4 s) offers ~10,000 turns/s, so on a machine with cores to spare for the SIMULATED
backends the loop never sleeps (``loop_sleeps_per_turn`` near 0), ``turns_per_s`` is the
controller's capacity at the CPU share it got and ``cpu_us_per_turn`` its cost per turn there
(its ratios are ``at 2000``, with ``env_mean_s at 2000``). On the 2-core dev machine the
backends bind first (they needed 0.93 of a core at ~1000 turns/s). One controller core drives
``10 s x 1e6 / cpu_us_per_turn`` concurrent trajectories at 10 s per env step.

Sizes: ``--quick`` N = 1000 at 32k and N = 10000 at 16k contexts, 3 turns, 70 s and 90 s
(the full run's 10000 x 32k takes ~3.4 GiB: controller and SIMULATED worker ~5 B per
context token each), then the saturating size at 16k (40 s); default N = 1000, 10000,
50000 at 32k, 8 turns, then the saturating size at 32k, 8 turns (90 s). A size whose
estimated memory (controller and SIMULATED worker, per token as measured at the previous
size) leaves less than ``MEMORY_HEADROOM`` (3 GiB) of available memory is skipped and its
row says what it needs. Every process
shares the machine's cores: the controller gets what the scheduler leaves it
(``cpu_share_of_core``), and once the offered load needs more than that the latency and lag
are queueing. Each row therefore also says what else used the machine in
the window: ``worker_cpu_share_of_core`` / ``env_cpu_share_of_core`` (the SIMULATED backends'
processes, all threads) and, from ``/proc/stat``, ``machine_busy_share``, ``machine_idle_share``
and ``machine_steal_share`` (on a VM, the share of CPU time the hypervisor gave to others: the
wall-clock figures, latency, lag and GC pauses, stretch with it while CPU-time figures do not;
``gc_cpu_s`` is the collector's own CPU time per generation beside the pauses ``gc_s``).
``CONTROLLER_OVERHEAD_GC=default`` runs with CPython's default
collector policy instead (to measure before/after), ``=G0,G1,G2`` given thresholds.
``CONTROLLER_OVERHEAD_PIN=1`` pins the controller to one CPU and the SIMULATED backends to the
others (``_pinning``; rows say ``pinned``): the production layout, where the controller has
its cores to itself, as far as a small machine allows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import math
import multiprocessing
import os
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil
import torch

from benchmarks import overhead_serve as srv
from benchmarks.common import main_for, result
from benchmarks.rpc_floor import measure_floor
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.build import Backends, build_controller
from rollart.controller.controller import Controller
from rollart.controller.observe.loophealth import (
    GcPauses,
    LoopLagMonitor,
    freeze_startup_objects,
    tune_gc,
)
from rollart.envhost.client import EnvClient
from rollart.inference.client import InferenceClient
from rollart.sim.env import SimReward
from rollart.sim.hardware import H800
from rollart.sim.harness import SimDomain, SimPool, SimScenario, scenario_of
from rollart.sim.models import QWEN3_8B
from rollart.sim.trainer import SimTrainer
from rollart.sim.workload import DomainTable, SimTokenizer, counter_rng
from rollart.transport import messages as m
from rollart.transport.rpc import RpcClient
from rollart.transport.security import create_key_file, load_key_file

NAME = "controller_overhead"
#: mean (and std) env step latency, s: a realistic agentic env step (the controller's goals)
ENV_MEAN_S = 10.0
GENERATE_TIMEOUT_S = 20.0
#: ``max_tokens_per_trajectory`` = context + this (room for the turns' tokens)
EXTRA_TOKENS = 4096
#: trajectories per GRPO group
GROUP_SIZE = 8
SUBWINDOW_S = 5.0
PROFILE_ENV = "CONTROLLER_OVERHEAD_PROFILE"
#: set to 1 for the controller-side latency split (``ControllerSide``)
SPLIT_ENV = "CONTROLLER_OVERHEAD_SPLIT"
#: set to 1 to pin the controller to the first CPU and the SIMULATED backends to the others
#: (``_pinning``)
PIN_ENV = "CONTROLLER_OVERHEAD_PIN"
#: controller bytes per held context token assumed before one size was measured (main's code:
#: token ids, loss mask, logprobs and versions as Python lists, 8 B per slot each)
BYTES_PER_TOKEN_GUESS = 40.0
#: available memory a size must leave by its estimate (transients, the other processes); the
#: send window bounds the start-up burst, without which a 50k run reached 21 GB and stopped
MEMORY_HEADROOM = 3 << 30


@dataclass(frozen=True)
class Size:
    """One run: ``n`` trajectories of ``turns`` turns on ``context_tokens``-token prompts, env
    steps lognormal with mean = std = ``env_mean_s`` (sessions open spread over
    ``2 x env_mean_s``, steps clipped at ``6 x env_mean_s``), measured for ``duration_s`` after
    ``warmup_s``."""

    n: int
    context_tokens: int
    turns: int
    duration_s: float
    warmup_s: float
    env_mean_s: float = ENV_MEAN_S


# Quick: 3 turns, so trajectories (~20 s open spread + 3 x 10 s) complete and steps train
# inside the window and per-completion costs are counted too. The last size is meant to
# saturate the controller (2000 trajectories offer ~10,000 turns/s at 0.2 s per env step):
# its CPU per turn is then the controller's capacity (see the module docstring). The sizes of
# a run have distinct N: the JSON ratios are named by it.
QUICK = (Size(1000, 32768, 3, 70.0, 20.0), Size(10_000, 16384, 3, 90.0, 30.0),
         Size(2000, 16384, 3, 40.0, 15.0, env_mean_s=0.2))
# The 50k size warms up for 100 s: on a 2-core machine its start-up (50k x 32k-token first
# prompts, 6.4 GiB, through the send window into one SIMULATED worker) lasted ~70 s.
FULL = (Size(1000, 32768, 8, 150.0, 30.0), Size(10_000, 32768, 8, 180.0, 40.0),
        Size(50_000, 32768, 8, 300.0, 100.0), Size(2000, 32768, 8, 90.0, 30.0, env_mean_s=0.2))


class Calls:
    """Controller-side record of the backends' calls: turns started, sessions' trajectories,
    waits for weights. Timeouts, late replies and open calls are the RPC clients' own
    (``RpcClient.num_timeouts`` / ``num_late_replies`` / its pending calls): the measured
    process carries no coroutine or dict entry per call for the benchmark."""

    def __init__(self) -> None:
        #: generate calls started (resends after ``prefix_unknown`` included)
        self.num_gens = 0
        self.session_traj: dict[str, str] = {}
        #: trajectory id -> (start, end) of each wait for new weights (a ``wait`` verdict)
        self.weight_waits: dict[str, list[tuple[float, float]]] = {}

    def record_weight_waits(self, wait: Any) -> Any:
        """``wait`` (the trajectories' ``wait_for_weights``), recording each wait's span."""

        async def recorded(version: int) -> None:
            task = asyncio.current_task()
            t0 = time.monotonic()
            try:
                await wait(version)
            finally:
                if task is not None and task.get_name().startswith("traj-"):
                    self.weight_waits.setdefault(task.get_name()[len("traj-"):], []).append(
                        (t0, time.monotonic()))

        return recorded


class ControllerSide:
    """Controller-side times of every generate and env-step call (``$CONTROLLER_OVERHEAD_SPLIT``
    = 1): when the controller handed the request to its RPC client (it leaves in that loop
    pass's flush) and when the client read the reply off its socket. With them the gap
    "reply arrived -> next request sent" is measured inside the controller process, without
    the two backends' own halves of each leg (their receive and send paths, on the same cores)
    that ``added_latency`` contains. It patches ``RpcClient.submit_call`` and ``_on_reply``
    for the clients created while installed and keeps a dict entry per call, so it costs the
    measured process a few us per call and memory per call: opt-in, not in the default run.
    Env opens are not recorded (the first gap of a trajectory is left out). With the backends'
    handler times it also splits each call's transport into its two legs (``_legs``:
    ``request_leg_p50/p99_ms``, ``reply_leg_p50/p99_ms``), so an ``added_latency`` gap =
    the previous call's reply leg + the controller-side gap + the next call's request leg."""

    def __init__(self) -> None:
        #: (client id, call id) -> ("g", request id) or ("e", session id), sent at
        self.sent: dict[tuple[int, bytes], tuple[str, str, float]] = {}
        #: (client id, call id) -> reply read at
        self.got: dict[tuple[int, bytes], float] = {}
        self._saved: tuple[Any, Any] | None = None

    def install(self) -> None:
        submit, on_reply = RpcClient.submit_call, RpcClient._on_reply
        self._saved = (submit, on_reply)
        sent, got = self.sent, self.got

        def timed_submit(rpc: RpcClient, msg: m.Msg, **kw: Any) -> Any:
            call_id, fut = submit(rpc, msg, **kw)
            if type(msg) is m.Generate:
                sent[(id(rpc), call_id)] = ("g", msg.request_id, time.monotonic())
            elif type(msg) is m.EnvStep:
                sent[(id(rpc), call_id)] = ("e", msg.session_id, time.monotonic())
            return call_id, fut

        def timed_reply(rpc: RpcClient, parts: list) -> None:
            got[(id(rpc), bytes(parts[0]))] = time.monotonic()
            on_reply(rpc, parts)

        RpcClient.submit_call = timed_submit  # type: ignore[method-assign]
        RpcClient._on_reply = timed_reply  # type: ignore[method-assign]

    def remove(self) -> None:
        if self._saved is not None:
            RpcClient.submit_call, RpcClient._on_reply = self._saved  # type: ignore[method-assign]
            self._saved = None

    def __enter__(self) -> ControllerSide:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def records(self) -> tuple[srv.Records, srv.Records]:
        """(generate, env step) calls as ``overhead_serve.Records``, times taken at the
        controller: ``t_in`` = request sent, ``t_out`` = reply read (calls without a reply
        left out; a turn resent after ``prefix_unknown`` runs from its first send to its last
        reply). Env steps are numbered per session in send order."""
        first_sent: dict[str, float] = {}  # request id -> its first send (a resend is later)
        gen: dict[str, tuple[str, int, float, float]] = {}
        env: list[tuple[str, int, float, float]] = []
        steps: dict[str, int] = {}
        for k, (kind, key, t_in) in sorted(self.sent.items(), key=lambda kv: kv[1][2]):
            if kind == "e":
                turn = steps[key] = steps.get(key, -1) + 1
            else:
                t_in = first_sent.setdefault(key, t_in)
            t_out = self.got.get(k)
            if t_out is None:
                continue
            if kind == "g":
                gen[key] = (key, -1, t_in, t_out)  # the last reply: the one that served it
            else:
                env.append((key, turn, t_in, t_out))
        return srv.Records(calls=list(gen.values())), srv.Records(calls=env)


class TimedWorker:
    """An ``InferenceClient`` whose generate calls are recorded in ``Calls``."""

    def __init__(self, client: InferenceClient, calls: Calls) -> None:
        self._client, self._calls = client, calls
        self.name = client.name

    @property
    def dead(self) -> bool:
        return self._client.dead

    @property
    def last_stats(self) -> m.WorkerStats | None:
        return self._client.last_stats

    def generate(self, request: m.Generate, *, timeout_s: float | None = None
                 ) -> Awaitable[m.GenerateResult]:
        # A plain function: the caller awaits the client's own coroutine, so the count adds
        # no coroutine to the measured process.
        self._calls.num_gens += 1
        return self._client.generate(request, timeout_s=timeout_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class TimedEnv:
    """An ``EnvClient`` that maps sessions to trajectories (the calling task's name)."""

    def __init__(self, client: EnvClient, calls: Calls) -> None:
        self._client, self._calls = client, calls
        self.name = client.name

    @property
    def dead(self) -> bool:
        return self._client.dead

    async def open(self, *args: Any, **kwargs: Any) -> m.EnvOpened:
        task = asyncio.current_task()
        opened = await self._client.open(*args, **kwargs)
        if task is not None and task.get_name().startswith("traj-"):
            self._calls.session_traj[opened.session_id] = task.get_name()[len("traj-"):]
        return opened

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _spawn(argv: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.overhead_serve", *argv],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.match(r"ADDRESS (\S+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"overhead_serve {argv[0]}: expected 'ADDRESS ...', got {line!r}")
    return proc, match.group(1)


@contextlib.contextmanager
def _pinning(backend_pids: list[int]) -> Any:
    """With ``$CONTROLLER_OVERHEAD_PIN`` = 1 on a machine of 2 CPUs or more: this process (the
    controller, all its threads) on the first CPU it may use, the backend processes on the
    others, restored on exit. A production controller has its host's cores to itself and its
    env hosts and workers run elsewhere; on a small machine, unpinned, every process's threads
    queue for the same cores and the latency tail measures that queueing. Yields whether it
    pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    if os.environ.get(PIN_ENV) != "1" or len(cpus) < 2:
        yield False
        return
    for pid in backend_pids:
        psutil.Process(pid).cpu_affinity(cpus[1:])
    os.sched_setaffinity(0, cpus[:1])
    try:
        yield True
    finally:
        os.sched_setaffinity(0, cpus)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _pct(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return float("nan")
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))]


def _pct_ci95(sorted_xs: list[float], q: float) -> list[float]:
    """Distribution-free 95% interval of the q-quantile (normal approx. to the binomial rank)."""
    n = len(sorted_xs)
    if n == 0:
        return [float("nan"), float("nan")]
    half = 1.96 * math.sqrt(n * q * (1 - q))
    lo, hi = max(0, math.floor(n * q - half) - 1), min(n - 1, math.ceil(n * q + half) - 1)
    return [sorted_xs[lo], sorted_xs[hi]]


def _ratio_ci95(num: list[float], den: list[float], seed: int) -> list[float]:
    """Percentile-bootstrap 95% interval of ``sum(num) / sum(den)`` over sub-windows."""
    k = len(num)
    if k < 2:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    stats = []
    for _ in range(2000):
        idx = [rng.randrange(k) for _ in range(k)]
        d = sum(den[i] for i in idx)
        if d > 0:
            stats.append(sum(num[i] for i in idx) / d)
    stats.sort()
    return [stats[int(0.025 * len(stats))], stats[int(0.975 * len(stats)) - 1]]


def _profiler() -> Any:
    """A running ``cProfile.Profile`` of the controller's window when ``$CONTROLLER_OVERHEAD_PROFILE``
    names a path prefix (stats go to ``<prefix>.<N>``), else None. It slows the controller, so
    a profiled run's figures are not the benchmark's."""
    if not os.environ.get(PROFILE_ENV):
        return None
    import cProfile

    # The main thread's CPU time: wall time would charge preemption by other processes (and
    # the I/O thread) to whatever function was running.
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    return profiler


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _proc_stat() -> list[int] | None:
    """The machine's cumulative CPU jiffies from ``/proc/stat``'s ``cpu`` line (user, nice,
    system, idle, iowait, irq, softirq, steal), or None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return [int(x) for x in fields[1:9]] if fields[:1] == ["cpu"] else None


def _machine_shares(before: list[int] | None, after: list[int] | None) -> dict[str, float]:
    """Shares of the machine's CPU time over a window: ``machine_busy_share`` (user + nice +
    system + irq + softirq), ``machine_idle_share`` (idle + iowait) and ``machine_steal_share``
    (time a hypervisor gave this VM's virtual CPUs to others: on a VM, wall-clock figures such
    as latencies and pauses stretch with it). Empty where ``/proc/stat`` is missing."""
    if before is None or after is None:
        return {}
    d = [a - b for a, b in zip(after, before, strict=True)]
    total = sum(d) or 1
    return {"machine_busy_share": (d[0] + d[1] + d[2] + d[5] + d[6]) / total,
            "machine_idle_share": (d[3] + d[4]) / total,
            "machine_steal_share": d[7] / total}


def _cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc`` (all its threads), 0.0 once it is gone."""
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def _batch_alpha(n: int) -> tuple[int, int]:
    """Production-like batches (512 samples, 1024 from 32k trajectories on) and alpha just
    large enough that the in-flight bound ``(alpha + 1) x batch`` admits all ``n``
    trajectories (alpha >= 1: at ``n`` <= one batch the bound is two batches, 1024 at
    ``n`` = 64; above that it exceeds ``n`` by less than a batch)."""
    batch = 512 if n <= 32_768 else 1024
    return batch, max(1, math.ceil(n / batch) - 1)


def prefix_bound(size: Size) -> int:
    """The SIMULATED worker's ``--max-prefix-tokens``: every trajectory the in-flight bound
    admits, at its longest sequence (``context + EXTRA_TOKENS``). Its entry bound
    (``PrefixStore``'s default 64 Ki trajectories) covers FULL's 50,176 in flight."""
    batch, alpha = _batch_alpha(size.n)
    in_flight = SampleBuffer.groups_bound(alpha, batch, GROUP_SIZE) * GROUP_SIZE
    return in_flight * (size.context_tokens + EXTRA_TOKENS)


def _build(scenario: Any, worker: Any, env: Any, trainer: Any, table: DomainTable
           ) -> Controller:
    """The controller as a run builds it (``build_controller``: the run's default send window
    ``run.max_generate_in_flight``, as in a real run) over one worker and one env host, scored
    by the SIMULATED reward."""
    return build_controller(scenario, Backends(
        pools={"sim": [worker]}, trainer=trainer, tokenizer=SimTokenizer(table),
        env_hosts=[env], reward_service=SimReward(rng=counter_rng)))


async def _drive(size: Size, args: Namespace, worker_addr: str, env_addr: str, seed: int,
                 gc_policy: str, worker_pid: int, auth: Any, env_pid: int = 0
                 ) -> dict[str, Any]:
    split = ControllerSide() if os.environ.get(SPLIT_ENV) == "1" else None
    # Installed before the clients exist (their pumps bind ``_on_reply`` at creation) and
    # removed whatever happens.
    with split or contextlib.nullcontext():
        return await _drive_measured(split, size, args, worker_addr, env_addr, seed, gc_policy,
                                     worker_pid, auth, env_pid)


async def _drive_measured(split: ControllerSide | None, size: Size, args: Namespace,
                          worker_addr: str, env_addr: str, seed: int, gc_policy: str,
                          worker_pid: int, auth: Any, env_pid: int = 0) -> dict[str, Any]:
    table = DomainTable([srv.domain_spec(args)])
    spec = table.domains[0]
    n, group = size.n, GROUP_SIZE
    batch, alpha = _batch_alpha(n)
    sim = SimScenario(pools=(SimPool("sim", "h800", 1),), domains=(SimDomain(spec, "sim"),),
                      mode="rollart", alpha=alpha, steps=10_000, batch_size=batch,
                      group_size=group,
                      max_turns=size.turns, max_tokens_per_turn=64,
                      max_tokens_per_trajectory=size.context_tokens + EXTRA_TOKENS,
                      generate_timeout_s=GENERATE_TIMEOUT_S,
                      env_timeout_s=args.env_max_s + 30.0, env_hosts=1,
                      # the previous default staleness policy, spelled out: the size measured
                      # is the greedy in-flight bound (alpha + 1) x batch, kept full
                      weight_apply="at_batch", fresh_start=False, admission="greedy",
                      domain_mix="weight", hold_batch_for_groups=False)
    calls = Calls()
    client = InferenceClient(worker_addr, auth=auth, name="w0", liveness_timeout_s=120.0)
    env = EnvClient(env_addr, auth=auth, name="env", liveness_timeout_s=120.0)
    trainer = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, time_scale=0.0,
                         weights=lambda: [("w", torch.zeros(16))])
    scenario = scenario_of(sim, seed)
    controller = _build(scenario, TimedWorker(client, calls), TimedEnv(env, calls), trainer, table)
    proxy = controller.proxy

    def turns_now() -> int:
        # A generate call refused with ``prefix_unknown`` is sent again whole: one turn.
        return calls.num_gens - proxy.num_prefix_resends

    lag = LoopLagMonitor()
    gc_before = gc.get_threshold()
    pauses = GcPauses().install()
    steps = 0

    async def train() -> None:
        nonlocal steps
        while True:
            await controller.step()
            steps += 1

    if gc_policy == "tuned":
        tune_gc()
    elif gc_policy != "default":
        g0, g1, g2 = (int(x) for x in gc_policy.split(","))
        tune_gc((g0, g1, g2))
    await controller.start()
    # Turns told to wait for weights (the staleness bound) wait by design: that wait is
    # taken out of the gaps below and reported on its own.
    ctx = controller.trajectory_context
    assert ctx is not None
    ctx.wait_for_weights = calls.record_weight_waits(ctx.wait_for_weights)
    if gc_policy != "default":
        freeze_startup_objects()
    lag.start()
    rss0 = _rss()
    t_start = time.monotonic()
    trainer_task = asyncio.create_task(train())
    try:
        await asyncio.sleep(size.warmup_s)
        t0, cpu0, gen0, steps0 = time.monotonic(), time.process_time(), turns_now(), steps
        resends0 = proxy.num_prefix_resends
        loop_cpu0 = time.thread_time()
        sleeps0 = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        profiler = _profiler()
        pauses.reset()
        lag.take()
        peak = _rss()
        worker_proc = psutil.Process(worker_pid)
        worker_peak = worker_proc.memory_info().rss
        backends = {"worker": worker_proc, **({"env": psutil.Process(env_pid)} if env_pid else {})}
        backend_cpu0 = {k: _cpu_s(p) for k, p in backends.items()}
        stat0 = _proc_stat()
        sub_cpu: list[float] = []
        sub_turns: list[float] = []
        running: list[int] = []
        cpu_prev, gen_prev = cpu0, gen0
        while time.monotonic() < t_start + size.duration_s and not trainer_task.done():
            await asyncio.sleep(SUBWINDOW_S)
            peak = max(peak, _rss())
            worker_peak = max(worker_peak, worker_proc.memory_info().rss)
            cpu, gens = time.process_time(), turns_now()
            running.append(controller.num_running)
            sub_cpu.append(1e6 * (cpu - cpu_prev))
            sub_turns.append(gens - gen_prev)
            cpu_prev, gen_prev = cpu, gens
        t1, cpu1, gen1 = time.monotonic(), time.process_time(), turns_now()
        resends = proxy.num_prefix_resends - resends0
        loop_cpu1 = time.thread_time()
        sleeps1 = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        machine = _machine_shares(stat0, _proc_stat())
        backend_share = {f"{k}_cpu_share_of_core": (_cpu_s(p) - backend_cpu0[k]) / (t1 - t0)
                         for k, p in backends.items()}
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(f"{os.environ[PROFILE_ENV]}.{n}")
        lag_stats = lag.take()
        if trainer_task.done():
            trainer_task.result()  # a fatal error of the controller ends the run here
        stats = controller.buffer.stats()
        # Drain: every generate call open now ends within its timeout, by a reply or by
        # RemoteTimeoutError (counted); one still open well after that never will.
        # (The worker client's open calls: generate calls and heartbeats; each ends by its
        # reply or its deadline at the latest.)
        open_calls = [f for f in client._rpc._pending.values() if not f.done()]
        if open_calls:
            await asyncio.wait(open_calls, timeout=GENERATE_TIMEOUT_S + 15.0)
        stuck = sum(1 for f in open_calls if not f.done())
        rpcs = (client._rpc, env._rpc)
        timeouts = sum(c.num_timeouts for c in rpcs)
        late = sum(c.num_late_replies for c in rpcs)
    finally:
        trainer_task.cancel()
        await asyncio.gather(trainer_task, return_exceptions=True)
        pauses.remove()
        # Closing thousands of sessions of an overloaded run times out by the thousand.
        logging.getLogger("rollart.controller.rollout.trajectory").setLevel(logging.ERROR)
        await lag.stop()
        await controller.close()
        await client.close()
        await env.close()
        gc.unfreeze()
        gc.set_threshold(*gc_before)
    turns = gen1 - gen0
    rss_delta = peak - rss0
    return {
        "window": (t0, t1), "session_traj": calls.session_traj,
        "split": split.records() if split is not None else None,
        "weight_waits": calls.weight_waits,
        "row": {
            "n": n, "context_tokens": size.context_tokens, "turns_per_traj": size.turns,
            "env_mean_s": size.env_mean_s,
            "gc": gc_policy,
            "batch": batch, "alpha": alpha,
            "running_mean": statistics.fmean(running) if running else 0.0,
            "held_at_end": stats.held, "window_s": round(t1 - t0, 1), "turns": turns,
            "prefix_resends": resends, "prefix_resends_per_turn": resends / max(1, turns),
            "max_generate_in_flight": scenario.run.max_generate_in_flight,
            "window_waits": proxy.num_window_waits,  # the whole run, start-up included
            "turns_per_s": turns / (t1 - t0), "steps": steps - steps0,
            "cpu_us_per_turn": 1e6 * (cpu1 - cpu0) / max(1, turns),
            "cpu_us_per_turn_ci95": _ratio_ci95(sub_cpu, sub_turns, seed),
            "cpu_share_of_core": (cpu1 - cpu0) / (t1 - t0),
            "loop_thread_cpu_us_per_turn": 1e6 * (loop_cpu1 - loop_cpu0) / max(1, turns),
            "loop_sleeps_per_turn": (sleeps1 - sleeps0) / max(1, turns),
            "lost_replies": timeouts - late + stuck, "timeouts": timeouts,
            "late_replies": late,
            "stuck_calls": stuck, "failed": dict(stats.failed),
            "rss_mb": peak / 2**20,
            "rss_bytes_per_traj": rss_delta / n,
            "rss_bytes_per_token": rss_delta / (n * size.context_tokens),
            "worker_rss_bytes_per_token": worker_peak / (n * size.context_tokens),
            "loop_lag_p50_ms": lag_stats.p50_ms, "loop_lag_p99_ms": lag_stats.p99_ms,
            "loop_lag_max_ms": lag_stats.max_ms,
            "gc_s": [round(s, 3) for s in pauses.seconds], "gc_count": pauses.count,
            "gc_cpu_s": [round(s, 3) for s in pauses.cpu_seconds],
            "gc_max_pause_ms": 1e3 * pauses.max_s,
            "gc_share_of_window": pauses.total_s / (t1 - t0),
            **backend_share, **machine,
        },
    }


def _overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """Seconds of ``[a, b]`` covered by the (disjoint) ``spans``."""
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans)


def _gaps(worker: srv.Records, env: srv.Records, session_traj: dict[str, str],
          window: tuple[float, float], weight_waits: dict[str, list[tuple[float, float]]]
          ) -> tuple[list[float], list[float], list[float]]:
    """(env reply -> next generate, generate reply -> env step) gaps in the window, ms, the
    first less the time the turn waited for new weights; and those waits, ms."""
    t0, t1 = window
    gen = {rid: (t_in, t_out) for rid, _, t_in, t_out in worker.calls}
    steps: dict[tuple[str, int], tuple[float, float]] = {
        (sid, turn): (t_in, t_out) for sid, turn, t_in, t_out in env.calls}
    after_env, after_gen, waits = [], [], []
    for (sid, turn), (_, t_out) in steps.items():
        tid = session_traj.get(sid)
        nxt = gen.get(f"{tid}/t{turn + 1}") if tid is not None else None
        if nxt is not None and t0 <= nxt[0] <= t1:
            waited = _overlap(weight_waits.get(tid, []), t_out, nxt[0]) if tid else 0.0
            if waited > 0:
                waits.append(1e3 * waited)
            after_env.append(1e3 * (nxt[0] - t_out - waited))
        g = gen.get(f"{tid}/t{turn}") if tid is not None and turn >= 0 else None
        t_step_in = steps[(sid, turn)][0]
        if g is not None and t0 <= t_step_in <= t1:
            after_gen.append(1e3 * (t_step_in - g[1]))
    return after_env, after_gen, waits


def _legs(backend: tuple[srv.Records, srv.Records], controller: tuple[srv.Records, srv.Records],
          window: tuple[float, float]) -> tuple[list[float], list[float]]:
    """The two transport legs of each generate and env-step call whose request reached its
    backend in the window, ms, sorted: request leg = request handed to the controller's
    transport -> the backend's handler starts; reply leg = the backend's handler returns ->
    the controller reads the reply. Both ends are ``time.monotonic`` of one host (the backends
    run on it). Each leg holds both processes' halves: the sender's event loop and ZeroMQ I/O
    thread (CURVE), the kernel, the receiver's I/O thread and the wait until its event loop
    reads the message. Calls are matched by request id (generate) and by (session, step index)
    (env steps)."""
    t0, t1 = window
    request, reply = [], []
    for back, ctrl in zip(backend, controller, strict=True):
        mine = {(k, turn): (t_in, t_out) for k, turn, t_in, t_out in ctrl.calls}
        for k, turn, b_in, b_out in back.calls:
            c = mine.get((k, turn))
            if c is None or not t0 <= b_in <= t1:
                continue
            request.append(1e3 * (b_in - c[0]))
            reply.append(1e3 * (c[1] - b_out))
    request.sort()
    reply.sort()
    return request, reply


def _one_size(size: Size, seed: int, gc_policy: str,
              max_prefix_tokens: int | None = None) -> dict[str, Any]:
    """Measure one size (see the module docstring). ``max_prefix_tokens``: the SIMULATED
    worker's bound on held prefix tokens; default room for every trajectory's whole sequence
    (a smaller one shows what evicted prefixes cost: ``prefix_resends``)."""
    import uvloop

    mean = size.env_mean_s
    args = Namespace(context_tokens=size.context_tokens, obs_tokens=4, response_tokens=4,
                     turns=size.turns, env_mean_s=mean, env_std_s=mean, env_max_s=6 * mean,
                     open_spread_s=2 * mean)
    dom = srv.domain_argv(args)
    with tempfile.TemporaryDirectory(prefix="ctrl-overhead-") as tmp:
        dumps = {k: Path(tmp) / f"{k}.msgpack" for k in ("worker", "env")}
        procs: list[subprocess.Popen] = []
        # Authenticated (CURVE) as in a real run: the transport's encryption is part of it.
        key_file = create_key_file(Path(tmp) / "keys")
        keyed = ["--key-file", str(key_file)]
        try:
            # Room for every trajectory's whole sequence: a worker that evicts prefixes makes
            # each later turn a refused call plus a resend of the whole context (~1 resend
            # per turn at 10k with the old 16 Mi-token bound).
            if max_prefix_tokens is None:
                max_prefix_tokens = prefix_bound(size)
            hold = ["--max-prefix-tokens", str(max_prefix_tokens)]
            wp, waddr = _spawn(["worker", "--dump", str(dumps["worker"]), *dom, *hold, *keyed])
            procs.append(wp)
            ep, eaddr = _spawn(["env", "--dump", str(dumps["env"]), "--seed", str(seed), *dom,
                                *keyed])
            procs.append(ep)
            with _pinning([wp.pid, ep.pid]) as pinned:
                out = uvloop.run(_drive(size, args, waddr, eaddr, seed, gc_policy, wp.pid,
                                        load_key_file(key_file), env_pid=ep.pid))
            out["row"]["pinned"] = pinned
        finally:
            _stop(procs)
        recs = {k: msgspec.msgpack.decode(p.read_bytes(), type=srv.Records)
                for k, p in dumps.items() if p.exists()}
    row = out["row"]
    if len(recs) == 2:
        after_env, after_gen, waits = _gaps(recs["worker"], recs["env"], out["session_traj"],
                                            out["window"], out["weight_waits"])
        both = sorted(after_env + after_gen)
        after_env.sort()
        after_gen.sort()
        row.update(
            added_latency_p50_ms=_pct(both, 0.5), added_latency_p99_ms=_pct(both, 0.99),
            added_latency_p99_ci95=_pct_ci95(both, 0.99), added_latency_samples=len(both),
            env_to_gen_p99_ms=_pct(after_env, 0.99), gen_to_env_p99_ms=_pct(after_gen, 0.99),
            weight_wait_turns=len(waits),
            weight_wait_share=len(waits) / max(1, len(after_env)),
            weight_wait_p50_ms=_pct(sorted(waits), 0.5))
    if out["split"] is not None:
        c_env, c_gen, _ = _gaps(*out["split"], out["session_traj"], out["window"],
                                out["weight_waits"])
        inside = sorted(c_env + c_gen)
        row.update(
            controller_latency_p50_ms=_pct(inside, 0.5),
            controller_latency_p99_ms=_pct(inside, 0.99),
            controller_latency_p99_ci95=_pct_ci95(inside, 0.99),
            controller_latency_samples=len(inside))
        if len(recs) == 2:
            request, reply = _legs((recs["worker"], recs["env"]), out["split"], out["window"])
            row.update(
                request_leg_p50_ms=_pct(request, 0.5), request_leg_p99_ms=_pct(request, 0.99),
                reply_leg_p50_ms=_pct(reply, 0.5), reply_leg_p99_ms=_pct(reply, 0.99),
                leg_samples=len(request))
    return row


def _floor(quick: bool) -> dict[str, Any]:
    """The transport floor (``benchmarks.rpc_floor.measure_floor``: bare uvloop + msgspec
    echo in a child process) at one call and at 256 calls in flight."""
    low, high = measure_floor((1, 256), repeats=3, quick=quick)
    return {"floor_cpu_us_per_rpc": high["client_cpu_us_per_call"],
            "floor_cpu_us_per_rpc_ci95": high["client_cpu_us_per_call_ci95"],
            "floor_cpu_us_per_rpc_one_in_flight": low["client_cpu_us_per_call"],
            "floor_calls_per_s": high["calls_per_s"],
            "floor_rtt_mean_ms": 1e-3 * low["us_per_call"]}


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[list[multiprocessing.Process]]:
    """``n`` busy processes (a pure-Python spin loop each, normal priority) while the block
    runs; they are stopped on every way out of it (an exception, ``KeyboardInterrupt``)."""
    procs = [multiprocessing.get_context("fork").Process(target=_spin, daemon=True,
                                                         name=f"cpu-load-{i}")
             for i in range(n)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()


def run(quick: bool, seed: int, load: int = 0) -> dict:
    """The benchmark's result; ``load``: busy processes competing for the cores meanwhile."""
    with cpu_load(load):
        return _run(quick, seed, load)


def _run(quick: bool, seed: int, load: int) -> dict:
    started = time.perf_counter()
    gc_policy = os.environ.get("CONTROLLER_OVERHEAD_GC", "tuned")
    if gc_policy not in ("tuned", "default") and not re.fullmatch(r"\d+,\d+,\d+", gc_policy):
        raise SystemExit("CONTROLLER_OVERHEAD_GC must be tuned, default or thresholds "
                         f"'G0,G1,G2', got {gc_policy!r}")
    floor = _floor(quick)
    rows: list[dict[str, Any]] = []
    per_token = worker_per_token = BYTES_PER_TOKEN_GUESS
    for size in QUICK if quick else FULL:
        tokens = size.n * size.context_tokens
        need = tokens * (per_token + worker_per_token)
        avail = psutil.virtual_memory().available
        if need + MEMORY_HEADROOM > avail:
            rows.append({"n": size.n, "context_tokens": size.context_tokens,
                         "skipped": f"needs ~{need / 2**30:.1f} GiB (controller {per_token:.0f} "
                                    f"+ SIMULATED worker {worker_per_token:.0f} B/token), "
                                    f"{avail / 2**30:.1f} GiB free"})
            continue
        # Fresh backend processes per size: the worker keeps the weight version a run reached.
        row = _one_size(size, seed, gc_policy)
        row["load_processes"], row["loadavg_1min"] = load, os.getloadavg()[0]
        rows.append(row)
        if row["rss_bytes_per_token"] > 0:
            per_token = max(per_token / 4, row["rss_bytes_per_token"])
        # The worker's RSS includes its start-up (~0.1 GiB), so small sizes overstate it.
        worker_per_token = max(worker_per_token / 4, row["worker_rss_bytes_per_token"])
    ratios, ci95 = ratios_of(rows, floor)
    ratios["load_processes"], ratios["loadavg_1min"] = load, os.getloadavg()[0]
    return result(NAME, simulated=False, rows=rows, ratios=ratios, ci95=ci95, quick=quick,
                  seed=seed, started=started, notes=f"measured; gc policy {gc_policy}; backends "
                  "are SIMULATED processes (zero-latency worker, env lognormal mean 10 s; the "
                  "saturated size 0.2 s) over "
                  "real ZeroMQ; all processes share the machine's cores")


def ratios_of(rows: list[dict[str, Any]], floor: dict[str, float]
              ) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The JSON ``ratios`` (per size N run, the issue's figures, then the floor) and their
    ``ci95`` ([low, high] where the benchmark has one: CPU per turn, added latency p99, the
    floor's CPU per RPC)."""
    ratios: dict[str, Any] = {}
    ci95: dict[str, list[float]] = {}
    for r in rows:
        if "skipped" in r:
            continue
        n = r["n"]  # distinct per run (QUICK / FULL): the ratios are named by it
        ratios[f"env_mean_s at {n}"] = r["env_mean_s"]
        ratios[f"lost_replies at {n}"] = r["lost_replies"]
        ratios[f"cpu_us_per_turn at {n}"] = r["cpu_us_per_turn"]
        ci95[f"cpu_us_per_turn at {n}"] = list(r["cpu_us_per_turn_ci95"])
        ratios[f"added_latency_p99_ms at {n}"] = r.get("added_latency_p99_ms", float("nan"))
        ci95[f"added_latency_p99_ms at {n}"] = list(
            r.get("added_latency_p99_ci95", [float("nan")] * 2))
        ratios[f"loop_lag_p99_ms at {n}"] = r["loop_lag_p99_ms"]
        ratios[f"rss_bytes_per_token at {n}"] = r["rss_bytes_per_token"]
        ratios[f"cpu_us_per_turn / floor (2 RPCs) at {n}"] = (
            r["cpu_us_per_turn"] / (2 * floor["floor_cpu_us_per_rpc"]))
        ratios[f"turns_per_s at {n}"] = r["turns_per_s"]
        ratios[f"loop_sleeps_per_turn at {n}"] = r["loop_sleeps_per_turn"]
        ratios[f"prefix_resends at {n}"] = r["prefix_resends"]
        ratios[f"window_waits at {n}"] = r["window_waits"]
    ratios.update({k: v for k, v in floor.items() if k != "floor_cpu_us_per_rpc_ci95"})
    if "floor_cpu_us_per_rpc_ci95" in floor:  # a half-width
        mid, half = floor["floor_cpu_us_per_rpc"], floor["floor_cpu_us_per_rpc_ci95"]
        ci95["floor_cpu_us_per_rpc"] = [mid - half, mid + half]
    return ratios, ci95


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="N busy processes competing for the cores during the run")
    known, _ = parser.parse_known_args(argv)
    if known.load < 0:
        raise SystemExit(f"--load must be >= 0, got {known.load}")
    return main_for(NAME, __doc__ or "", functools.partial(run, load=known.load), argv,
                    parents=[parser])


if __name__ == "__main__":
    main()
