"""rollart.trainer.access: the worker registry and checkpoint-path confinement rules."""

from __future__ import annotations

import pytest

from rollart.trainer.access import CheckpointPathError, WorkerRegistry, resolve_checkpoint
from rollart.transport.errors import RemoteError


def test_registration_is_once_and_closed_afterwards():
    reg = WorkerRegistry()
    with pytest.raises(RemoteError, match="no workers are registered") as err:
        reg.check(["tcp://evil:1"], "PublishLatest")
    assert err.value.code == "forbidden"
    reg.check([], "SetWorkers")  # an empty push set needs no registration
    reg.register(["tcp://w0:1", "tcp://w1:1"])
    reg.check(["tcp://w1:1"], "SetWorkers")
    reg.register(["tcp://w0:1"])  # a repeat naming registered workers only is accepted
    with pytest.raises(RemoteError, match=r"RegisterWorkers: workers \['tcp://evil:1'\]") as err:
        reg.register(["tcp://w0:1", "tcp://evil:1"])
    assert err.value.code == "forbidden"
    with pytest.raises(RemoteError, match=r"PublishLatest: address\(es\) \['tcp://evil:1'\]"):
        reg.check(["tcp://w0:1", "tcp://evil:1"], "PublishLatest")
    assert reg.registered == ["tcp://w0:1", "tcp://w1:1"]


def test_workers_given_at_start_close_the_set():
    reg = WorkerRegistry(["tcp://w0:1"])
    with pytest.raises(RemoteError, match="already registered"):
        reg.register(["tcp://other:2"])
    with pytest.raises(RemoteError) as err:
        reg.register([])
    assert err.value.code == "bad_request"


def test_checkpoint_names_resolve_under_the_root(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    assert resolve_checkpoint(root, "step_000004") == root.resolve() / "step_000004"
    assert resolve_checkpoint(root, "a/b") == root.resolve() / "a" / "b"
    assert resolve_checkpoint(root, "a/./c") == root.resolve() / "a" / "c"


@pytest.mark.parametrize(("name", "fragment"), [
    ("/tmp/elsewhere", "not an absolute path"),
    ("../outside", "'..' may not appear"),
    ("step/../../outside", "'..' may not appear"),
    ("", "not an absolute path"),
    (".", "outside the checkpoint directory"),
    ("a\\..\\b", "not an absolute path"),
])
def test_checkpoint_names_outside_the_root_are_refused(tmp_path, name, fragment):
    root = tmp_path / "checkpoints"
    root.mkdir()
    with pytest.raises(CheckpointPathError, match=fragment):
        resolve_checkpoint(root, name)


def test_a_symlink_escaping_the_root_is_refused(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(CheckpointPathError, match="symlinks are followed"):
        resolve_checkpoint(root, "link/step_1")
    (root / "inner").mkdir()
    (root / "ok").symlink_to(root / "inner")  # a link staying inside is fine
    assert resolve_checkpoint(root, "ok/s") == root.resolve() / "inner" / "s"


def test_no_root_means_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointPathError, match="--checkpoint-dir"):
        resolve_checkpoint(None, "step_000001")
