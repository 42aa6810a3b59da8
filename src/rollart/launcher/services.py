"""Start a scenario's service processes locally and connect the controller's clients to them.

Which process runs where: every service the scenario does not give an address for (reward
service ``reward.url``, env hosts ``env_hosts[].address``, inference workers
``pools[].addresses``) is started here as a child process on 127.0.0.1; the trainer always runs
locally beside the controller. Given addresses are used as they are (services on other machines).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rollart.config import PoolConfig, Scenario
from rollart.launcher.procs import Supervisor, python_module
from rollart.trainer.service import trainer_message_bytes


@dataclass
class Addresses:
    """Where each service of the run listens."""

    reward_url: str
    env_hosts: list[str] = field(default_factory=list)
    workers: dict[str, list[str]] = field(default_factory=dict)  # pool -> addresses
    trainer: str = ""


def _cpu_binding(index: int, total: int) -> dict[str, str]:
    # vLLM's CPU backend binds its OpenMP threads to cores ("auto" takes them all). Several
    # engines plus a trainer on a small machine must share cores instead of fighting over the
    # same ones: with at least one core per engine each gets its own, else none is bound.
    cores = os.cpu_count() or 1
    if total <= cores and total > 1:
        return {"VLLM_CPU_OMP_THREADS_BIND": str(index % cores)}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind"} if total > 1 else {}


def _gpu_binding(local_workers: list[Any], k: int) -> dict[str, str]:
    # Local GPU workers take consecutive devices, tensor_parallel_size each, in scenario order;
    # the trainer (device "cuda") gets the first device after them (see trainer_env).
    first = sum(p.engine.tensor_parallel_size for p, _ in local_workers[:k]
                if p.hardware != "cpu")
    tp = local_workers[k][0].engine.tensor_parallel_size
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in range(first, first + tp))}


def trainer_env(sc: Scenario) -> dict[str, str]:
    """Environment of a local trainer on GPUs: the ``trainer.num_processes`` devices after the
    local GPU workers' (rank r of torchrun takes the r-th of them, ``cuda:LOCAL_RANK``)."""
    if sc.trainer.device == "cpu":
        return {}
    used = sum(p.engine.tensor_parallel_size * p.num_workers for p in sc.pools
               if p.hardware != "cpu" and not p.addresses)
    devices = range(used, used + sc.trainer.num_processes)
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}


