"""Checkpoints with torch.distributed.checkpoint (DCP): model + optimizer, plus small JSON state.

Layout of one checkpoint (``DIR/step_000042/``)::

    trainer/          DCP shards of {"model": ..., "optim": ...}
    trainer.json      trainer version, step, RNG states (torch CPU, python, numpy)
    controller.json   written by the controller: sample-buffer snapshot, sampler position,
                      trained sample ids (exactly-once across resume)
    COMPLETE          written last; a checkpoint without it is ignored on resume

``DIR/latest`` names the newest complete checkpoint; it is replaced atomically (rename), so a
kill at any moment leaves either the old or the new checkpoint selectable, never a torn one.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: the launcher uses only the path helpers
# (latest_checkpoint, mark_complete, ...) and must not pay for torch before checking a config.


class TrainerState(msgspec.Struct, kw_only=True):
    """Scalar trainer state saved beside the DCP shards. ``version``: updates applied."""

    version: int
    step: int
    torch_rng: list[int]
    python_rng: Any
    numpy_rng: Any


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of checkpoint folder ``path`` (``step_dir``'s ``.../step_000040``: 40);
    ``None`` for a folder not named that way."""
    digits = path.name.removeprefix("step_")
    return int(digits) if digits != path.name and digits.isdigit() else None


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "torch_rng": torch.get_rng_state().tolist(),
        "python_rng": random.getstate(),
        "numpy_rng": [
            (x.tolist() if isinstance(x, np.ndarray) else x) for x in np.random.get_state()
        ],
    }


def _set_rng_state(state: TrainerState) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(torch.tensor(state.torch_rng, dtype=torch.uint8))
    version, internal, gauss = state.python_rng
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state.numpy_rng
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_trainer(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 version: int, step: int) -> float:
    """Save model + optimizer (DCP) and trainer state under ``path``. Returns seconds taken.

    With an initialised process group (FSDP2 ranks) this is collective: every rank calls it with
    the same ``path``; each writes its own shards and rank 0 alone writes ``trainer.json`` (its
    RNG states), after DCP's save returned, i.e. once every rank's shards are written.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict_saver as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    start = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp_save.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "trainer"))
    if not dist.is_initialized() or dist.get_rank() == 0:
        state = TrainerState(version=version, step=step, **_rng_state())
        _atomic_write(path / "trainer.json", msgspec.json.encode(state))
    return time.perf_counter() - start


def load_trainer(path: Path, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> TrainerState:
    """Load what ``save_trainer`` wrote into ``model`` / ``optimizer`` and restore RNG states.

    Collective under FSDP2 (every rank, same ``path``); DCP reshards, so a checkpoint saved by
    N ranks loads into M ranks or one process. Every rank restores rank 0's RNG states.

    Raises:
        FileNotFoundError: ``path`` has no trainer checkpoint.
    """
    import torch.distributed.checkpoint.state_dict_loader as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (path / "trainer.json").exists():
        raise FileNotFoundError(f"no trainer checkpoint in {path}")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp_load.load(sd, checkpoint_id=str(path / "trainer"))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    state = msgspec.json.decode((path / "trainer.json").read_bytes(), type=TrainerState)
    _set_rng_state(state)
    return state


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def mark_complete(root: Path, step: int) -> None:
    """Seal ``step``'s checkpoint and point ``root/latest`` at it (atomic)."""
    d = step_dir(root, step)
    (d / "COMPLETE").write_text(str(step))
    _atomic_write(root / "latest", d.name.encode())


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None``."""
    marker = root / "latest"
    if not marker.exists():
        return None
    d = root / marker.read_text().strip()
    return d if (d / "COMPLETE").exists() else None


def read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())
