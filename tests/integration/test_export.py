"""``rollart export``: a run's DCP checkpoint, trained by the real trainer process, written as a
Hugging Face folder that transformers and vLLM load, scoring tokens as the trainer does.

Tolerances: transformers loads the exported weights bit for bit (checked), and runs the same
kernels as the trainer's ``token_logprobs`` in this process, so its logprobs equal the
trainer's (1e-6 nats allowed for thread-count-dependent reduction order). vLLM's prompt
logprobs differ from transformers' by its own attention / matmul kernels: 1e-4 nats per token,
as in ``test_tiny_model_vllm`` (the measured gap on the dev machine was ~5e-7).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from rollart.cli import main as cli
from rollart.launcher import rundir
from rollart.models.tokenizer import IM_END_TOKEN, VOCAB, char_id
from rollart.trainer.checkpoint import load_trainer, mark_complete
from rollart.trainer.client import TrainerClient
from rollart.trainer.step import token_logprobs
from rollart.transport import messages as m
from rollart.transport.security import env_credentials

TORCH_TOL = 1e-6
VLLM_TOL = 1e-4

PROMPTS = ["user\n12 + 30 = 42", "say b", "Guess a number between 1 and 10."]


def _ids(text: str) -> list[int]:
    return [VOCAB["<|im_start|>"], *[char_id(c) for c in text], VOCAB[IM_END_TOKEN]]


def _logprobs(model, prompts: list[str]) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for text in prompts:
            x = torch.tensor([_ids(text)])
            out.append(token_logprobs(model.eval(), x, torch.ones_like(x))[0, 1:].tolist())
    return out


def _trainer_logprobs(base: Path, ckpt: Path) -> list[list[float]]:
    """The checkpoint's weights as the trainer loads them (``load_trainer`` on resume)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    load_trainer(ckpt, model, torch.optim.AdamW(model.parameters()))
    return _logprobs(model, PROMPTS)


