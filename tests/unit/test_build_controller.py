"""The one wiring path (``rollart.controller.build``): what ``build_controller`` is given reaches
the controller it builds, and the driver, the simulator and the benchmarks all build through it
(nothing builds a ``Controller`` by hand, nothing patches one after construction)."""

from __future__ import annotations

import ast
import asyncio
import logging
import sys
from pathlib import Path

import pytest

from helpers.fakes import (
    LAZY_POLICY,
    TOK,
    FakeEnvHost,
    FakeReward,
    FakeTrainer,
    FakeWorker,
    make_scenario,
)
from rollart.controller import build
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.build import Backends, build_controller
from rollart.controller.controller import Controller
from rollart.controller.driver import Cluster
from rollart.envhost.families import family_turn_cap
from rollart.transport.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _backends(**kw) -> Backends:
    return Backends(pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]},
                    trainer=FakeTrainer(), tokenizer=TOK, env_hosts=[FakeEnvHost(turns=2)],
                    reward_service=FakeReward(), **kw)


class _MyBuffer(SampleBuffer):
    pass


# ------------------------------------------------------------------ inputs reach the controller


def test_inputs_reach_the_controller() -> None:
    def fake(prompt, response, reference, metadata):
        return 1.0

    clock = [5.0]
    sc = make_scenario(local_threads=3, local_reward_timeout_s=7.0)
    c = build_controller(sc, _backends(clock=lambda: clock[0], vocab_size=1000),
                         affinity={"game": "p2", "math": "p2"}, local_rewards={"fake": fake},
                         local_envs={"mine": dict}, buffer_class=_MyBuffer, check="admission")
    assert type(c.buffer) is _MyBuffer
    assert c.buffer.check == "admission"  # the mode's (rollart) would be per_turn
    assert build_controller(sc, _backends()).buffer.check == "per_turn"
    assert c.proxy.pool_of("game").name == "p2"
    assert build_controller(sc, _backends()).proxy.pool_of("game").name == "p1"
    assert c.rewards.local["fake"] is fake
    assert c.rewards.calls.max_threads == 3 and c.rewards.local_timeout_s == 7.0
    assert c.envs.local.factories == {"mine": dict}
    assert c.envs.local.calls.max_threads == 3
    assert c.clock() == 5.0


def test_the_kv_hold_knows_a_single_turn_env_family_and_the_response_cap() -> None:
    """A reasoning-gym domain ends after one turn whatever ``max_turns`` says: the working set
    is told so (a one-turn domain's estimate is then its prompt plus one response), and gets
    the run's response cap; a domain's own ``max_turns`` below the run's is kept; an agent
    domain, or one whose env is registered in-process, keeps its own whatever its env."""
    import msgspec

    sc = make_scenario(adaptive_affinity={"enabled": True}, max_turns=6)
    game, math = sc.domains
    sc = msgspec.structs.replace(sc, domains=[
        msgspec.structs.replace(game, max_turns=3),
        msgspec.structs.replace(math, env="rg:basic_arithmetic", max_turns=5)])
    ws = build_controller(sc, _backends()).proxy.working_set
    assert ws is not None
    assert ws.max_turns == {"game": 3, "math": 1}
    assert ws.max_tokens_per_turn == sc.run.max_tokens_per_turn == 16
    assert ws.prior_tokens == 256
    # An agent's turns are its LLM calls, however many steps its env takes.
    from rollart.controller.agents.runner import AgentRunner, AgentSpec

    async def agent(client, task):
        return None

    agents = AgentRunner({"math": AgentSpec(agent)})
    ws = build_controller(sc, _backends(), agents=agents).proxy.working_set
    assert ws is not None and ws.max_turns == {"game": 3, "math": 5}
    # An env registered in-process under the family's name is the user's own.
    ws = build_controller(sc, _backends(),
                          local_envs={"rg:basic_arithmetic": dict}).proxy.working_set
    assert ws is not None and ws.max_turns == {"game": 3, "math": 5}
    assert family_turn_cap("game:Sokoban-v0-easy") is None
    assert family_turn_cap("py:pkg.envs:Env") is None and family_turn_cap("count") is None


def _policy_of(c: Controller) -> tuple:
    return (c._sync.eager, c._sync.waves, c.buffer.fresh_start, c.buffer.hold_for_groups,
            c.run.admission, c.buffer.readmit_stale_groups, c.run.domain_mix)


