"""What ``rollart run`` needs of this machine and of the services it starts, checked before any
process starts (by ``rollart run`` and by ``rollart validate``).

Each check raises ``ConfigError`` naming the scenario field (or option) and the fix:

- ``service_rewards``: a domain scored by the reward service (``reward_url = "service"``, the
  service the launcher starts) names a function the service serves: a built-in
  (``rollart.reward.builtins``) or one of ``reward.modules`` (read in a child process, so the
  user's modules are not imported here).
- ``trainer_device``: ``trainer.device = "cuda"`` needs a torch built with CUDA and a GPU it
  can see; torch is never imported in this process (its wheel's ``+cpu`` tag, else a child
  process asks ``torch.cuda.is_available()``).
- ``wandb_installed``: ``output.wandb = true`` needs the ``wandb`` package.
- ``ray_reachable``: ``--cluster ray`` / ``ray://HOST:PORT`` needs Ray installed and a cluster
  answering (``$RAY_ADDRESS``, Ray's ``ray_current_cluster`` file or a local ``gcs_server``;
  a TCP connect to the address, nothing imports Ray).
- ``model_path``: a ``model.path`` other than ``tiny`` is a local checkpoint directory.
- ``torch_companions``: torchvision / torchaudio / torchcodec built for another torch
  (``rollart.inference.companions``) break every vLLM worker at start-up.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from rollart.config import Scenario
from rollart.config.validate import suggest
from rollart.transport.errors import ConfigError

#: seconds a child process may take to import torch and answer (a loaded machine is slow).
PROBE_TIMEOUT_S = 120.0
#: seconds a TCP connect to a Ray cluster's address may take.
RAY_CONNECT_TIMEOUT_S = 5.0


def builtin_reward_names() -> list[str]:
    """Names the reward service always serves (the ``@reward_function`` marks of
    ``rollart.reward.builtins``; that module imports nothing heavy)."""
    from rollart.reward import builtins
    from rollart.reward.registry import marked_spec

    return sorted(spec.name for value in vars(builtins).values()
                  if (spec := marked_spec(value)) is not None)


_MODULE_NAMES = """
import sys
from rollart.reward.server import build_registry
print("\\n".join(build_registry(sys.argv[1:]).names()))
"""


def module_reward_names(modules: list[str]) -> list[str]:
    """Names the reward service serves with ``reward.modules`` (built-ins included), read as the
    service reads them but in a child process (a user module may import anything).

    Raises:
        ConfigError: a module does not import or marks no function (the service would not
            start either), naming ``reward.modules``.
    """
    try:
        out = subprocess.run([sys.executable, "-c", _MODULE_NAMES, *modules],
                             capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"reward.modules: {modules} took over {PROBE_TIMEOUT_S:g} s to "
                          "import") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"reward.modules: the reward service could not load {modules}: "
                          f"{last}")
    return out.stdout.split()


def service_rewards(scenario: Scenario) -> None:
    """Every domain with ``reward_url = "service"`` names a function of the service the
    launcher starts. A running service (``reward.url``) and other endpoints are not asked.

    Raises:
        ConfigError: ``domains[i].reward`` unknown, naming the served functions.
    """
    if scenario.reward.url is not None:
        return
    wanted = [(i, d.reward) for i, d in enumerate(scenario.domains) if d.reward_url == "service"]
    known = builtin_reward_names()
    if all(name in known for _, name in wanted):
        return
    if scenario.reward.modules:
        known = module_reward_names(scenario.reward.modules)
    for i, name in wanted:
        if name not in known:
            raise ConfigError(
                f"domains[{i}].reward: the reward service serves no function {name!r}"
                f"{suggest(name, known)}; it serves {known}: load yours with "
                "reward.modules = [\"pkg.mod\"], or score it in-process (reward_url = "
                "\"local\" with run.local_module's REWARDS)")


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def trainer_device(scenario: Scenario) -> None:
    """``trainer.device = "cuda"`` on a machine whose torch has CUDA and sees a GPU.

    Raises:
        ConfigError: torch missing, a CPU build (``+cpu``), or ``torch.cuda.is_available()``
            false in a child process (no driver, no visible device).
    """
    if scenario.trainer.device != "cuda":
        return
    fix = "set trainer.device = \"cpu\" (or install a CUDA build of torch on a GPU machine)"
    version = _torch_version()
    if version is None:
        raise ConfigError(f"trainer.device: \"cuda\", but torch is not installed here; {fix}")
    if version.endswith("+cpu"):
        raise ConfigError(f"trainer.device: \"cuda\", but torch {version} is a CPU-only build; "
                          f"{fix}")
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()))"],
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return  # slow, not refused: the trainer will say
    if out.stdout.strip() != "1":
        raise ConfigError(f"trainer.device: \"cuda\", but torch {version} sees no CUDA device "
                          f"here (torch.cuda.is_available() is false); {fix}")


def wandb_installed(scenario: Scenario) -> None:
    """Raises ConfigError when ``output.wandb`` is set and ``wandb`` cannot be imported."""
    if scenario.output.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("output.wandb: true, but the wandb package is not installed: "
                          "pip install wandb, or set output.wandb = false")


def _gcs_server_running() -> bool:
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if pid.isdigit():
            try:
                if b"gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:
                    return True
            except OSError:
                continue
    return False


def ray_reachable(address: str | None, option: str = "--cluster") -> None:
    """``address`` (``rollart.launcher.placement.parse_cluster``'s: ``None`` local, ``"auto"``
    or ``HOST:PORT``) names a Ray cluster this machine can reach.

    Raises:
        ConfigError: Ray not installed, no cluster found for ``"auto"``, or nothing accepting
            a TCP connection at the address within ``RAY_CONNECT_TIMEOUT_S``.
    """
    if address is None:
        return
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"{option}: Ray is not installed here: pip install 'rollart[ray]', "
                          "or run with --cluster local")
    where = address
    if address == "auto":
        temp = os.environ.get("RAY_TMPDIR") or str(Path(tempfile.gettempdir()) / "ray")
        current = Path(temp) / "ray_current_cluster"
        where = os.environ.get("RAY_ADDRESS") or ""
        if not where and current.exists():
            where = current.read_text().strip()
        if where in ("", "auto"):
            if _gcs_server_running():
                return  # a local cluster Ray finds by its processes
            raise ConfigError(f"{option} ray: no running Ray cluster found on this machine (no "
                              f"$RAY_ADDRESS, no {current}): start one with `ray start --head`, "
                              "name one with --cluster ray://HOST:PORT, or run with "
                              "--cluster local")
    host, _, port = where.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)),
                                      timeout=RAY_CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{option}: no Ray cluster answers at {where} "
                          f"({getattr(exc, 'strerror', None) or exc}): start it with `ray start "
                          "--head`, check the address, or run with --cluster local") from None


def model_path(scenario: Scenario) -> None:
    """Raises ConfigError when ``model.path`` is neither ``tiny`` nor a local Hugging Face
    checkpoint directory (``config.json`` in it); rollart never downloads models."""
    if scenario.model.path == "tiny":
        return
    path = Path(scenario.model.path)
    if not (path / "config.json").exists():
        raise ConfigError(f"model.path: {path} is not a local Hugging Face checkpoint "
                          "directory (no config.json); rollart never downloads models: "
                          "download it first (e.g. `huggingface-cli download NAME --local-dir "
                          "DIR`) and give DIR, or use path = \"tiny\"")


def refusals(scenario: Scenario, cluster: str | None = None) -> list[str]:
    """Every reason ``rollart run`` (``--cluster cluster``) would refuse ``scenario`` on this
    machine, one message each, in the order above; ``[]`` when none. Never imports torch,
    vLLM, Ray or the user's reward modules in this process."""
    from rollart.launcher.placement import parse_cluster

    try:
        address = parse_cluster(cluster)
    except ConfigError as exc:
        return [str(exc)]
    checks = [lambda: service_rewards(scenario), lambda: wandb_installed(scenario),
              lambda: model_path(scenario), lambda: ray_reachable(address)]
    if address is None:  # on Ray the trainer and the workers run on other nodes
        from rollart.inference.companions import check_torch_companions

        checks += [lambda: trainer_device(scenario), check_torch_companions]
    found = []
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            found.append(str(exc))
    return found
