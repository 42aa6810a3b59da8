"""Multi-process trainer pieces that need no second process: the ``trainer.num_processes``
config rules, the launcher's torchrun command line and GPU binding, the data-parallel
micro-batch plan, the rank commands' encoding and finding the layers to shard."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from rollart.config import ConfigError, parse_scenario
from rollart.launcher.services import trainer_argv, trainer_env
from rollart.models.tiny import TinyModelSpec, init_tiny_model
from rollart.trainer.distributed import (
    SaveCommand,
    SnapshotCommand,
    StopCommand,
    TrainCommand,
    decode_command,
    decoder_layers,
    encode_command,
)
from rollart.trainer.step import TrainSample, plan_microbatches, shard_samples

#: the smallest valid scenario (shared with the integration tests)
MINIMAL = (Path(__file__).parents[1] / "minimal_scenario.toml").read_text()


def _scenario(trainer: str, pools: str = ""):
    text = MINIMAL.replace('[[pools]]\nname = "cpu"', '[[pools]]\nname = "cpu"' + pools)
    return parse_scenario(text + "[trainer]\n" + trainer, "t.toml")


def _sample(i: int, length: int) -> TrainSample:
    return TrainSample.from_lists(token_ids=[5] * length, loss_mask=[0] + [1] * (length - 1),
                       behaviour_logprobs=[0.0] + [-1.0] * (length - 1), advantage=1.0,
                       sample_id=f"s{i}")


def test_num_processes_defaults_to_one_and_is_bounded() -> None:
    assert parse_scenario(MINIMAL).trainer.num_processes == 1
    assert _scenario("num_processes = 4").trainer.num_processes == 4
    for bad, reason in (("0", "Expected `int` >= 1"), ("65", "Expected `int` <= 64"),
                        ('"2"', "Expected `int`, got `str`")):
        with pytest.raises(ConfigError, match=f"trainer.num_processes: {reason}"):
            _scenario(f"num_processes = {bad}")


def test_num_processes_times_minibatches_must_fit_the_batch() -> None:
    assert _scenario("num_processes = 4\nnum_minibatches = 2").trainer.num_processes == 4
    with pytest.raises(ConfigError, match=r"t.toml: trainer.num_processes: 3 ranks x "
                       r"trainer.num_minibatches 3 exceeds run.batch_size 8"):
        _scenario("num_processes = 3\nnum_minibatches = 3")


def test_trainer_argv_uses_torchrun_only_for_several_processes(tmp_path: Path) -> None:
    one = trainer_argv(_scenario(""), tmp_path, None)
    assert one[:3] == [sys.executable, "-m", "rollart.trainer.service"]
    two = trainer_argv(_scenario("num_processes = 2"), tmp_path, tmp_path / "ck")
    assert two[:8] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "2", "-m", "rollart.trainer.service"]
    # the same arguments, but torch's default threads per rank (the single process takes the
    # cores the local CPU engine leaves: test_a_cpu_trainer_takes_the_cores_...)
    i = one.index("--options")
    options = json.loads(one[i + 1])
    assert json.loads(two[8 + i - 2])["num_threads"] == 0
    one[i + 1] = msgspec.json.encode({**options, "num_threads": 0}).decode()
    assert two[8:] == one[3:] + ["--resume", str(tmp_path / "ck")]


def test_trainer_env_exposes_one_gpu_per_rank_after_the_workers() -> None:
    gpu_pool = '\nhardware = "h100"\nnum_workers = 2\n[pools.engine]\ntensor_parallel_size = 2'
    assert trainer_env(_scenario('device = "cuda"', gpu_pool)) == {"CUDA_VISIBLE_DEVICES": "4"}
    assert trainer_env(_scenario('device = "cuda"\nnum_processes = 3', gpu_pool)) == {
        "CUDA_VISIBLE_DEVICES": "4,5,6"}
    assert trainer_env(_scenario("num_processes = 2")) == {}


def test_shards_partition_the_minibatch_and_plans_agree_on_the_pass_count() -> None:
    samples = [_sample(i, n) for i, n in enumerate([6, 11, 16, 10, 15])]
    shards = [shard_samples(samples, r, 2) for r in range(2)]
    assert sorted(s.sample_id for sh in shards for s in sh) == [s.sample_id for s in samples]
    assert [s.num_tokens for s in shards[0]] == [16, 11, 6]  # longest-first, dealt in turn
    plans = [plan_microbatches(samples, r, 2, 16) for r in range(2)]
    assert [len(mbs) for mbs, _ in plans] == [3, 2]
    assert [len(mbs) + pad for mbs, pad in plans] == [3, 3]  # same number of passes
    # More ranks than samples: the idle rank only pads.
    assert plan_microbatches(samples[:1], 1, 2, 16) == ([], 1)
    with pytest.raises(ValueError, match="rank 2 outside"):
        shard_samples(samples, 2, 2)


def test_commands_round_trip_through_msgpack_and_reject_junk() -> None:
    cmds = [TrainCommand(samples=[_sample(0, 4)]), SaveCommand(path="/x", version=3, step=2),
            StopCommand()]
    for cmd in cmds:
        assert decode_command(encode_command(cmd)) == cmd
    with pytest.raises(msgspec.ValidationError):
        decode_command(msgspec.msgpack.encode({"type": "Explode"}))


def test_decoder_layers_are_found_or_named_as_missing() -> None:
    model = init_tiny_model(TinyModelSpec(seed=0, hidden_size=64, num_layers=2, num_heads=2,
                                          intermediate_size=128))
    assert decoder_layers(model) is model.model.layers
    with pytest.raises(ValueError, match="cannot shard Linear with FSDP2: no decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))


class FakeRanks:
    """A rank group whose link to the other ranks is broken (``send`` raises) or replays
    ``commands`` to a follower."""

    def __init__(self, rank: int = 0, commands=(), broken: bool = False) -> None:
        self.rank, self.world_size = rank, 2
        self.commands = list(commands)
        self.broken = broken
        self.sent: list = []
        self.closed = False

    def send(self, cmd) -> None:
        if self.broken:
            raise RuntimeError("Connection closed by peer")
        self.sent.append(cmd)

    def receive(self):
        return self.commands.pop(0)

    def close(self) -> None:
        self.closed = True


def _runner(ranks):
    from rollart.trainer.distributed import RankRunner
    from rollart.trainer.step import TrainStepConfig

    model = torch.nn.Linear(2, 2)
    return RankRunner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      TrainStepConfig(max_tokens_per_microbatch=8), ranks)


def test_a_failed_command_on_rank_0_is_fatal_and_refuses_later_ones() -> None:
    from rollart.transport.errors import RemoteError

    ranks = FakeRanks(broken=True)
    runner = _runner(ranks)
    fatal: list[BaseException] = []
    runner.on_fatal = fatal.append
    # A bad batch is refused before any rank sees it, and is not fatal.
    with pytest.raises(ValueError, match="sample 's0' has 9 tokens > max_tokens_per_microbatch"):
        runner.train([_sample(0, 9)])
    assert fatal == [] and runner.failure is None
    with pytest.raises(RemoteError, match=r"fatal: SnapshotCommand failed across the trainer "
                       r"ranks \(RuntimeError\('Connection closed by peer'\)\)") as info:
        runner.snapshot()
    assert info.value.code == "internal" and len(fatal) == 1
    with pytest.raises(RemoteError, match="fatal: the trainer ranks failed earlier"):
        runner.train([_sample(0, 4)])
    assert len(fatal) == 1
    runner.stop()  # never raises; sends nothing after a failure
    assert ranks.sent == [] and not ranks.closed


def test_a_follower_runs_commands_until_stop() -> None:
    import signal

    ranks = FakeRanks(rank=1, commands=[SnapshotCommand(), StopCommand()])
    runner = _runner(ranks)
    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        assert runner.follow() == 0
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])
    assert ranks.commands == [] and ranks.closed


def test_a_cpu_trainer_takes_the_cores_the_local_cpu_engines_leave(tmp_path: Path) -> None:
    from rollart.launcher.services import cpu_trainer_threads

    one_engine = _scenario("")  # one local CPU worker (the pool's default)
    assert cpu_trainer_threads(one_engine, cores=2) == 1
    assert cpu_trainer_threads(one_engine, cores=16) == 15
    two = _scenario("", pools="\nnum_workers = 2")
    assert cpu_trainer_threads(two, cores=2) == 1  # never 0 threads
    assert cpu_trainer_threads(two, cores=1) == 1
    # torchrun ranks and a GPU trainer keep torch's default
    assert cpu_trainer_threads(_scenario("num_processes = 2"), cores=8) == 0
    # the trainer process is told (TrainerOptions.num_threads, 0 = torch's default)
    argv = trainer_argv(one_engine, tmp_path, None)
    options = json.loads(argv[argv.index("--options") + 1])
    assert options["num_threads"] == cpu_trainer_threads(one_engine)
