"""``rollart export RUN [--step N] OUT``: a run's trainer checkpoint as a Hugging Face folder.

A run's checkpoints are torch.distributed.checkpoint (DCP) shards of the model and its
optimizer (``rollart.trainer.checkpoint``), which neither ``transformers`` nor vLLM read. The
export loads the run's base model (``RUN/base_model.json``, ``rollart.launcher.rundir``:
architecture, config and tokenizer), puts the checkpoint's model weights into it (DCP
reshards, so a checkpoint saved by several FSDP2 ranks exports the same way) and writes::

    OUT/
      config.json, generation_config.json   the base model's, dtype set to the checkpoint's
      model.safetensors                     the checkpoint's weights, in their saved dtype
      tokenizer files                       the base model's tokenizer, unchanged
      rollart_export.json                   run folder, step, policy version, base model

``AutoModelForCausalLM.from_pretrained(OUT)`` and ``vllm.LLM(model=OUT)`` load it. The optimizer
state is left out. ``OUT`` is whatever the command line names, nothing else: a non-empty
``OUT`` is refused unless ``--force`` (then replaced as a whole, once the new folder is
complete: a failed export leaves the old one), and a folder holding the run is always refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from rollart.filemodes import apply_umask, run_shares_with_group
from rollart.transport.errors import ConfigError

#: the record of what an export holds, written beside the weights
EXPORT_RECORD = "rollart_export.json"


def checkpoint_of(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint of ``run_dir`` at ``step`` (``None``: the newest).

    Raises:
        ConfigError: ``run_dir`` is not a folder; no complete checkpoint (for ``step``: the
            steps that have one are listed).
    """
    from rollart.trainer.checkpoint import checkpoint_step, latest_checkpoint, step_dir

    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run folder")
    root = run_dir / "checkpoints"
    if step is None:
        found = latest_checkpoint(root)
        if found is None:
            raise ConfigError(f"{run_dir}: no complete checkpoint under {root}")
        return found
    d = step_dir(root, step)
    if not (d / "COMPLETE").exists():
        have = sorted(n for p in root.glob("step_*/COMPLETE")
                      if (n := checkpoint_step(p.parent)) is not None)
        what = "is not complete" if d.exists() else "does not exist"
        raise ConfigError(f"{run_dir}: the checkpoint of step {step} ({d}) {what}; complete "
                          f"checkpoints: steps {have or 'none'}")
    return d


def checkpoint_dtype(ckpt: Path) -> Any:
    """The torch dtype of the model tensors of the DCP checkpoint ``ckpt`` (its ``trainer/``)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    meta = FileSystemReader(str(ckpt / "trainer")).read_metadata()
    for key, item in meta.state_dict_metadata.items():
        props = getattr(item, "properties", None)
        if key.startswith("model.") and props is not None:
            return props.dtype
    raise ConfigError(f"{ckpt / 'trainer'}: the checkpoint holds no model tensors")


def load_checkpoint_model(base: Path, ckpt: Path) -> Any:
    """The base model ``base`` (a Hugging Face folder) with the checkpoint ``ckpt``'s model
    weights, in the checkpoint's dtype, on the CPU, in eval mode.

    Raises:
        ConfigError: the checkpoint does not fit the base model (a missing or differently
            shaped tensor: another architecture).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=checkpoint_dtype(ckpt))
    # The keys and layout the trainer saved under (save_trainer: get_state_dict), model only.
    sd = get_model_state_dict(model)
    try:
        with warnings.catch_warnings():  # one process, no group: as intended here
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            load({"model": sd}, checkpoint_id=str(ckpt / "trainer"))
    except Exception as exc:  # DCP wraps per-rank failures in its own exception types
        raise ConfigError(f"{ckpt}: its weights do not fit the base model {base}: "
                          f"{type(exc).__name__}: {exc}") from None
    set_model_state_dict(model, sd)
    return model.eval()


def _check_out(out: Path, run_dir: Path, force: bool) -> None:
    # --force replaces OUT: never a folder the run (its checkpoints) lives in.
    real_out, real_run = out.resolve(), run_dir.resolve()
    if real_out == real_run or real_out in real_run.parents:
        raise ConfigError(f"OUT {out}: holds the run folder {run_dir}; choose another folder")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"OUT {out}: not empty; choose an empty or new folder, or pass "
                          "--force to replace it")


def export(run_dir: Path, out: Path, *, step: int | None = None, force: bool = False,
           base: Path | None = None) -> dict[str, Any]:
    """Write ``run_dir``'s checkpoint at ``step`` (``None``: the newest) to ``out`` as a Hugging
    Face folder (module docstring). ``base``: the base model folder (default: the one the run
    recorded). Returns the export record (also ``out/rollart_export.json``).

    Raises:
        ConfigError: a missing run folder, base model or checkpoint (naming it), a checkpoint
            that does not fit the base model, or an ``out`` refused (non-empty without
            ``force``, not a folder, or holding the run folder).
    """
    from transformers import AutoTokenizer

    from rollart.launcher.rundir import base_model
    from rollart.trainer.checkpoint import read_json

    ckpt = checkpoint_of(run_dir, step)
    _check_out(out, run_dir, force)
    if base is None:
        base = base_model(run_dir)
    elif not (base / "config.json").is_file():
        raise ConfigError(f"--base {base}: not a Hugging Face checkpoint directory "
                          "(no config.json)")
    trainer = read_json(ckpt / "trainer.json")
    model = load_checkpoint_model(base, ckpt)
    tokenizer = AutoTokenizer.from_pretrained(base)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    record = {"run_dir": str(run_dir.resolve()), "checkpoint": str(ckpt.resolve()),
              "step": trainer["step"], "policy_version": trainer["version"],
              "base_model": str(base.resolve()), "dtype": str(model.dtype).removeprefix("torch.")}
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def _replace(new: Path, out: Path) -> None:
    # The complete new folder takes OUT's place; an old OUT goes only once it has.
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    new.rename(out)
    if old is not None:
        shutil.rmtree(old)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rollart export",
        description="Write a run's trainer checkpoint as a Hugging Face folder (config, "
                    "tokenizer, safetensors) that transformers and vLLM load.")
    p.add_argument("run_dir", type=Path, metavar="RUN", help="the run folder")
    p.add_argument("out", type=Path, metavar="OUT", help="the folder to write (new or empty)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--base", type=Path,
                   help="the base model folder (default: the one RUN/base_model.json records)")
    args = p.parse_args(argv)
    # The export is the policy: as private as the run that trained it (rollart.filemodes).
    apply_umask(args.run_dir.is_dir() and run_shares_with_group(args.run_dir))
    try:
        record = export(args.run_dir, args.out, step=args.step, force=args.force,
                        base=args.base)
    except ConfigError as exc:
        print(f"rollart export: {exc}", file=sys.stderr)
        return 2
    print(f"rollart export: step {record['step']} (policy version {record['policy_version']}) "
          f"of {args.run_dir} -> {args.out}\n  transformers: AutoModelForCausalLM."
          f"from_pretrained({str(args.out)!r}); vLLM: vllm serve {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
