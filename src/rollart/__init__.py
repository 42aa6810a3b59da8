"""rollart: disaggregated, staleness-bounded agentic RL training for LLMs.

``rollart.Cluster`` (the driver API) is imported lazily, so ``import rollart`` stays cheap for
service processes that never drive a cluster.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Backends", "Cluster", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Cluster", "Backends"):
        from rollart.controller import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'rollart' has no attribute {name!r}")
