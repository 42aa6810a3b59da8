"""torchvision / torchaudio / torchcodec built for another torch than the installed one.

vLLM's CPU build pulls these unpinned from the package index, built for another torch: importing
them then fails deep inside transformers / vLLM (an operator missing, "Model architectures
['Qwen2ForCausalLM'] failed to be inspected") and every inference worker dies at start-up.
rollart generates text only and needs none of them, so the fix is to remove them. Found from
the installed packages' metadata (``importlib.metadata``): nothing is imported.
"""

from __future__ import annotations

import importlib.metadata
import re

from rollart.transport.errors import ConfigError

#: torch's companion packages whose builds must match torch's.
COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

_PIN = re.compile(r"^torch\s*(?:\(\s*)?==\s*([^\s,;)]+)")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _local(version: str) -> str:
    return version.partition("+")[2]


def mismatched_companions() -> list[str]:
    """``["torchvision 0.24.0 (needs torch==2.9.0, torch is 2.13.0+cpu)", ...]``: each
    installed companion whose own ``torch==`` requirement names another torch, or whose build
    tag (``+cpu``, ``+cu128``, none) differs from torch's on a CPU build of torch. ``[]`` when
    torch is not installed or nothing is off."""
    torch = _version("torch")
    if torch is None:
        return []
    found = []
    for name in COMPANIONS:
        version = _version(name)
        if version is None:
            continue
        requires = importlib.metadata.requires(name) or []
        pins = [m.group(1) for r in requires if (m := _PIN.match(r.strip()))]
        if pins and pins[0].partition("+")[0] != torch.partition("+")[0]:
            found.append(f"{name} {version} (needs torch=={pins[0]}, torch is {torch})")
        elif _local(torch) == "cpu" and _local(version) != "cpu":
            found.append(f"{name} {version} (not a +cpu build; torch is {torch})")
    return found


def uninstall_line() -> str:
    """The one command that removes every companion."""
    return "pip uninstall -y " + " ".join(COMPANIONS)


def check_torch_companions() -> None:
    """Raises ConfigError naming the mismatched companions and the command that removes them."""
    found = mismatched_companions()
    if found:
        raise ConfigError(f"installed packages: {', '.join(found)}: built for another torch, they "
                          "break every vLLM worker at start-up (rollart needs none of them); "
                          f"run `{uninstall_line()}`")
