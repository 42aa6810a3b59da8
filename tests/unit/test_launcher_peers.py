"""Losing a service process: the proxy's remove primitive, weight syncs that skip dead workers,
and ``PeerLoss`` deciding which losses a run survives (the rest are fatal, with context)."""

from __future__ import annotations

import array
import asyncio
from pathlib import Path

import pytest
from test_controller_modes import run_steps
from test_controller_training import FakeTrainerClient, sample, worker

from helpers.fakes import FakeEnvHost, FakeTrainer, FakeWorker, make_scenario
from rollart.controller import Cluster
from rollart.controller.driver import Backends
from rollart.controller.routing.proxy import LLMProxy, PoolExhaustedError
from rollart.controller.training.remote import RemoteTrainer
from rollart.launcher.peers import PeerLoss
from rollart.launcher.procs import ServiceProcess
from rollart.transport import messages as m
from rollart.transport.errors import PeerDeadError


class FakeMortalWorker(FakeWorker):
    """A worker whose client the launcher can mark dead (its process exited)."""

    def mark_dead(self, reason: str) -> None:
        self.kill()


class FakeMortalEnvHost(FakeEnvHost):
    """An env host whose client the launcher can mark dead: every call then fails."""

    def __init__(self, name: str, **kw) -> None:
        super().__init__(name, **kw)
        #: session ids someone tried to close after the host was marked dead
        self.closed_when_dead: list[str] = []

    def mark_dead(self, reason: str) -> None:
        self._dead = True

    async def step(self, session_id, action, *, timeout_s=None):
        result = await super().step(session_id, action, timeout_s=timeout_s)
        if self._dead:
            raise PeerDeadError(f"{self.name} died")
        return result

    async def close_session(self, session_id) -> None:
        if self._dead:
            self.closed_when_dead.append(session_id)
            raise PeerDeadError(f"{self.name} died")
        await super().close_session(session_id)


def service(name: str) -> ServiceProcess:
    return ServiceProcess(name=name, argv=[], log_path=Path(f"/logs/{name}.log"),
                          ready_path=Path(f"/ready/{name}"))


def prompt() -> array.array:
    return array.array("i", [1, 2, 3])


async def test_remove_worker_reroutes_the_next_turn_with_the_whole_prompt() -> None:
    a1, a2 = FakeWorker("a1"), FakeWorker("a2")
    proxy = LLMProxy({"A": ("cpu", [a1, a2])}, {"d": "A"})
    sp = m.SamplingParams(max_tokens=4)
    await proxy.generate("t1", "d", "r1", prompt(), sp)
    first = a1 if a1.requests else a2
    other = a2 if first is a1 else a1
    assert len(proxy.remove_worker(first.name, "process exited with code -9").workers) == 1
    longer = array.array("i", [1, 2, 3, *first.prompts[0][3:], 7, 8])
    await proxy.generate("t1", "d", "r2", longer, sp)
    assert [r.request_id for r in other.requests] == ["r2"]
    assert other.requests[0].prefix_len == 0  # the new worker holds nothing of t1
    assert proxy.workers() == [other] and proxy.pools["A"].removed == [first.name]
    assert proxy.remove_worker(first.name, "again").removed == [first.name]  # idempotent
    assert not proxy.remove_worker(other.name, "gone too").workers
    with pytest.raises(PoolExhaustedError, match="no live worker left"):
        proxy.route("t2", "d")


def test_workers_leaves_out_workers_found_dead() -> None:
    a1, a2 = FakeWorker("a1"), FakeWorker("a2")
    proxy = LLMProxy({"A": ("cpu", [a1, a2])}, {"d": "A"})
    a1.kill()
    assert proxy.workers() == [a2]
    assert proxy.pools["A"].removed == ["a1"]


async def test_a_failed_push_to_a_dead_worker_is_not_an_error() -> None:
    client = FakeTrainerClient(failed={"tcp://w2": "PeerDeadError: w2 exited"})
    trainer = RemoteTrainer(client)
    w1, w2 = worker("w1"), worker("w2")
    await trainer.set_workers([w1, w2])
    await trainer.train([sample("a", "g", 1.0), sample("b", "g", 0.0)])
    w2.kill()  # died while its push was in flight; still registered at the trainer
    await trainer.push_weights(1, [w1, w2])


def two_worker_cluster(env, trainer):
    a1, a2 = FakeMortalWorker("a1", latency_s=0.5), FakeMortalWorker("a2", latency_s=0.5)
    b1 = FakeMortalWorker("b1")
    from helpers.fakes import TOK, FakeReward

    backends = Backends(pools={"p1": [a1, a2], "p2": [b1]}, trainer=trainer, tokenizer=TOK,
                        env_hosts=env, reward_service=FakeReward())
    cluster = Cluster.from_scenario(make_scenario(batch_size=4, group_size=2), backends=backends)
    return cluster, (a1, a2, b1)


