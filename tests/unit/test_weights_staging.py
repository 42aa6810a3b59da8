"""Weight staging (no vLLM): checks against the checkpoint layout, checksums, completeness."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollart.transport import messages as m
from rollart.transport.errors import RemoteError
from rollart.weights.buckets import crc32_hex, tensor_to_frame
from rollart.weights.staging import CheckpointLayout, WeightStager

SHAPES = {"embed.weight": (8, 4), "norm.weight": (4,), "layer.weight": (4, 4)}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    save_file({n: torch.zeros(s) for n, s in SHAPES.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    return d


@pytest.fixture
def stager(model_dir, tmp_path):
    s = WeightStager(tmp_path / "stage", CheckpointLayout.from_model_dir(model_dir))
    yield s
    s.close()


def weights(value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full(s, value) for n, s in SHAPES.items()}


def bucket(version, index, num, named, *, checksum=None):
    metas, frames = zip(*(tensor_to_frame(n, t) for n, t in named), strict=True)
    msg = m.WeightBucket(
        version=version,
        bucket_index=index,
        num_buckets=num,
        tensors=list(metas),
        checksum=checksum or crc32_hex(frames),
    )
    return msg, list(frames)


async def stage_all(stager, version, named, per_bucket=1, current=0):
    chunks = [named[i : i + per_bucket] for i in range(0, len(named), per_bucket)]
    for i, chunk in enumerate(chunks):
        await stager.stage(*bucket(version, i, len(chunks), chunk), current)


def test_layout_reads_names_shapes_and_tie(model_dir, tmp_path):
    layout = CheckpointLayout.from_model_dir(model_dir)
    assert layout.shapes == SHAPES and layout.tied
    assert CheckpointLayout.from_model_dir(tmp_path / "nothing-here") is None


async def test_complete_version_round_trips_and_drops_tied_lm_head(stager):
    named = [*weights(1.5).items(), ("lm_head.weight", torch.ones(8, 4))]
    await stage_all(stager, 1, named, per_bucket=2)
    staged = stager.take(1, current=0)
    loaded = {}
    for path in staged.paths():
        loaded.update(load_file(path))
    assert set(loaded) == set(SHAPES)  # the tied alias was dropped
    for n, t in weights(1.5).items():
        assert torch.equal(loaded[n], t)
    stager.discard_up_to(1)
    assert stager.staged_versions() == [] and not staged.directory.exists()


async def test_checksum_mismatch_stages_nothing(stager):
    msg, frames = bucket(1, 0, 1, list(weights(1.0).items()), checksum="deadbeef")
    with pytest.raises(RemoteError) as info:
        await stager.stage(msg, frames, current=0)
    assert info.value.code == "checksum_mismatch"
    assert stager.staged_versions() == []
    with pytest.raises(RemoteError) as info:
        stager.take(1, current=0)
    assert info.value.code == "incomplete_version"


@pytest.mark.parametrize(
    ("named", "needle"),
    [
        ([("unknown.weight", torch.zeros(4))], "not in the served checkpoint"),
        ([("norm.weight", torch.zeros(5))], "shape [5]"),
        ([("norm.weight", torch.zeros(4)), ("norm.weight", torch.zeros(4))], "repeats"),
    ],
)
async def test_bad_tensors_rejected(stager, named, needle):
    with pytest.raises(RemoteError) as info:
        await stager.stage(*bucket(1, 0, 1, named), current=0)
    assert info.value.code == "bad_request" and needle in info.value.message
    assert stager.staged_versions() == []


async def test_stale_versions_rejected(stager):
    with pytest.raises(RemoteError) as info:
        await stager.stage(*bucket(2, 0, 1, [("norm.weight", torch.zeros(4))]), current=2)
    assert info.value.code == "stale_version"
    with pytest.raises(RemoteError) as info:
        stager.take(2, current=2)
    assert info.value.code == "stale_version"


async def test_inconsistent_buckets_rejected(stager):
    await stager.stage(*bucket(1, 0, 2, [("norm.weight", torch.zeros(4))]), current=0)
    with pytest.raises(RemoteError, match="num_buckets 3 differs"):
        await stager.stage(*bucket(1, 1, 3, [("embed.weight", torch.zeros(8, 4))]), current=0)
    with pytest.raises(RemoteError, match="already staged in another bucket"):
        await stager.stage(*bucket(1, 1, 2, [("norm.weight", torch.zeros(4))]), current=0)
    with pytest.raises(RemoteError, match="bucket_index 2 >= num_buckets 2"):
        await stager.stage(*bucket(1, 2, 2, [("embed.weight", torch.zeros(8, 4))]), current=0)


async def test_incomplete_versions_rejected(stager):
    named = list(weights(2.0).items())
    await stager.stage(*bucket(1, 0, 2, named[:1]), current=0)
    with pytest.raises(RemoteError, match="1 of 2 buckets missing"):
        stager.take(1, current=0)
    await stage_all(stager, 2, named[:2])  # layer.weight never sent
    with pytest.raises(RemoteError, match="'layer.weight'"):
        stager.take(2, current=0)


async def test_resent_bucket_replaces_the_first(stager):
    named = list(weights(0.0).items())
    await stage_all(stager, 1, named, per_bucket=3)
    await stage_all(stager, 1, list(weights(9.0).items()), per_bucket=3)
    (path,) = stager.take(1, current=0).paths()
    assert torch.equal(load_file(path)["norm.weight"], torch.full((4,), 9.0))


async def test_close_removes_staging_directory(model_dir, tmp_path):
    s = WeightStager(tmp_path / "stage", None)  # no layout: names are not checked
    await s.stage(*bucket(1, 0, 1, [("anything", torch.zeros(2))]), current=0)
    assert s.take(1, current=0).names() == ["anything"]
    s.close()
    assert not s.directory.exists()
