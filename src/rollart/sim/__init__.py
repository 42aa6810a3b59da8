"""SIMULATED hardware, workers, envs, reward and trainer for benchmarks (always labelled).

- ``hardware``: H800 / H20 / H100 / H200 / CPU profiles (FLOP/s, HBM bandwidth, memory, cost).
- ``models``: Qwen3-8B/14B/32B and Qwen3-30B-A3B (MoE) size profiles.
- ``costs``: roofline prefill / decode-step / transfer / training-step times.
- ``workload``: seeded distributions, task domains, the token-count ``SimTokenizer``.
- ``worker``: ``SimInferenceWorker`` (the ``InferenceClient`` methods, continuous batching).
- ``env``: ``SimEnvHost`` (the ``EnvClient`` methods) and ``SimReward``.
- ``trainer``: ``SimTrainer`` (the controller's ``TrainerBackend`` port).
- ``clock``: ``run_virtual`` (looptime virtual clock) / ``run_real``.
- ``calibration``: single-engine workloads compared per cost against the paper's §3 ratios.
- ``harness``: ``run_simulated(SimScenario, seed)`` runs the REAL controller on all of these.
- ``serve``: the simulated worker / env host behind the real ZeroMQ RPC server.
"""
