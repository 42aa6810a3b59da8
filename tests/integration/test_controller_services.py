"""The controller against real service processes: env host (GEM + reasoning-gym), HTTP reward
service, a vLLM inference worker and the trainer, all on the project's tiny model.

Two rollart-mode steps: whole groups, exact bookkeeping against what the engine returned,
weights of version 1 applied on the worker at step 2, sessions released, clean shutdown.
"""

from __future__ import annotations

import msgspec
import pytest
from polling import wait_for

from rollart.config import parse_scenario
from rollart.controller import Backends, Cluster
from rollart.controller.training.remote import RemoteTrainer
from rollart.envhost.client import EnvClient
from rollart.inference.client import InferenceClient
from rollart.reward.client import RewardClient
from rollart.trainer.client import TrainerClient
from rollart.transport.security import env_credentials

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCENARIO = """
[run]
seed = 3
mode = "rollart"
alpha = 1
batch_size = 8
group_size = 4
redundancy = 1
max_turns = 4
max_tokens_per_turn = 24
max_tokens_per_trajectory = 640
generate_timeout_s = 120.0
env_timeout_s = 30.0

[[pools]]
name = "cpu"

[[domains]]
name = "guess"
env = "game:GuessTheNumber-v0-easy"
pool = "cpu"
reward = "env_return"
reward_url = "local"

[[domains]]
name = "arith"
env = "rg:basic_arithmetic"
pool = "cpu"
reward = "boxed_format"
env_options = { min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1 }
"""


@pytest.fixture(scope="module")
def services(tiny_model_dir, services_starter, tmp_path_factory):
    started = services_starter([  # started together: their start-ups overlap
        ("rollart.envhost.host", ["--name", "env0", "--threads", "2"]),
        ("rollart.reward.server", ["--port", "0", "--processes", "1", "--no-auth"]),
        ("rollart.inference.worker", ["--model", str(tiny_model_dir), "--name", "w0",
                                      "--dtype", "float32", "--max-model-len", "1024",
                                      "--max-num-seqs", "32",
                                      # no torch.compile (~35 s of the start-up): the
                                      # compiled engine is test_inference_worker's
                                      "--enforce-eager"]),
        ("rollart.trainer.service", ["--model", str(tiny_model_dir),
                                     "--options", '{"lr": 1e-4, "bucket_bytes": 16777216}']),
    ], log_dir=tmp_path_factory.mktemp("controller-services"))
    try:
        yield {s.module.rsplit(".", 1)[-1]: s for s in started}
    finally:
        for s in started:
            s.stop()


async def test_two_rollart_steps_on_real_services(services, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    scenario = parse_scenario(SCENARIO, "itest.toml")
    env = EnvClient(services["host"].address, name="env0", auth=env_credentials())
    worker = InferenceClient(services["worker"].address, name="w0", default_timeout_s=120, auth=env_credentials())
    trainer_client = TrainerClient(services["service"].address, auth=env_credentials())
    trainer = RemoteTrainer(trainer_client)
    async with RewardClient(f"http://{services['server'].address}") as reward:
        backends = Backends(pools={"cpu": [worker]}, trainer=trainer, tokenizer=tokenizer,
                            env_hosts=[env], reward_service=reward)
        steps = []
        async with Cluster.from_scenario(scenario, backends=backends) as cluster:
            async for step in cluster.train(steps=2):
                steps.append(step)
        stats = await env.stats()
    try:
        assert [s.metrics.policy_version for s in steps] == [1, 2]
        assert (await worker.stats()).version == 1  # applied at step 2, before training
        # Counted per step window: rollout runs ahead, so step 2's batch may have been decoded
        # entirely during step 1 (a loaded CI machine did that), leaving step 2 a count of 0.
        assert sum(s.metrics.num_generated_tokens for s in steps) > 0
        for s in steps:
            assert len(s.samples) == 8 and len({x.group_key for x in s.samples}) == 2
            assert s.metrics.response_len_kept_mean > 0
            assert all(sum(x.loss_mask) > 0 for x in s.samples)
            assert msgspec.json.encode(s.metrics)  # JSON-able for metrics.jsonl
            for x in s.samples:
                assert len(x.token_ids) == len(x.loss_mask)
                # per generated token: one version and one behaviour logprob each
                assert len(x.versions) == len(x.behaviour_logprobs) == sum(x.loss_mask)
                assert all(v >= 0 for v in x.versions)
                assert all(lp <= 0.0 for lp in x.behaviour_logprobs)
        assert sum(s.metrics.num_failed_by_reason.get("reward_error", 0) for s in steps) == 0
        # Every session is closed; the closes of the last cancelled trajectories are in flight
        # when train() returns, so poll (a loaded machine took over 0.5 s).
        async def all_closed() -> bool:
            return (await env.stats()).num_sessions == 0

        await wait_for(all_closed, timeout_s=30.0, every_s=0.1)
        assert stats.num_steps > 0
    finally:
        await worker.close()
        await env.close()
        await trainer_client.close()


NEW_POLICY = """
weight_apply = "eager"
apply_waves = 2
fresh_start = true
admission = "capacity"
domain_mix = "yield"
"""


async def test_new_staleness_policy_on_real_services(services, tiny_model_dir) -> None:
    """Eager staggered apply, fresh start, version-aware admission and the yield mix on real
    processes: still strict, weights reach the worker without a batch, waste by reason adds
    up (the trainer service keeps its version from the test above: versions are relative)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    scenario = parse_scenario(SCENARIO.replace("[run]\n", "[run]" + NEW_POLICY), "new.toml")
    env = EnvClient(services["host"].address, name="env0", auth=env_credentials())
    worker = InferenceClient(services["worker"].address, name="w0", default_timeout_s=120, auth=env_credentials())
    trainer_client = TrainerClient(services["service"].address, auth=env_credentials())
    trainer = RemoteTrainer(trainer_client, version=(await trainer_client.status()).version)
    async with RewardClient(f"http://{services['server'].address}") as reward:
        backends = Backends(pools={"cpu": [worker]}, trainer=trainer, tokenizer=tokenizer,
                            env_hosts=[env], reward_service=reward)
        steps = []
        async with Cluster.from_scenario(scenario, backends=backends) as cluster:
            start = trainer.version
            async for step in cluster.train(steps=3):
                steps.append(step)
            final = cluster.controller.buffer.stats()
    try:
        assert [s.metrics.policy_version for s in steps] == [start + 1, start + 2, start + 3]
        # Step 3 waited for the eager apply of step 2's version before training.
        assert (await worker.stats()).version >= start + 2
        for s in steps:
            m = s.metrics
            trained_at = m.policy_version - 1
            for x in s.samples:
                assert all(v >= trained_at - 1 for v in x.versions)  # generated tokens'
            assert m.wasted_tokens == sum(m.wasted_tokens_by_reason.values())
            assert sum(d.trained for d in m.by_domain.values()) == len(s.samples) == 8
            assert m.trained_tokens == sum(sum(x.loss_mask) for x in s.samples)
        generated = sum(s.metrics.buffer_generated_tokens for s in steps)
        assert generated == sum(s.metrics.trained_tokens + s.metrics.wasted_tokens
                                for s in steps) + steps[-1].metrics.in_flight_tokens
        assert final.generated_tokens == final.trained_tokens \
            + sum(final.wasted_tokens.values()) + final.in_flight_tokens
    finally:
        await worker.close()
        await env.close()