async def start_services(sup: Supervisor, scenario: Scenario, model_dir: Path, *,
                         trainer_resume: Path | None, auth_argv: list[str],
                         ready_timeout_s: float = 600.0,
                         checkpoint_dir: Path | None = None,
                         reward_token_file: Path | None = None) -> Addresses:
    """Start every local service of ``scenario`` (concurrently) and return all addresses.
    ``checkpoint_dir``: the only directory the trainer saves checkpoints under;
    ``reward_token_file``: the bearer token a local reward service requires (by path;
    ``None``: it serves without one, ``--no-auth``).

    ``auth_argv`` (``--key-file PATH`` or ``--insecure``: ``rollart.launcher.runkeys``) is
    given to every ZeroMQ service; each worker's ``--max-message-bytes`` is a weight bucket
    (``trainer.weight_bucket_bytes``) plus 64 MiB, the trainer's sized by
    ``trainer_message_bytes``.

    Raises:
        ProcessFailedError: a service exited before it was ready (its log tail included).
        TimeoutError: a service was not ready within ``ready_timeout_s``.
    """
    sc = scenario
    starts: dict[str, Any] = {}
    if sc.reward.url is None:
        argv = python_module("rollart.reward.server", "--host", sc.reward.host,
                             "--port", str(sc.reward.port))
        for mod in sc.reward.modules:
            argv += ["--functions", mod]
        # The service refuses to start with neither (an open loopback port is every local
        # user's): no token file here is an explicit --no-auth.
        argv += (["--token-file", str(reward_token_file)] if reward_token_file is not None
                 else ["--no-auth"])
        starts["reward"] = sup.start("reward", argv, ready_timeout_s=ready_timeout_s)
    for host in sc.env_hosts:
        if host.address is not None:
            continue
        argv = python_module(
            "rollart.envhost.host", "--name", host.name,
            "--step-timeout-s", str(host.step_timeout_s),
            "--open-timeout-s", str(host.open_timeout_s),
            "--max-sessions", str(host.max_sessions), "--threads", str(host.threads),
            *auth_argv)
        for key, lat in host.latency.items():
            argv += ["--latency", f"{key}={msgspec.json.encode(lat).decode()}"]
        for env_name in env_allow_list(sc):
            argv += ["--allow-env", env_name]
        starts[f"env:{host.name}"] = sup.start(f"env-{host.name}", argv,
                                               ready_timeout_s=ready_timeout_s)
    local_workers = [(p, i) for p in sc.pools if not p.addresses for i in range(p.num_workers)]
    for k, (pool, i) in enumerate(local_workers):
        name = f"{pool.name}-{i}"
        argv = worker_argv(sc, pool, name, k, model_dir, auth_argv)
        env = (_cpu_binding(k, len(local_workers)) if pool.hardware == "cpu"
               else _gpu_binding(local_workers, k))
        starts[f"worker:{pool.name}:{i}"] = sup.start(
            f"worker-{name}", argv, env=env, ready_timeout_s=ready_timeout_s)
    starts["trainer"] = sup.start("trainer",
                                  [*trainer_argv(sc, model_dir, trainer_resume,
                                                 checkpoint_dir=checkpoint_dir), *auth_argv],
                                  env=trainer_env(sc), ready_timeout_s=ready_timeout_s)

    keys = list(starts)
    results = await asyncio.gather(*starts.values())
    got = dict(zip(keys, results, strict=True))
    reward_url = sc.reward.url or f"http://{got['reward']}"
    addrs = Addresses(reward_url=reward_url, trainer=got["trainer"])
    for host in sc.env_hosts:
        addrs.env_hosts.append(host.address or got[f"env:{host.name}"])
    for pool in sc.pools:
        addrs.workers[pool.name] = list(pool.addresses) or [
            got[f"worker:{pool.name}:{i}"] for i in range(pool.num_workers)]
    return addrs


def worker_argv(sc: Scenario, pool: PoolConfig, name: str, k: int, model_dir: Path,
                auth_argv: list[str]) -> list[str]:
    """The command line of local inference worker ``name`` (the ``k``-th local worker)."""
    eng = pool.engine
    argv = python_module(
        "rollart.inference.worker", "--model", str(model_dir), "--name", name,
        "--kv-cache-bytes", str(eng.kv_cache_bytes), "--dtype", sc.model.dtype,
        "--seed", str(sc.run.seed + k),
        "--max-message-bytes", str(sc.trainer.weight_bucket_bytes + (64 << 20)), *auth_argv)
    if eng.max_model_len:
        argv += ["--max-model-len", str(eng.max_model_len)]
    if eng.max_num_seqs:
        argv += ["--max-num-seqs", str(eng.max_num_seqs)]
    if eng.max_prefix_tokens:
        argv += ["--max-prefix-tokens", str(eng.max_prefix_tokens)]
    if eng.enforce_eager:
        argv.append("--enforce-eager")
    if not eng.enable_prefix_caching:
        argv.append("--no-prefix-caching")
    if sc.trainer.weight_transfer != "zmq":
        argv += ["--weight-transfer", sc.trainer.weight_transfer]
    if pool.hardware != "cpu":
        argv += ["--tensor-parallel-size", str(eng.tensor_parallel_size)]
        if eng.gpu_memory_utilization:
            argv += ["--gpu-memory-utilization", str(eng.gpu_memory_utilization)]
    return argv


def env_allow_list(sc: Scenario) -> list[str]:
    """The ``py:`` envs a local env host may build: exactly the scenario's ``py:`` domains
    (``rollart.envhost.allow``; ``game:`` / ``rg:`` envs need no entry)."""
    return sorted({d.env for d in sc.domains if d.env.startswith("py:")})