@pytest.mark.parametrize(("mode", "alpha", "policy"), [
    ("rollart", 1, (True, 2, True, True, "capacity", True, "yield")),
    ("areal", 1, (True, 2, True, False, "capacity", True, "yield")),
    ("one_off", 1, (True, 2, True, False, "capacity", True, "yield")),
    ("sync_plus", 0, (False, 2, False, False, "capacity", True, "yield")),
    ("sync", 0, (False, 2, False, False, "capacity", True, "yield")),
])
def test_a_scenario_without_policy_fields_runs_the_waste_free_default(mode, alpha,
                                                                      policy) -> None:
    c = build_controller(make_scenario(mode=mode, alpha=alpha), _backends())
    assert _policy_of(c) == policy
    # under a check override to "admission" (a simulator ablation) the default hold, which
    # needs the per-turn check, does not apply; an explicit one is refused
    if mode == "rollart":
        assert not build_controller(make_scenario(), _backends(),
                                    check="admission").buffer.hold_for_groups
        with pytest.raises(ConfigError, match="hold_for_groups needs check 'per_turn'"):
            build_controller(make_scenario(hold_batch_for_groups=True), _backends(),
                             check="admission")


@pytest.mark.parametrize(("mode", "alpha"), [("rollart", 1), ("areal", 1), ("sync", 0)])
def test_the_previous_lazy_policy_runs_when_spelled_out(mode, alpha) -> None:
    c = build_controller(make_scenario(mode=mode, alpha=alpha, **LAZY_POLICY), _backends())
    assert _policy_of(c) == (False, 2, False, False, "greedy", False, "weight")


async def test_the_send_window_is_the_runs() -> None:
    peak = {"w1": 0, "w2": 0}
    workers: dict[str, FakeWorker] = {}

    def respond_as(name: str):
        def respond(request) -> str:  # called while the worker's other requests run
            peak[name] = max(peak[name], workers[name].in_flight)
            return "ok"

        return respond

    for name in peak:
        workers[name] = FakeWorker(name, respond_as(name), latency_s=0.02)
    b = Backends(pools={"p1": [workers["w1"]], "p2": [workers["w2"]]}, trainer=FakeTrainer(),
                 tokenizer=TOK, env_hosts=[FakeEnvHost(turns=2)], reward_service=FakeReward())
    c = build_controller(make_scenario(max_generate_in_flight=1), b)
    await c.start()
    try:
        await asyncio.wait_for(c.step(), 600)
    finally:
        await c.close()
    # (alpha + 1) x batch trajectories run at once, yet one request per worker is sent at a time
    assert peak == {"w1": 1, "w2": 1}
    assert c.proxy.num_window_waits > 0


@pytest.mark.parametrize("watchdog", [True, False])
async def test_the_stall_watchdog_is_an_input(watchdog: bool, caplog) -> None:
    b = Backends(pools={"p1": [FakeWorker("w1", latency_s=0.2)],
                        "p2": [FakeWorker("w2", latency_s=0.2)]},
                 trainer=FakeTrainer(), tokenizer=TOK, env_hosts=[FakeEnvHost(turns=2)],
                 reward_service=FakeReward())
    c = build_controller(make_scenario(stall_log_s=0.01), b, stall_watchdog=watchdog)
    caplog.set_level(logging.WARNING, logger="rollart.controller.observe.stall")
    await c.start()
    try:
        await asyncio.wait_for(c.step(), 600)  # at least two turns of 0.2 s: >= 0.4 s
    finally:
        await c.close()
    reports = [r for r in caplog.records if "no batch for" in r.getMessage()]
    assert bool(reports) is watchdog


def test_what_cannot_be_wired_is_refused() -> None:
    sc = make_scenario()
    with pytest.raises(ConfigError, match=r"no workers for pools \['p2'\]"):
        build_controller(sc, Backends(pools={"p1": [FakeWorker("w1")]}, trainer=FakeTrainer(),
                                      tokenizer=TOK, env_hosts=[FakeEnvHost()]))
    no_hosts = Backends(pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]},
                        trainer=FakeTrainer(), tokenizer=TOK, reward_service=FakeReward())
    with pytest.raises(ConfigError, match=r"no env host, and envs \['count'\] are not registered"):
        build_controller(sc, no_hosts)
    assert build_controller(sc, no_hosts, local_envs={"count": dict}) is not None


