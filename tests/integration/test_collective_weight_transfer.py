"""Collective weight transfer (``weight_transfer = "gloo"``): trainer -> two vLLM workers.

The same protocol as the GPU path (vLLM's weight-transfer engine: init handshake, start,
update concurrent with the trainer's broadcast, finish, layerwise reload), with a gloo
communicator so it runs on CPU. The NCCL variant at the end runs only where CUDA exists.
That a ``zmq`` worker refuses the collective messages is checked on the shared worker of
``test_inference_worker``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from weight_checks import FIXED, TWO_RANK_SCENARIO, prompt_logprobs, trainer_logprobs

from rollart.inference.client import InferenceClient
from rollart.trainer.client import TrainerClient
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError
from rollart.transport.security import env_credentials

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOL = 1e-4  # float32 on both sides


def _worker_args(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--enforce-eager",
            "--weight-transfer", "gloo", "--kv-cache-bytes", str(64 << 20)]


@pytest.fixture(scope="module")
def services(tiny_model_dir, service_starter, services_starter, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gloo-transfer-logs")
    workers = services_starter(  # started together: their start-ups overlap
        [("rollart.inference.worker", [*_worker_args(tiny_model_dir), "--name", f"w{i}"])
         for i in range(2)],
        # one deadline for both (they share the cores): the two 300 s deadlines they had apart
        log_dir=log_dir, ready_timeout_s=540, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    trainer = service_starter(
        "rollart.trainer.service",
        ["--model", str(tiny_model_dir), "--options",
         '{"lr": 0.01, "weight_transfer": "gloo", "weight_transfer_timeout_s": 120}',
         *(a for w in workers for a in ("--worker", w.address)),
         "--checkpoint-dir", str(tmp_path_factory.mktemp("ckpts"))],
        log_dir=log_dir, ready_timeout_s=300)
    yield [w.address for w in workers], trainer.address
    for w in workers:
        w.stop()
    trainer.stop()


def _samples(n: int) -> list[m.TrainSample]:
    out = []
    for i in range(n):
        ids = FIXED[: 6 + i]
        out.append(m.TrainSample.from_lists(token_ids=ids, loss_mask=[0] * 3 + [1] * (len(ids) - 3),
                                 behaviour_logprobs=[0.0] * 3 + [-4.0] * (len(ids) - 3),
                                 advantage=1.0 if i % 2 == 0 else -1.0, sample_id=f"s{i}"))
    return out


async def _train(trainer: TrainerClient) -> int:
    status = await trainer.status()
    return (await trainer.train(status.version, _samples(4))).version


async def _broadcast_rounds_match_the_trainer(worker_addr: str, trainer_addr: str, model_dir,
                                              tmp_path, *, rounds: int, tol: float) -> None:
    """``rounds`` x (train, pause, broadcast, apply, resume) on one worker; then its prompt
    logprobs changed and equal the trainer's under the last version within ``tol``."""
    client = InferenceClient(worker_addr, name="w", liveness_timeout_s=60, auth=env_credentials())
    trainer = TrainerClient(trainer_addr, auth=env_credentials())
    try:
        before = await prompt_logprobs(client)
        await trainer.register_workers([worker_addr])
        for _ in range(rounds):
            version = await _train(trainer)
            await client.pause("keep")
            published = await trainer.broadcast_version(version)
            assert published.version == version
            assert (await client.apply_weights(version)).version == version
            await client.resume()
        saved = await trainer.save_checkpoint("ckpt")
        expected = trainer_logprobs(model_dir, Path(saved.path))
        after = await prompt_logprobs(client)
        assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3
        assert after == pytest.approx(expected, abs=tol)
    finally:
        await client.close()
        await trainer.close()


