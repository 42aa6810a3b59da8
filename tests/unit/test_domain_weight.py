"""``Cluster.set_domain_weight``: a domain's share of new groups changes at run time (a
curriculum, a drifting task mix); bad names and weights are refused with the reason."""

from __future__ import annotations

import pytest
from test_controller_modes import run_steps

from helpers.fakes import TOK, FakeEnvHost, FakeReward, FakeTrainer, FakeWorker
from rollart.config import parse_scenario
from rollart.controller import Backends, Cluster
from rollart.transport.errors import ConfigError

TEXT = """
[run]
mode = "rollart"
alpha = 1
batch_size = 8
group_size = 2
max_turns = 1
max_tokens_per_turn = 16
max_tokens_per_trajectory = 256
seed = 3
[[pools]]
name = "p"
hardware = "cpu"
[[domains]]
name = "a"
env = "count"
pool = "p"
reward = "fake"
[[domains]]
name = "b"
env = "count"
pool = "p"
reward = "fake"
"""


def cluster() -> Cluster:
    backends = Backends(pools={"p": [FakeWorker("w")]}, trainer=FakeTrainer(), tokenizer=TOK,
                        env_hosts=[FakeEnvHost(turns=1)], reward_service=FakeReward())
    return Cluster.from_scenario(parse_scenario(TEXT, "w.toml"), backends=backends)


def trained(steps, domain: str) -> int:
    return sum(s.domain == domain for st in steps for s in st.samples)


@pytest.mark.looptime
async def test_a_new_weight_moves_the_mix_of_later_groups() -> None:
    c = cluster()
    c.set_domain_weight("b", 1e-6)  # before the start: the scenario's weight
    async with c:
        early = await run_steps(c, 4)
        c.set_domain_weight("a", 1e-6)
        c.set_domain_weight("b", 1.0)
        await run_steps(c, 2)  # groups admitted before the change drain
        late = await run_steps(c, 4)
    assert trained(early, "b") == 0 and trained(early, "a") == 32
    assert trained(late, "b") == 32


async def test_unknown_domains_and_bad_weights_are_refused() -> None:
    c = cluster()
    with pytest.raises(ConfigError, match="unknown domain 'z'; domains: \\['a', 'b'\\]"):
        c.set_domain_weight("z", 1.0)
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="must be a finite number > 0"):
            c.set_domain_weight("a", bad)
