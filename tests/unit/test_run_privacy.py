"""A run folder is private by default: folders 0700, files 0600 (checkpoints written by
torch.distributed.checkpoint, metrics, transcripts, TensorBoard, summary, config), and another
user cannot read a checkpoint; with ``output.share_with_group`` they are group-readable (0750 /
0640). ``open_cluster``, ``rollart run`` and every service's ``main`` set the umask themselves,
and an existing folder is narrowed by chmod."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from helpers.fakes import (
    TOK,
    FakeEnvHost,
    FakeReward,
    FakeTrainer,
    FakeWorker,
    make_scenario,
)
from rollart.config import OutputConfig, load_scenario
from rollart.controller import Backends, Cluster
from rollart.filemodes import SHARE_ENV, apply_umask, restrict_tree
from rollart.launcher import rundir
from rollart.trainer.checkpoint import mark_complete, save_trainer, step_dir
from rollart.transport.errors import ConfigError

MINIMAL = Path(__file__).resolve().parents[1] / "minimal_scenario.toml"


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The usual login umask (0o022) during the test, restored after it."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def current_umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def modes(root: Path) -> dict[str, int]:
    """Mode of every entry under ``root`` (and of ``root`` itself, as ".")."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


async def _fake_run(run_dir: Path, steps: int) -> None:
    """A short run over the fakes, its folder written by ``RunFolder`` as a real run's is."""
    scenario = msgspec.structs.replace(make_scenario(redundancy=1), output=msgspec.convert(
        {"transcripts_per_step": 4, "transcript_rate": 1.0}, OutputConfig))
    folder = rundir.RunFolder(run_dir, scenario)
    b = Backends(pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]},
                 trainer=FakeTrainer(train_s=0.0), tokenizer=TOK,
                 env_hosts=[FakeEnvHost(turns=2)], reward_service=FakeReward())
    cluster = Cluster.from_scenario(scenario, backends=b,
                                    transcripts=folder.transcript_recorder(TOK))
    cluster.add_step_hook(folder.on_step)
    async with cluster:
        async with asyncio.timeout(120):
            async for _ in cluster.train(steps=steps):
                pass
    folder.close()


def write_run(run_dir: Path) -> Path:
    """The run folder's real writers in this process: ``prepare``, ``config.json``, a short run
    through ``RunFolder`` (metrics, samples, transcripts, TensorBoard), a DCP checkpoint, the
    summary. Returns the checkpoint's step folder."""
    rundir.prepare(run_dir, None)
    scenario = load_scenario(MINIMAL)
    (run_dir / "config.json").write_bytes(msgspec.json.encode(scenario))
    asyncio.run(_fake_run(run_dir, steps=2))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    ckpt = step_dir(run_dir / "checkpoints", 2)
    save_trainer(ckpt, model, opt, version=2, step=2)
    mark_complete(run_dir / "checkpoints", 2)
    rundir.write_summary(run_dir, scenario, 0.0)
    return ckpt


def split(found: dict[str, int], root: Path) -> tuple[set[int], set[int]]:
    dirs = {m for name, m in found.items() if (root / name).is_dir()}
    files = {m for name, m in found.items() if not (root / name).is_dir()}
    return dirs, files


@pytest.mark.usefixtures("loose_umask")
def test_a_run_folder_and_its_checkpoint_are_private(tmp_path: Path) -> None:
    apply_umask(False)
    run_dir = tmp_path / "run"
    ckpt = write_run(run_dir)
    found = modes(run_dir)
    distcp = [p for p in (ckpt / "trainer").iterdir() if p.suffix == ".distcp"]
    assert distcp, "torch.distributed.checkpoint wrote no .distcp file"
    for name in ("metrics.jsonl", "transcripts.jsonl", "trained_samples.jsonl", "summary.json",
                 "config.json"):
        assert found[name] == 0o600, name
    assert any(name.startswith("tensorboard/") for name in found)
    dirs, files = split(found, run_dir)
    assert (dirs, files) == ({0o700}, {0o600}), found


@pytest.mark.usefixtures("loose_umask")
def test_shared_with_the_group_the_folder_is_group_readable(tmp_path: Path) -> None:
    apply_umask(True)
    run_dir = tmp_path / "run"
    write_run(run_dir)
    dirs, files = split(modes(run_dir), run_dir)
    assert (dirs, files) == ({0o750}, {0o640})


@pytest.mark.usefixtures("loose_umask")
def test_rollart_report_writes_as_privately_as_the_run(tmp_path: Path) -> None:
    from rollart.launcher.report import main as report

    apply_umask(False)
    run_dir = tmp_path / "run"
    write_run(run_dir)
    os.umask(0o022)  # `rollart report` is run later, from the user's shell
    assert report([str(run_dir)]) == 0
    dirs, files = split(modes(run_dir / "report"), run_dir / "report")
    assert (dirs, files) == ({0o700}, {0o600})