async def test_broadcast_loads_the_trainers_version_into_every_paused_worker(
        services, tiny_model_dir, tmp_path):
    addrs, trainer_addr = services
    workers = [InferenceClient(a, name=f"w{i}", liveness_timeout_s=60, auth=env_credentials())
               for i, a in enumerate(addrs)]
    trainer = TrainerClient(trainer_addr, auth=env_credentials())
    try:
        assert (await trainer.status()).weight_transfer == "gloo"
        assert {(await w.stats()).weight_transfer for w in workers} == {"gloo"}
        before = await prompt_logprobs(workers[0])
        await trainer.set_workers(addrs)
        version = await _train(trainer)

        # Broadcasting into a worker that is generating is refused, and nothing is loaded.
        with pytest.raises(RemoteError, match="are not paused"):
            await trainer.broadcast_version(version)
        assert await prompt_logprobs(workers[0]) == pytest.approx(before, abs=1e-6)

        for step in range(2):  # the second broadcast reuses the group formed by the first
            if step:
                version = await _train(trainer)
            await asyncio.gather(*(w.pause("keep") for w in workers))
            published = await trainer.broadcast_version(version)
            assert published.version == version and published.failed == {}
            assert published.num_bytes > 0
            for w in workers:
                applied = await w.apply_weights(version)
                assert applied.version == version == applied.stats.version
            await asyncio.gather(*(w.resume() for w in workers))

        saved = await trainer.save_checkpoint("broadcast")
        expected = trainer_logprobs(tiny_model_dir, Path(saved.path))
        after = [await prompt_logprobs(w) for w in workers]
        assert max(abs(a - b) for a, b in zip(before, after[0], strict=True)) > 1e-3
        for lps in after:
            assert lps == pytest.approx(expected, abs=TOL)
        r = await workers[1].generate(m.Generate(
            request_id="after-update", new_token_ids=tb.pack_i32(FIXED[:5]),
            sampling=m.SamplingParams(max_tokens=4, ignore_eos=True)))
        assert set(tb.view_i32(r.versions).tolist()) == {version}
    finally:
        for w in workers:
            await w.close()
        await trainer.close()


async def test_a_changed_worker_set_re_forms_the_group(services):
    addrs, trainer_addr = services
    workers = [InferenceClient(a, name=f"w{i}", liveness_timeout_s=60, auth=env_credentials())
               for i, a in enumerate(addrs)]
    trainer = TrainerClient(trainer_addr, auth=env_credentials())
    try:
        await trainer.set_workers(addrs[1:])  # w0 left the run
        version = await _train(trainer)
        await workers[1].pause("keep")
        published = await trainer.broadcast_version(version)
        assert published.version == version
        assert (await workers[1].apply_weights(version)).version == version
        await workers[1].resume()
        assert (await workers[0].stats()).version < version  # not part of the new group
        # A broadcast sends only the current version.
        with pytest.raises(RemoteError, match="not the trainer's current version"):
            await trainer.broadcast_version(version - 1)
    finally:
        for w in workers:
            await w.close()
        await trainer.close()


# An intruder on the rendezvous: it took a rank of the group (the port is reachable, the
# nonce went to the workers over CURVE), contributes a proof under its own key, then waits for
# the trainer's first tensor. Prints GOT_WEIGHTS or NO_WEIGHTS.
INTRUDER = """
import sys, tempfile
import torch
from rollart.transport.security import create_key_file, load_key_file
from rollart.weights.membership import membership_key, new_nonce, proof
from rollart.weights.vllm_engines import open_gloo_group

addr, port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
group = open_gloo_group(addr, port, rank, world, 30.0)
key = membership_key(load_key_file(create_key_file(tempfile.mkdtemp())))
mine = torch.frombuffer(bytearray(proof(key, new_nonce(), rank, world)), dtype=torch.uint8)
group.allgather([[torch.zeros(32, dtype=torch.uint8) for _ in range(world)]], [mine]).wait()
buf = torch.empty(4, 4)
try:
    group.broadcast(buf, 0).wait()
except Exception as exc:
    print("NO_WEIGHTS", type(exc).__name__, flush=True)
else:
    print("GOT_WEIGHTS", buf.sum().item(), flush=True)
"""