@pytest.mark.looptime
async def test_losing_one_worker_of_a_pool_reroutes_its_turns_and_the_run_goes_on() -> None:
    trainer = FakeTrainer(train_s=1.0)
    cluster, (a1, a2, b1) = two_worker_cluster([FakeEnvHost(turns=3)], trainer)
    loss = PeerLoss({"worker-p1-0": ("p1", a1), "worker-p1-1": ("p1", a2),
                     "worker-p2-0": ("p2", b1)}, {}, [], {}, cluster)
    async with cluster:
        steps = await run_steps(cluster, 1)
        assert a1.in_flight > 0  # turns in flight on it now
        assert loss.on_exit(service("worker-p1-0"))
        steps += await run_steps(cluster, 2)
        assert cluster.controller.proxy.pools["p1"].workers == [a2]
        rerouted = sum(s.metrics.num_rerouted for s in steps)
    assert rerouted > 0 and loss.survived == ["worker-p1-0"]
    assert [s.metrics.policy_version for s in steps] == [1, 2, 3]
    ids = [s.sample_id for st in steps for s in st.samples]
    assert len(ids) == len(set(ids)) == 12  # none lost, none trained twice
    assert a1.name not in {w.name for w in trainer.workers}  # unregistered at the trainer
    # The last worker of p2 is fatal, and the context says why.
    assert not loss.on_exit(service("worker-p2-0"))
    assert loss.context["worker-p2-0"] == "it was the last live worker of pool 'p2'"


@pytest.mark.looptime
async def test_losing_the_last_worker_of_a_pool_logs_nothing_but_the_one_message(caplog):
    cluster, (a1, a2, b1) = two_worker_cluster([FakeEnvHost(turns=3)], FakeTrainer())
    loss = PeerLoss({"worker-p2-0": ("p2", b1)}, {}, [], {}, cluster)
    async with cluster:
        await run_steps(cluster, 1)
        assert not loss.on_exit(service("worker-p2-0"))
    assert b1.dead
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_env_host_loss_is_survived_only_while_another_host_lives() -> None:
    h1, h2 = FakeMortalEnvHost("h1"), FakeMortalEnvHost("h2")
    cluster, _ = two_worker_cluster([h1, h2], FakeTrainer())
    loss = PeerLoss({}, {"env-h1": h1, "env-h2": h2}, [h1, h2], {}, cluster)
    assert loss.on_exit(service("env-h1")) and h1.dead
    assert not loss.on_exit(service("env-h2")) and h2.dead
    assert loss.context["env-h2"] == "no live env host is left"


def test_trainer_loss_is_fatal_and_its_client_stops_at_once() -> None:
    cluster, _ = two_worker_cluster([FakeEnvHost()], FakeTrainer())
    trainer_client = FakeMortalWorker("trainer")
    loss = PeerLoss({}, {}, [], {"trainer": trainer_client}, cluster)
    assert not loss.on_exit(service("trainer"))
    assert trainer_client.dead  # nothing waits on it any more
    assert not loss.on_exit(service("reward"))  # not known: fatal


@pytest.mark.looptime
async def test_a_fatal_loss_is_reported_once_and_the_dead_host_is_not_called(caplog) -> None:
    host = FakeMortalEnvHost("h1", turns=3, latency=lambda i, s: 1.0)
    cluster, _ = two_worker_cluster([host], FakeTrainer())
    loss = PeerLoss({}, {"env-h1": host}, [host], {}, cluster)
    async with cluster:
        await run_steps(cluster, 1)
        assert host.sessions  # sessions open on it now
        assert not loss.on_exit(service("env-h1"))
        await asyncio.sleep(30.0)  # its trajectories fail; nothing retries them
        assert cluster.controller.num_running == 0
    assert host.closed_when_dead == []  # the dead host was never asked to close a session
    # The launcher reports the exit; the controller does not add an error of its own.
    assert not [r for r in caplog.records if "fatal error" in r.getMessage()]


MINIMAL_TEXT = (Path(__file__).resolve().parents[1] / "minimal_scenario.toml").read_text()


async def test_worker_and_env_host_liveness_comes_from_the_scenario() -> None:
    import msgspec

    from rollart.config import parse_scenario
    from rollart.envhost.client import EnvClient
    from rollart.launcher.startup import peer_liveness
    from rollart.transport.errors import ConfigError
    from rollart.transport.security import INSECURE

    text = MINIMAL_TEXT
    sc = parse_scenario(text.replace("[run]", "[run]\nliveness_timeout_s = 45.0", 1))
    assert peer_liveness(sc) == {"liveness_timeout_s": 45.0}
    client = EnvClient("tcp://127.0.0.1:1", auth=INSECURE, name="h", **peer_liveness(sc))
    try:
        assert client._rpc._liveness == 45.0
    finally:
        await client.close()
    assert peer_liveness(parse_scenario(text))["liveness_timeout_s"] == 10.0
    with pytest.raises(ConfigError, match="run.liveness_timeout_s"):
        parse_scenario(text.replace("[run]", "[run]\nliveness_timeout_s = 1.0", 1))
    assert msgspec.json.encode(sc)
