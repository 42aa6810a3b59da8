"""Modes of the files rollart writes: private to the user by default, readable by the group on
request.

A run folder holds what must not leak to other users of the machine: trainer checkpoints (the
policy and its optimizer state), transcripts, trained samples, the config and logs. Every
process that writes them sets its umask first (:func:`apply_umask`): ``rollart run`` /
``open_cluster`` and each service's ``main`` (``serve-inference``, ``serve-env``,
``serve-reward``, ``serve-trainer``), so that files are created ``0600`` and folders ``0700``
whatever library writes them (``torch.distributed.checkpoint``, TensorBoard, ``open``). With
``[output] share_with_group = true`` (or ``ROLLART_SHARE_WITH_GROUP=1`` in a service's
environment, which the launcher passes to the services it starts) the umask is ``0o027``: files
``0640``, folders ``0750``. A umask only narrows what a process would otherwise create: one
already stricter than these is kept.

What a umask cannot cover, a folder that already existed (a reused ``--out``, a resumed run),
:func:`restrict_tree` narrows by ``chmod``. Key and token files are made ``0600`` by their own
writers in every case (``rollart.transport.security``, ``rollart.reward.auth``).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

#: environment variable: ``"1"`` lets the group read what a service writes (umask ``0o027``)
SHARE_ENV = "ROLLART_SHARE_WITH_GROUP"
#: umask of a private run: files 0600, folders 0700
PRIVATE_UMASK = 0o077
#: umask of a run shared with the group: files 0640, folders 0750
GROUP_UMASK = 0o027


def share_from_env() -> bool:
    """Whether ``$ROLLART_SHARE_WITH_GROUP`` asks to share with the group (``"1"``)."""
    return os.environ.get(SHARE_ENV, "0").strip() == "1"


def umask_for(share_with_group: bool) -> int:
    """``GROUP_UMASK`` if sharing with the group, else ``PRIVATE_UMASK``."""
    return GROUP_UMASK if share_with_group else PRIVATE_UMASK


def apply_umask(share_with_group: bool | None = None) -> int:
    """Narrow this process's umask to :func:`umask_for` (``None``: from
    ``$ROLLART_SHARE_WITH_GROUP``), keeping any stricter bits it already had. Process-wide and
    inherited by the children started afterwards.

    Returns:
        The previous umask (to restore it with ``os.umask``).
    """
    if share_with_group is None:
        share_with_group = share_from_env()
    old = os.umask(0o077)
    os.umask(old | umask_for(share_with_group))
    return old


def run_shares_with_group(run_dir: Path) -> bool:
    """``output.share_with_group`` of the run in ``run_dir`` (its ``config.json``), for a
    process writing into a run folder it did not start (``rollart report``); False when
    unknown."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
        return config.get("output", {}).get("share_with_group", False) is True
    except (OSError, ValueError, AttributeError):
        return False


def restrict_tree(root: Path, share_with_group: bool = False) -> int:
    """Remove from ``root`` and everything under it the permission bits
    ``umask_for(share_with_group)`` masks (never adds any; symlinks are not followed).

    Returns:
        How many entries had their mode changed.
    Raises:
        OSError: ``root`` cannot be read or an entry's mode cannot be changed.
    """
    mask = umask_for(share_with_group)
    changed = 0

    def narrow(path: str) -> None:
        nonlocal changed
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return
        mode = stat.S_IMODE(st.st_mode)
        if mode & mask:
            os.chmod(path, mode & ~mask)
            changed += 1

    narrow(str(root))
    for folder, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            narrow(os.path.join(folder, name))
    return changed
