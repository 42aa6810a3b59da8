"""``benchmarks.gitbaseline`` reads old modules from git into a temporary package: imports among
them point at the package, the rest at this tree; a missing ref, path or git is a
``BaselineUnavailable`` naming what is missing, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks import gitbaseline
from benchmarks.gitbaseline import Baseline, BaselineUnavailable, extract

#: today's rpc.py imports SocketPump from zmqloop: the import the package must redirect
TRANSPORT = Baseline(ref="HEAD", modules={"zmqloop": "src/rollart/transport/zmqloop.py",
                                          "rpc": "src/rollart/transport/rpc.py"},
                     what="the transport at HEAD")


@pytest.fixture
def head() -> str:
    try:
        return gitbaseline.resolve("HEAD")
    except BaselineUnavailable as e:  # a source tree without .git: nothing to read from
        pytest.skip(f"no git history here: {e}")


def test_modules_import_each_other_from_the_package_and_the_rest_from_this_tree(
        head: str) -> None:
    with extract(TRANSPORT) as checkout:
        assert checkout.commit == head and checkout.ref == "HEAD"
        rpc = checkout.module("rpc")
        assert rpc.__name__ == f"{checkout.package}.rpc"
        assert rpc.SocketPump.__module__ == f"{checkout.package}.zmqloop"
        assert rpc.m.__name__ == "rollart.transport.messages"
        # Only the import line changed: the rest is git's text.
        original = subprocess.run(["git", "-C", str(gitbaseline.ROOT), "show",
                                   f"{head}:src/rollart/transport/rpc.py"], check=True,
                                  capture_output=True, text=True).stdout
        written = (checkout.directory / checkout.package / "rpc.py").read_text()
        changed = [(a, b) for a, b in zip(original.splitlines(), written.splitlines(),
                                          strict=True) if a != b]
        assert changed == [("from rollart.transport.zmqloop import MAX_BATCH_FRAME_BYTES, "
                            "Part, SocketPump",
                            f"from {checkout.package}.zmqloop import MAX_BATCH_FRAME_BYTES, "
                            "Part, SocketPump")]
        directory, package = checkout.directory, checkout.package
    assert not directory.exists() and str(directory) not in sys.path
    assert not [k for k in sys.modules if k.startswith(package)]


def test_a_ref_that_is_not_a_commit_names_itself_and_the_shallow_clone_fix(head: str) -> None:
    with pytest.raises(BaselineUnavailable, match=r"'no-such-ref-anywhere'.*--unshallow"):
        extract(TRANSPORT, "no-such-ref-anywhere")


def test_a_path_the_ref_lacks_is_named_and_leaves_no_directory(
        head: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gitbaseline.tempfile, "tempdir", str(tmp_path))
    missing = Baseline(ref="HEAD", modules={"x": "src/rollart/no_such_module.py"}, what="none")
    with pytest.raises(BaselineUnavailable, match="no_such_module.py"):
        extract(missing)
    assert list(tmp_path.iterdir()) == []


def test_without_git_the_reason_is_git_itself(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable on it
    with pytest.raises(BaselineUnavailable, match="git is not installed"):
        extract(TRANSPORT)