def cpu_trainer_threads(sc: Scenario, cores: int | None = None) -> int:
    """torch threads of a CPU trainer that shares the machine with ``sc``'s local CPU engines:
    the cores they leave (each engine binds its OpenMP threads to one core when there are
    enough, ``_cpu_binding``), at least 1; 0 (torch's default, every core) for a GPU trainer
    or when no local CPU engine runs beside it. ``cores``: the machine's (``os.cpu_count()``).

    Why: torch's default takes every core; beside busy engines its threads are descheduled
    and the others spin at each parallel region waiting for them (measured on 2 cores beside
    two engines: ~10 s per quickstart step at 2 threads against ~1 s at 1)."""
    if sc.trainer.device != "cpu" or sc.trainer.num_processes > 1:
        return 0
    engines = sum(p.num_workers for p in sc.pools if p.hardware == "cpu" and not p.addresses)
    if not engines:
        return 0
    return max(1, (cores or os.cpu_count() or 1) - engines)


def trainer_argv(sc: Scenario, model_dir: Path, resume: Path | None, *,
                 checkpoint_dir: Path | None = None) -> list[str]:
    """Command line of the trainer process for scenario ``sc`` (under torchrun when
    ``trainer.num_processes`` > 1; the Supervisor appends ``--ready-file``). The trainer saves
    checkpoints only under ``checkpoint_dir`` (none: it refuses to save)."""
    t = sc.trainer
    # "auto" keeps the checkpoint's dtype on GPUs; CPU training stays in float32.
    dtype = sc.model.dtype if sc.model.dtype != "auto" else (
        "float32" if t.device == "cpu" else "bfloat16")
    if t.weight_wire_dtype in ("bf16", "fp16"):
        dtype = "float32"  # master parameters: the wire dtype only rounds what is sent
    options = {"lr": t.lr, "weight_decay": t.weight_decay, "bucket_bytes": t.weight_bucket_bytes,
               "seed": sc.run.seed, "device": t.device, "dtype": dtype,
               "weight_transfer": t.weight_transfer,
               "weight_transfer_address": t.weight_transfer_address,
               "weight_transfer_timeout_s": t.weight_transfer_timeout_s,
               "weight_wire_dtype": t.weight_wire_dtype, "weight_delta": t.weight_delta,
               "weight_full_every": t.weight_full_every,
               "num_threads": cpu_trainer_threads(sc)}
    temperatures = {d.sampling.temperature for d in sc.domains}
    step_cfg: dict[str, Any] = {
        "clip_eps": t.clip_eps, "kl_coef": t.kl_coef, "max_grad_norm": t.max_grad_norm,
        "max_tokens_per_microbatch": t.max_tokens_per_microbatch,
        "num_minibatches": t.num_minibatches,
    }
    if t.clip_eps_high is not None:
        step_cfg["clip_eps_high"] = t.clip_eps_high
    # The trainer must score tokens under the distribution the engine sampled from
    # (validate_scenario guarantees one temperature > 0 across domains).
    (step_cfg["temperature"],) = temperatures
    args = ["--model", str(model_dir), "--options", msgspec.json.encode(options).decode(),
            "--step-config", msgspec.json.encode(step_cfg).decode(),
            "--max-message-bytes",
            str(trainer_message_bytes(sc.run.batch_size, sc.run.max_tokens_per_trajectory))]
    if t.num_processes == 1:
        argv = python_module("rollart.trainer.service", *args)
    else:
        # torchrun starts the ranks (rank 0 writes the ready file) and forwards SIGTERM to them;
        # any rank exiting ends them all (rollart.trainer.distributed).
        argv = python_module("torch.distributed.run", "--standalone",
                             "--nproc-per-node", str(t.num_processes),
                             "-m", "rollart.trainer.service", *args)
    if resume is not None:
        argv += ["--resume", str(resume)]
    if checkpoint_dir is not None:
        argv += ["--checkpoint-dir", str(checkpoint_dir)]
    return argv
