"""Argument types shared by the ``rollart`` commands."""

from __future__ import annotations

import argparse
from pathlib import Path


def path_arg(text: str) -> Path:
    """An argparse ``type`` for a path: refuses an empty or blank value (which ``Path`` would
    read as ``.``, the current directory) with a message argparse prints beside the option's
    name, exit status 2.

    Raises:
        argparse.ArgumentTypeError: ``text`` is empty or only whitespace.
    """
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a file or folder")
    return Path(text)