def _samples(base: Path) -> list[m.TrainSample]:
    """Four samples whose behaviour logprobs are the base model's own (on-policy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    samples = []
    for i, text in enumerate(["1 + 2 = 3", "say a", "7 * 6 = 42", "say c"]):
        prompt, answer = _ids("user\n")[:-1], [char_id(c) for c in text]
        ids = prompt + answer
        with torch.no_grad():
            x = torch.tensor([ids])
            lp = [0.0, *token_logprobs(model, x, torch.ones_like(x))[0, 1:].tolist()]
        samples.append(m.TrainSample.from_lists(
            token_ids=ids, loss_mask=[0] * len(prompt) + [1] * len(answer),
            behaviour_logprobs=[0.0] * len(prompt) + lp[len(prompt):],
            advantage=1.0 if i % 2 == 0 else -1.0, sample_id=f"s{i}"))
    return samples


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, service_starter, tmp_path_factory) -> Path:
    """A run folder as ``rollart run`` leaves it, of two real trainer steps: base model
    recorded, complete checkpoints of steps 1 and 2."""
    from rollart.config import parse_scenario

    run = tmp_path_factory.mktemp("export") / "run"
    (run / "checkpoints").mkdir(parents=True)
    scenario = parse_scenario((Path(__file__).parents[1] / "minimal_scenario.toml").read_text(),
                              "minimal_scenario.toml")
    rundir.record_base_model(run, tiny_model_dir, scenario)
    trainer_proc = service_starter(
        "rollart.trainer.service",
        ["--model", str(tiny_model_dir), "--options", '{"lr": 0.01, "dtype": "float32"}',
         "--checkpoint-dir", str(run / "checkpoints")],
        log_dir=run.parent, ready_timeout_s=300)

    async def train() -> None:
        trainer = TrainerClient(trainer_proc.address, auth=env_credentials())
        try:
            samples = _samples(tiny_model_dir)
            for step in (1, 2):
                version = (await trainer.status()).version
                assert (await trainer.train(version, samples)).version == version + 1
                await trainer.save_checkpoint(f"step_{step:06d}")
                mark_complete(run / "checkpoints", step)
        finally:
            await trainer.close()

    try:
        asyncio.run(train())
    finally:
        trainer_proc.stop()
    return run


def test_export_loads_in_transformers_and_scores_as_the_trainer(trained_run, tiny_model_dir,
                                                               tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert json.loads((trained_run / "base_model.json").read_text()) == {
        "path": str(tiny_model_dir.resolve()), "model_path": "tiny"}
    out = tmp_path / "export"
    assert cli(["export", str(trained_run), "--step", "1", str(out)]) == 0
    assert f"-> {out}" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "rollart_export.json"} <= names
    record = json.loads((out / "rollart_export.json").read_text())
    assert (record["step"], record["policy_version"], record["dtype"]) == (1, 1, "float32")
    assert record["base_model"] == str(tiny_model_dir.resolve())

    ckpt = trained_run / "checkpoints" / "step_000001"
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trainer_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    load_trainer(ckpt, trainer_model, torch.optim.AdamW(trainer_model.parameters()))
    want = trainer_model.state_dict()
    got = exported.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert any(not torch.equal(base.state_dict()[k], want[k]) for k in want)  # it trained

    trainer_lp = _trainer_logprobs(tiny_model_dir, ckpt)
    for a, b in zip(_logprobs(exported, PROMPTS), trainer_lp, strict=True):
        assert a == pytest.approx(b, abs=TORCH_TOL)
    # the tokenizer is the base model's
    tok, base_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(
        tiny_model_dir)
    assert tok("say b 42")["input_ids"] == base_tok("say b 42")["input_ids"]
    assert tok.chat_template == base_tok.chat_template

    # Default: the newest checkpoint (step 2), which differs from step 1.
    newest = tmp_path / "newest"
    assert cli(["export", str(trained_run), str(newest)]) == 0
    assert json.loads((newest / "rollart_export.json").read_text())["step"] == 2
    step2 = AutoModelForCausalLM.from_pretrained(newest, dtype=torch.float32)
    assert any(not torch.equal(step2.state_dict()[k], got[k]) for k in got)


def test_export_refuses_bad_arguments_naming_what_is_wrong(trained_run, tmp_path,
                                                           capsys) -> None:
    def refused(*argv: str) -> str:
        assert cli(["export", *argv]) == 2
        return capsys.readouterr().err

    missing = tmp_path / "no-such-run"
    assert f"{missing}: no such run folder" in refused(str(missing), str(tmp_path / "o1"))
    err = refused(str(trained_run), "--step", "7", str(tmp_path / "o2"))
    assert "checkpoint of step 7" in err and "does not exist" in err and "steps [1, 2]" in err
    assert not (tmp_path / "o2").exists()
    # OUT holding the run folder is refused even with --force (it would delete the run).
    err = refused(str(trained_run), "--force", str(trained_run.parent))
    assert "holds the run folder" in err
    # A non-empty OUT: refused, untouched; --force replaces it as a whole.
    out = tmp_path / "busy"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    err = refused(str(trained_run), str(out))
    assert f"OUT {out}: not empty" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert cli(["export", str(trained_run), "--force", str(out)]) == 0
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".busy.*"))  # no partial or old folder left behind
    # A run folder without its base model record names the file and the way out.
    (trained_run / "base_model.json").rename(trained_run / "base_model.json.bak")
    try:
        err = refused(str(trained_run), str(tmp_path / "o3"))
        assert "base_model.json: missing" in err and "--base" in err
    finally:
        (trained_run / "base_model.json.bak").rename(trained_run / "base_model.json")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_loads_the_export_and_scores_as_the_trainer(trained_run, tiny_model_dir,
                                                        tmp_path) -> None:
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = tmp_path / "export"
    assert cli(["export", str(trained_run), str(out)]) == 0
    ckpt = trained_run / "checkpoints" / "step_000002"
    llm = LLM(model=str(out), dtype="float32", kv_cache_memory_bytes=256 * 2**20,
              max_model_len=512, seed=0, enforce_eager=True)
    try:
        results = llm.generate([TokensPrompt(prompt_token_ids=_ids(t)) for t in PROMPTS],
                               SamplingParams(max_tokens=1, prompt_logprobs=0))
    finally:
        llm.llm_engine.engine_core.shutdown()
    trainer_lp = _trainer_logprobs(tiny_model_dir, ckpt)
    for text, r, want in zip(PROMPTS, results, trainer_lp, strict=True):
        ids, plp = _ids(text), r.prompt_logprobs
        assert plp is not None and plp[0] is None  # nothing scores the first token
        rows = plp[1:]
        assert all(row is not None for row in rows)
        got = [row[t].logprob for row, t in zip(rows, ids[1:], strict=True)
               if row is not None]
        assert got == pytest.approx(want, abs=VLLM_TOL)
