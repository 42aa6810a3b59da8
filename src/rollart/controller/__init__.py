"""The asyncio controller: trajectory coroutines, LLM proxy, staleness buffer, modes, driver.

``Cluster``, ``Backends`` and ``TrainStep`` (the driver API, :mod:`rollart.controller.driver`)
are importable from here; they load lazily so that importing the pure buffer stays light.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from rollart.controller.driver import Backends, Cluster, TrainStep

__all__ = ["Backends", "Cluster", "TrainStep"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rollart.controller import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'rollart.controller' has no attribute {name!r}")