@pytest.mark.usefixtures("loose_umask")
def test_an_existing_folder_is_narrowed_and_nothing_is_loosened(tmp_path: Path) -> None:
    run_dir = tmp_path / "out"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "old.log").write_text("x")
    (run_dir / "keys").mkdir(mode=0o700)
    (run_dir / "keys" / "run.key_secret").write_text("k")
    os.chmod(run_dir / "keys" / "run.key_secret", 0o600)
    assert modes(run_dir)["logs/old.log"] == 0o644
    assert restrict_tree(run_dir, share_with_group=True) == 3  # ".", logs, old.log
    found = modes(run_dir)
    assert (found["."], found["logs"], found["logs/old.log"]) == (0o750, 0o750, 0o640)
    assert (found["keys"], found["keys/run.key_secret"]) == (0o700, 0o600)
    restrict_tree(run_dir)
    assert split(modes(run_dir), run_dir) == ({0o700}, {0o600})


def test_apply_umask_keeps_stricter_bits_and_reads_the_environment(monkeypatch) -> None:
    old = os.umask(0o007)
    try:
        assert apply_umask(True) == 0o007 and current_umask() == 0o027
        os.umask(0o077)
        apply_umask(True)
        assert current_umask() == 0o077  # never loosened
        os.umask(0o022)
        monkeypatch.setenv(SHARE_ENV, "1")
        apply_umask()
        assert current_umask() == 0o027
        monkeypatch.delenv(SHARE_ENV)
        apply_umask()
        assert current_umask() == 0o077
    finally:
        os.umask(old)


@pytest.mark.usefixtures("loose_umask")
@pytest.mark.parametrize("module", ["rollart.inference.worker", "rollart.envhost.host",
                                    "rollart.reward.server", "rollart.trainer.service"])
def test_every_service_main_sets_the_umask_first(module: str) -> None:
    main = __import__(module, fromlist=["main"]).main
    with pytest.raises(SystemExit):
        main(["--help"])
    assert current_umask() == 0o077


@pytest.mark.usefixtures("loose_umask")
def test_rollart_run_sets_the_umask_from_the_scenario(tmp_path: Path) -> None:
    from rollart.launcher.run import main

    sc = tmp_path / "s.toml"
    sc.write_text(MINIMAL.read_text() + "[[env_hosts]]\nname = 'e'\n[output]\n"
                  "share_with_group = true\n")
    assert main([str(sc), "--steps", "0"]) == 2  # refused after the umask was set
    assert current_umask() == 0o027


@pytest.mark.usefixtures("loose_umask")
def test_open_cluster_writes_the_run_folder_privately_and_restores_the_umask(
        tmp_path: Path) -> None:
    from rollart.launcher.local import open_cluster

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # resolve_model only checks it is there
    sc = tmp_path / "s.toml"
    sc.write_text(MINIMAL.read_text() + f"[[env_hosts]]\nname = 'e'\n[model]\npath = '{model}'\n")
    run_dir = tmp_path / "out"
    run_dir.mkdir(mode=0o755)  # a reused --out
    (run_dir / "notes.txt").write_text("mine")

    async def go() -> None:
        # A key file that does not exist fails the start after the folder was prepared.
        async with open_cluster(sc, run_dir=run_dir, key_file=tmp_path / "missing.key_secret"):
            pass

    with pytest.raises(ConfigError, match="missing.key_secret"):
        asyncio.run(go())
    found = modes(run_dir)
    assert found["."] == 0o700 and found["config.json"] == 0o600
    assert found["notes.txt"] == 0o600  # there before the run: narrowed by chmod
    assert json.loads((run_dir / "config.json").read_text())["run"]["batch_size"] == 8
    assert current_umask() == 0o022  # a driver script's own umask is given back


def _other_user() -> pwd.struct_passwd | None:
    for name in ("nobody", "nfsnobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


def _read_as(user: pwd.struct_passwd, path: Path) -> str:
    """Try to read ``path`` in a forked child running as ``user``: "ok", "denied" or an
    error name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the other user, try, report, exit without cleanup
        code = b"?"
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            try:
                with open(path, "rb") as f:
                    f.read(1)
                code = b"ok"
            except PermissionError:
                code = b"denied"
            except OSError as exc:
                code = type(exc).__name__.encode()
        finally:
            os.write(w, code)
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            out = f.read().decode()
    finally:
        os.waitpid(pid, 0)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses fork and setuid")
@pytest.mark.usefixtures("loose_umask")
def test_another_user_cannot_read_a_checkpoint() -> None:
    user = _other_user()
    if os.geteuid() != 0 or user is None:
        pytest.skip("needs root (to become another user) and a 'nobody' account")
    # Under /tmp, whose path every user may traverse, so a refusal is the run folder's doing.
    parent = Path(tempfile.mkdtemp(prefix="rollart-privacy-", dir="/tmp"))
    try:
        os.chmod(parent, 0o755)
        public = parent / "public.txt"
        public.write_text("anyone")
        assert _read_as(user, public) == "ok"  # the check itself works
        apply_umask(False)
        ckpt = write_run(parent / "run")
        distcp = next(p for p in (ckpt / "trainer").iterdir() if p.suffix == ".distcp")
        assert _read_as(user, distcp) == "denied"
        # Even with every folder on its path opened up, the file's own mode refuses.
        for d in (parent / "run", parent / "run" / "checkpoints", ckpt, ckpt / "trainer"):
            os.chmod(d, 0o755)
        assert _read_as(user, distcp) == "denied"
        os.chmod(distcp, 0o644)
        assert _read_as(user, distcp) == "ok"  # a 0644 checkpoint (as before) was readable
    finally:
        import shutil

        shutil.rmtree(parent, ignore_errors=True)
