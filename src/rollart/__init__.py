"""rollart: disaggregated, staleness-bounded agentic RL training for LLMs.

``rollart.Cluster`` (the driver API) and ``rollart.open_cluster`` (a cluster of local processes
from a scenario) are imported lazily, so ``import rollart`` stays cheap for
service processes that never drive a cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollart import logredact

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from rollart.controller.driver import Backends, Cluster
    from rollart.launcher.local import open_cluster
    from rollart.planner import plan
    from rollart.transport.errors import InvalidActionError
    from rollart.transport.security import run_credentials

# Before any rollart code logs: tokens never reach a log line (rollart.logredact).
logredact.install()

__version__ = "0.1.0"
__all__ = ["Backends", "Cluster", "InvalidActionError", "__version__", "open_cluster",
           "plan", "run_credentials"]


def __getattr__(name: str) -> Any:
    if name in ("Cluster", "Backends"):
        from rollart.controller import driver

        return getattr(driver, name)
    if name == "InvalidActionError":  # raised by env code on a malformed action
        from rollart.transport.errors import InvalidActionError

        return InvalidActionError
    if name == "open_cluster":
        from rollart.launcher.local import open_cluster

        return open_cluster
    if name == "plan":  # the layout planner (imports the simulator and the controller)
        from rollart.planner import plan

        return plan
    if name == "run_credentials":
        from rollart.transport.security import run_credentials

        return run_credentials
    raise AttributeError(f"module 'rollart' has no attribute {name!r}")
