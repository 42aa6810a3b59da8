"""``rollart run``: launch and supervise every process of a scenario locally."""

from rollart.launcher.run import main

__all__ = ["main"]