async def test_an_intruder_in_the_rendezvous_is_refused_and_gets_no_weights(services):
    """A group of 3 ranks: the trainer (0), worker w0 (1) and a rank the intruder takes (2).
    The trainer refuses to broadcast naming rank 2, w0 refuses the group too, and the intruder
    receives nothing. (w0 is out of the trainer service's group after the test above.)"""
    import subprocess
    import sys

    from vllm.distributed.weight_transfer.base import ModuleSource

    from rollart.weights.collective import (
        GlooTrainerInitInfo,
        GlooTrainerWeightTransferEngine,
        WorkerGroupClient,
        _listen_socket,
    )
    from rollart.weights.membership import (
        MembershipError,
        expected_proofs,
        membership_key,
        new_nonce,
    )

    class RecordingGroupClient(WorkerGroupClient):
        """The real client; keeps what the workers' init answered (the trainer's own error
        is what trainer_init raises)."""

        worker_error: BaseException | None = None

        def init_weight_transfer_engine(self, init_info):
            try:
                super().init_weight_transfer_engine(init_info)
            except BaseException as exc:
                self.worker_error = exc
                raise

    addrs, _trainer = services
    w0 = InferenceClient(addrs[0], name="w0", liveness_timeout_s=60, auth=env_credentials())
    sock = _listen_socket("127.0.0.1")
    port = sock.getsockname()[1]
    intruder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", INTRUDER, "127.0.0.1", str(port), "2", "3",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        nonce = new_nonce()
        client = RecordingGroupClient(asyncio.get_running_loop(), [w0], [1], timeout_s=120,
                                      nonce=nonce)
        info = GlooTrainerInitInfo(
            master_address="127.0.0.1", master_port=port, world_size=3, timeout_s=120, rank=0,
            membership_proofs=expected_proofs(membership_key(env_credentials()), nonce, 3))
        with pytest.raises(MembershipError, match=r"^rank 2 of the weight-transfer group did "
                                                  r"not prove the run key: refusing to "
                                                  r"broadcast$"):
            await asyncio.to_thread(GlooTrainerWeightTransferEngine.trainer_init, info,
                                    client=client, source=ModuleSource(torch.nn.Linear(4, 4)),
                                    listen_socket=sock)
        assert isinstance(client.worker_error, RemoteError)
        assert ("rank 2 of the weight-transfer group did not prove the run key: refusing to "
                "load weights from this group") in str(client.worker_error)
        out, err = await asyncio.wait_for(intruder.communicate(), 120)
        assert out.decode().startswith("NO_WEIGHTS"), (out, err[-2000:])
        assert not (await w0.stats()).paused  # the worker serves on
    finally:
        if intruder.returncode is None:
            intruder.kill()
            await intruder.wait()
        await w0.close()


async def test_a_worker_refuses_to_generate_from_a_half_loaded_model(services):
    """On the module's worker w0, which the test above took out of the group (an engine start
    saved); it leaves w0 half loaded, so it comes after every test that broadcasts into w0."""
    addrs, _trainer_addr = services
    client = InferenceClient(addrs[0], name="w0", liveness_timeout_s=60, auth=env_credentials())
    try:
        with pytest.raises(RemoteError, match="pause the worker first"):
            await client.weight_transfer(m.WeightTransferStart(), timeout_s=30)
        await client.pause("keep")
        await client.weight_transfer(m.WeightTransferStart(), timeout_s=30)
        with pytest.raises(RemoteError, match="Resume refused: a collective weight update"):
            await client.resume()
        assert (await client.stats()).paused  # still paused, still serving RPCs
    finally:
        await client.close()


async def test_two_fsdp_ranks_broadcast_through_rank_0(tiny_model_dir, service_launcher,
                                                       tmp_path):
    """FSDP2-sharded trainer (torchrun, 2 ranks): rank 1 joins the parameter gathers of
    rank 0's broadcast; the worker ends up with exactly the trainer's weights."""
    from rollart.config import parse_scenario
    from rollart.launcher.services import trainer_argv

    worker = service_launcher("rollart.inference.worker",
                              [*_worker_args(tiny_model_dir), "--name", "w"],
                              ready_timeout_s=300)
    scenario = TWO_RANK_SCENARIO + 'weight_transfer = "gloo"\nweight_transfer_timeout_s = 120\n'
    argv = trainer_argv(parse_scenario(scenario), tiny_model_dir, None,
                        checkpoint_dir=tmp_path / "ckpts")
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    trainer_proc = service_launcher(argv[2], argv[3:], ready_timeout_s=300)
    await _broadcast_rounds_match_the_trainer(worker.address, trainer_proc.address,
                                              tiny_model_dir, tmp_path, rounds=2, tol=TOL)


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() < 2, reason="NCCL needs one GPU for the trainer and one "
                    "for the worker (two ranks of a communicator cannot share a device)")
async def test_nccl_broadcast_on_gpus(tiny_model_dir, service_launcher, tmp_path):
    worker = service_launcher(
        "rollart.inference.worker",
        ["--model", str(tiny_model_dir), "--dtype", "float32", "--enforce-eager",
         "--weight-transfer", "nccl", "--gpu-memory-utilization", "0.2"],
        env={"CUDA_VISIBLE_DEVICES": "0"}, ready_timeout_s=600)
    trainer_proc = service_launcher(
        "rollart.trainer.service",
        ["--model", str(tiny_model_dir), "--options",
         '{"lr": 0.01, "device": "cuda", "weight_transfer": "nccl", "bucket_bytes": 65536}',
         "--checkpoint-dir", str(tmp_path / "ckpts")],
        env={"CUDA_VISIBLE_DEVICES": "1"}, ready_timeout_s=600)
    await _broadcast_rounds_match_the_trainer(  # tolerance: TF32 matmuls on the GPU
        worker.address, trainer_proc.address, tiny_model_dir, tmp_path, rounds=1, tol=2e-3)