# ------------------------------------------------------------------ every path builds through it


@pytest.fixture
def built(monkeypatch) -> list[Controller]:
    """Controllers built from now on; building one anywhere but in ``build_controller`` fails."""
    made: list[Controller] = []
    init = Controller.__init__

    def checked_init(self, *args, **kwargs) -> None:
        caller = sys._getframe(1).f_code
        assert caller is build.build_controller.__code__, (
            f"Controller built by hand in {caller.co_filename}:{caller.co_name}, "
            "not by rollart.controller.build.build_controller")
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Controller, "__init__", checked_init)
    return made


def test_the_fixture_catches_a_controller_built_by_hand(built) -> None:
    from rollart.controller.routing.proxy import LLMProxy
    from rollart.controller.routing.routers import EnvRouter, RewardRouter

    b = _backends()
    with pytest.raises(AssertionError, match="built by hand"):
        Controller(make_scenario(), proxy=LLMProxy(
            {"p1": ("cpu", b.pools["p1"]), "p2": ("cpu", b.pools["p2"])},
            {"game": "p1", "math": "p2"}), envs=EnvRouter(list(b.env_hosts)),
            rewards=RewardRouter(b.reward_service), trainer=b.trainer, tokenizer=TOK)
    assert built == []


async def test_the_driver_builds_through_build_controller(built) -> None:
    cluster = Cluster.from_scenario(make_scenario(), backends=_backends(),
                                    buffer_class=_MyBuffer)
    async with cluster:
        (c,) = built
        assert cluster.controller is c and type(c.buffer) is _MyBuffer


def test_the_simulator_builds_through_build_controller(built) -> None:
    from rollart.sim.harness import SimCluster, SimDomain, SimPool, SimScenario
    from rollart.sim.workload import DomainSpec, const

    sim = SimScenario(pools=(SimPool("p", "h800", 2),),
                      domains=(SimDomain(DomainSpec("d", prompt_tokens=const(8)), "p"),),
                      mode="rollart", check="admission", push_at_pause=True, env_hosts=1)
    cluster = SimCluster(sim, seed=0)
    (c,) = built
    assert cluster.controller is c and cluster.proxy is c.proxy
    assert c.buffer.check == "admission"  # the simulator's check override, not the mode's
    assert c.trainer.push_needs_pause is True
    assert [w.name for ws in cluster.workers.values() for w in ws] == [
        w.name for w in c.proxy.workers()]


def test_the_benchmarks_build_through_build_controller(built) -> None:
    from benchmarks import controller_overhead, trajectory_cpu

    c, _counts = trajectory_cpu._controller(8, 1, 2, 0, None)
    assert built == [c]
    worker, env, trainer, _counts, table = trajectory_cpu._stand_ins(None)
    c2 = controller_overhead._build(c.scenario, worker, env, trainer, table)
    assert built == [c, c2]


def _controller_calls(path: Path) -> set[str]:
    """Names of the functions (innermost) of ``path`` that call ``Controller(...)``."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def __init__(self) -> None:
            self.stack = ["<module>"]

        def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
            self.stack.append(node.name)
            self.generic_visit(node)
            self.stack.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, node: ast.Call) -> None:
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "Controller") or (
                    isinstance(f, ast.Attribute) and f.attr == "Controller"):
                found.add(self.stack[-1])
            self.generic_visit(node)

    Visitor().visit(ast.parse(path.read_text(), str(path)))
    return found


def test_nothing_in_src_or_benchmarks_calls_controller_by_hand() -> None:
    """Static, for paths no test runs: the only ``Controller(...)`` calls are in
    ``build_controller`` and in ``trajectory_cpu``'s wiring of baseline trees older than it."""
    allowed = {("src/rollart/controller/build.py", "build_controller"),
               ("benchmarks/trajectory_cpu.py", "_controller_by_hand")}
    found = {(str(path.relative_to(ROOT)), name)
             for path in [*ROOT.glob("src/rollart/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]
             for name in _controller_calls(path)}
    assert found <= allowed, sorted(found - allowed)
    assert ("src/rollart/controller/build.py", "build_controller") in found  # the check works
