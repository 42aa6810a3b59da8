"""``--cluster ray`` on a multi-node Ray cluster built on this machine with Ray's own test
utility (``ray.cluster_utils.Cluster``: one raylet per node, each with its own custom resources:
``cpu_env`` on the head, ``h800`` and ``h20`` on two more nodes).

One run of a CPU scenario (a real vLLM CPU engine, tiny model) whose pool, env host, reward
service and trainer are labelled: every service lands on the node its label names (Ray's state
API), the run trains, then one placed worker is killed and the run stops naming it; afterwards no
rollart actor, placement group or service process is left.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest
from proctree import alive, descendants
from short_run import eager

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]
ray = pytest.importorskip("ray")

SHORT_RUN = Path(__file__).parent / "scenarios" / "short_run.toml"
#: node label -> (num_cpus, custom resources); small, so the machine stays light.
NODES = {"cpu_env": (2, {"cpu_env": 2}), "h800": (1, {"h800": 1}), "h20": (1, {"h20": 1})}
LABELS = {"reward": "cpu_env", "env-envhost": "cpu_env", "worker-game-0": "h20",
          "trainer": "h800"}


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    saved = dict(os.environ)
    # A loaded shared machine must not have Ray's memory monitor kill the services' actors;
    # no usage reports from a test. The nodes' processes inherit this environment: the one
    # engine's default OpenMP binding ("auto") pins it to core 0, which every other lone engine
    # on this shared 2-core machine pins too (measured: minutes to warm up); let it float.
    os.environ.update({"RAY_memory_monitor_refresh_ms": "0", "RAY_USAGE_STATS_ENABLED": "0",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    small = {"object_store_memory": 80 << 20}
    cpus, res = NODES["cpu_env"]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": cpus, "resources": res, "include_dashboard": True, **small})
    nodes = {"cpu_env": cluster.head_node.node_id}
    try:
        for label in ("h800", "h20"):
            cpus, res = NODES[label]
            nodes[label] = cluster.add_node(num_cpus=cpus, resources=res, **small).node_id
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rollart-cache")


def _scenario(tmp_path: Path, worker_label: str = "h20") -> Path:
    """short_run.toml with both domains on one pool (one vLLM engine: the slow part on a
    loaded machine) without torch.compile (``short_run.eager``: placement is checked here,
    not the engine), every service labelled."""
    text = eager(SHORT_RUN.read_text()).replace("checkpoint_every = 1", "checkpoint_every = 0")
    text, n = re.subn(r'\[\[pools\]\]\nname = "reasoning"\n\[pools.engine\]\n(?:[a-z_]+ = .*\n)*',
                      "", text)
    assert n == 1
    text = text.replace('pool = "reasoning"', 'pool = "game"')
    text = text.replace('name = "game"\n', f'name = "game"\nray_resource = "{worker_label}"\n', 1)
    text = text.replace('name = "envhost"\n', 'name = "envhost"\nray_resource = "cpu_env"\n')
    text = text.replace("[trainer]\n", '[trainer]\nray_resource = "h800"\n')
    text += '\n[reward]\nray_resource = "cpu_env"\n'
    path = tmp_path / "scenario.toml"
    path.write_text(text)
    return path


def _ours(address: str, kind: str, prefix: str = "rollart-run-") -> list:
    from ray.util import state

    if kind == "actors":
        rows = state.list_actors(address=address, filters=[("state", "=", "ALIVE")],
                                 detail=True, raise_on_missing_output=False)
        return [a for a in rows if (a.name or "").startswith(prefix)]
    rows = state.list_placement_groups(address=address, detail=True,
                                       raise_on_missing_output=False)
    return [g for g in rows if g.name.startswith(prefix) and g.state != "REMOVED"]


def _wait_released(address: str, needle: str, timeout_s: float = 120.0) -> None:
    """No rollart actor or placement group alive on the cluster, no process whose command line
    names ``needle``; polled (Ray ends killed actors asynchronously), generous deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = (_ours(address, "actors"), _ours(address, "placement_groups"), _cmdlines(needle))
        if left == ([], [], []) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == ([], [], [])


def _cmdlines(needle: str) -> list[str]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
        except OSError:
            continue
        if needle.encode() in cmd and entry != str(os.getpid()):
            out.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return out


def test_a_pool_no_node_can_hold_fails_at_once_and_releases_everything(ray_cluster, tmp_path,
                                                                        cache_dir):
    from rollart.launcher.local import open_cluster
    from rollart.transport.errors import RollartError

    cluster, _ = ray_cluster

    async def run() -> None:
        async with open_cluster(_scenario(tmp_path, worker_label="h100"),
                                run_dir=tmp_path / "run", cache_dir=cache_dir,
                                cluster=f"ray://{cluster.address}"):
            raise AssertionError("the cluster has no h100 node")

    with pytest.raises(RollartError, match=r"pool-game.*no node carries \['h100'\]"):
        asyncio.run(run())
    # the services started meanwhile (trainer, env host, reward) are stopped, actors killed
    _wait_released(cluster.address, str(cache_dir))
    assert not ray.is_initialized()


def _service_pid(actor_pid: int) -> int:
    """The ``rollart serve-inference`` process under an actor's process."""
    found = [p for p in descendants(actor_pid)
             if b"rollart.inference.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(found) == 1, found
    return found[0]


def _wait_gone(pids: set[int], timeout_s: float = 120.0) -> None:
    # Ray ends a killed actor's process asynchronously: poll, with a generous deadline.
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(pids) == set()


def test_services_placed_by_label_train_and_a_killed_worker_is_named(ray_cluster, tmp_path,
                                                                     cache_dir):
    from rollart.launcher.local import open_cluster
    from rollart.launcher.procs import ProcessFailedError

    cluster, nodes = ray_cluster
    address = cluster.address
    placed: dict[str, tuple[str, int]] = {}
    pids: set[int] = set()
    steps = []

    async def run() -> None:
        async with open_cluster(_scenario(tmp_path), run_dir=tmp_path / "run",
                                cache_dir=cache_dir, cluster=f"ray://{address}") as cl:
            async with cl:
                async for out in cl.train(steps=2):
                    steps.append(out)
                for actor in await asyncio.to_thread(_ours, address, "actors"):
                    placed[actor.name.rsplit("/", 1)[1]] = (actor.node_id, actor.pid)
                for _, pid in placed.values():
                    pids.update(descendants(pid) | {pid})
                os.kill(_service_pid(placed["worker-game-0"][1]), signal.SIGKILL)
                async for out in cl.train(steps=50):  # stopped by the watcher, naming it
                    steps.append(out)

    with pytest.raises(ProcessFailedError) as info:
        asyncio.run(run())
    assert info.value.name == "worker-game-0"
    assert "last live worker of pool 'game'" in str(info.value)
    assert [s.step for s in steps[:2]] == [1, 2]
    assert all(s.metrics.num_samples == 8 for s in steps[:2])
    # every service on the node its label names
    assert {name: node for name, (node, _) in placed.items()} == {
        name: nodes[label] for name, label in LABELS.items()}
    # the engines (vLLM's EngineCore children) ran under the actors: all gone now
    assert len(pids) > 2 * len(LABELS)
    _wait_gone(pids)
    _wait_released(address, str(cache_dir))
    assert not ray.is_initialized()  # the launcher's own connection is closed
    log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "trainer serving on tcp://" in log  # the node's log came back to the run folder
