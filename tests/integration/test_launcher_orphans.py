"""No orphans: every process a service started dies with it, whether the service died on its own
(kill -9 of the service process) or the launcher stopped it (``Supervisor.stop_all``).

Each kind of service runs for real under the launcher's ``Supervisor``: the reward service with
its process pool, an env host, the trainer, and an inference worker with the tiny model (vLLM's
``EngineCore`` / ``VLLM::Worker`` children; marked ``vllm``). Survivors are looked for among the
service's descendants recorded while it was alive, by walking ``/proc``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from proctree import alive, descendants

from rollart.launcher.procs import Supervisor, group_members, python_module

DEADLINE_S = 60.0  # generous: the machine may be loaded


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


async def _wait_for(predicate, what: str, deadline_s: float = 300.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        if predicate():
            return
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def _wait_gone(pids: set[int]) -> None:
    """Wait (up to DEADLINE_S) until none of ``pids`` runs; fail naming the survivors."""
    end = time.monotonic() + DEADLINE_S
    while True:
        left = alive(pids)
        if not left:
            return
        assert time.monotonic() < end, [_cmdline(p) for p in left]
        await asyncio.sleep(0.2)


def _read_int(path: Path) -> int:
    return int(path.read_text())


def _argv(kind: str, model_dir: Path) -> tuple[list[str], int]:
    """The service's command line and the number of child processes it is known to start."""
    if kind == "reward":  # built-in `math` / `reasoning_gym` run in its process pool
        return python_module("rollart.reward.server", "--port", "0", "--processes", "2",
                             "--no-auth"), 2
    if kind == "env":
        return python_module("rollart.envhost.host", "--name", "orphans", "--threads", "2"), 0
    if kind == "trainer":
        return python_module("rollart.trainer.service", "--model", str(model_dir)), 0
    assert kind == "worker"
    return python_module(
        "rollart.inference.worker", "--model", str(model_dir), "--name", "orphans-0",
        "--kv-cache-bytes", str(64 << 20), "--dtype", "float32", "--max-model-len", "512",
        "--enforce-eager"), 1


KINDS = ["reward", "env", "trainer", pytest.param("worker", marks=pytest.mark.vllm)]


async def _started(sup: Supervisor, kind: str, model_dir: Path) -> tuple[int, set[int]]:
    argv, min_children = _argv(kind, model_dir)
    await sup.start(kind, argv, ready_timeout_s=600.0)
    pid = sup.services[kind].proc.pid  # type: ignore[union-attr]
    await _wait_for(lambda: len(descendants(pid)) >= min_children,
                    f"{kind}: {min_children} child processes")
    return pid, descendants(pid)


@pytest.mark.parametrize("kind", KINDS)
def test_service_killed_leaves_no_survivor(kind: str, tmp_path: Path, tiny_model_dir: Path):
    async def main() -> None:
        sup = Supervisor(tmp_path)
        try:
            pid, family = await _started(sup, kind, tiny_model_dir)
            os.kill(pid, signal.SIGKILL)
            exc = await asyncio.wait_for(sup.wait_any_failure(), DEADLINE_S)
            assert exc.name == kind and exc.returncode == -signal.SIGKILL
            assert str(exc.log_path) in str(exc)
            await _wait_gone(family)
            assert group_members(pid) == []
        finally:
            await sup.stop_all()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["reward", pytest.param("worker", marks=pytest.mark.vllm)])
def test_service_stopped_leaves_no_survivor(kind: str, tmp_path: Path, tiny_model_dir: Path):
    async def main() -> None:
        sup = Supervisor(tmp_path)
        try:
            pid, family = await _started(sup, kind, tiny_model_dir)
        finally:
            await sup.stop_all()
        assert alive(family | {pid}) == set(), [_cmdline(p) for p in alive(family)]

    asyncio.run(main())


def test_stop_all_kills_children_left_by_a_dead_service(tmp_path: Path):
    """A service that died (its exit not yet watched) leaves a child that ignores SIGTERM: the
    launcher's stop still finds it through the service's process group and kills it."""
    script = tmp_path / "svc.py"
    script.write_text(
        "import os, signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "ready = sys.argv[sys.argv.index('--ready-file') + 1]\n"
        "open(ready + '.child', 'w').write(str(child.pid))\n"
        "open(ready, 'w').write('here')\n"
        "time.sleep(600)\n")

    async def main() -> None:
        sup = Supervisor(tmp_path / "run")
        await sup.start("svc", ["python3", str(script)])
        svc = sup.services["svc"]
        child = _read_int(Path(str(svc.ready_path) + ".child"))
        os.kill(svc.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        await svc.proc.wait()  # type: ignore[union-attr]
        assert alive({child}) == {child}  # orphaned, still running
        await sup.stop_all(timeout_s=DEADLINE_S, grace_s=1.0)
        await _wait_gone({child})

    asyncio.run(main())


#: A service that starts a child ignoring SIGTERM in its own process group, then idles: only a
#: stop of the whole group (``Supervisor.stop_all``) ends that child; the service's
#: parent-death signal does not reach it.
SERVICE_WITH_CHILD = (
    "import signal, subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
    "ready = sys.argv[sys.argv.index('--ready-file') + 1]\n"
    "open(ready, 'w').write('here')\n"
    "time.sleep(600)\n")

#: ``benchmarks.real_engine``'s own ``main`` in a process of its own, its workload (engines
#: and workers under a ``Supervisor``) replaced by one real service tree so no engine starts.
REAL_ENGINE_MAIN = """
import asyncio, sys
from pathlib import Path

from benchmarks import real_engine
from rollart.launcher.procs import Supervisor


async def service_tree(args, run_dir):
    sup = Supervisor(run_dir)
    try:
        await sup.start("svc", [sys.executable, sys.argv[2]])
        print("started", flush=True)
        await asyncio.sleep(3600)
    finally:
        await sup.stop_all(timeout_s=60.0, grace_s=1.0)
    return [], {}


if __name__ == "__main__":
    real_engine._run = service_tree
    real_engine.main(["--run-dir", sys.argv[1]])
"""


def test_sigterm_to_real_engine_stops_every_process_it_started(tmp_path: Path):
    """``timeout`` / a scheduler SIGTERMs the benchmark: it stops its services' whole process
    groups (``rollart.launcher.sigterm``) and exits 143, leaving no process behind."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "svc.py").write_text(SERVICE_WITH_CHILD)
    (tmp_path / "bench.py").write_text(REAL_ENGINE_MAIN)
    path = os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])  # for `benchmarks`
    bench = subprocess.Popen(
        [sys.executable, str(tmp_path / "bench.py"), str(tmp_path / "run"),
         str(tmp_path / "svc.py")], cwd=repo, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": path})
    family: set[int] = set()
    try:
        assert bench.stdout is not None
        output = bench.stdout.readline()  # "started" once the service is ready (EOF: it died)
        assert output.strip() == "started", output + bench.stdout.read()[-3000:]
        family = descendants(bench.pid)
        assert len(family) >= 2, [_cmdline(p) for p in family]  # the service and its child
        bench.send_signal(signal.SIGTERM)
        output += bench.communicate(timeout=300)[0]
        asyncio.run(_wait_gone(family))
        assert bench.returncode == 143, output[-3000:]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in alive(family):  # a failed check leaves no process behind either
            os.kill(pid, signal.SIGKILL)
