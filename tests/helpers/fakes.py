"""Fake backends for the controller's unit tests (no processes, no model), plus a smoke test.

- ``FakeTokenizer``: ChatML over characters (id = 16 + code point; specials below 16).
- ``FakeWorker``: answers with a scripted text per request (a ``respond`` function), its own
  version on every token, logprob -0.5 per token; optional latency; honours pause / abort / dead;
  resolves delta prompts with the real ``PrefixStore`` (``prompts``: each request's whole prompt).
- ``FakeEnvHost``: env ``"count"`` terminates after ``turns`` steps (reward 1 if the action is
  ``"ok"``); per-seed latency and failures.
- ``FakeReward`` / ``FakeTrainer``: scripted reward service and trainer.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import msgspec

from rollart.config import Scenario, parse_scenario
from rollart.controller.ports import TrainResult
from rollart.inference.prefixes import DEFAULT_MAX_PREFIX_TOKENS, PrefixStore
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import EnvError, PeerDeadError, RemoteError, RewardError

SPECIALS = {"<|pad|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
INV_SPECIALS = {v: k for k, v in SPECIALS.items()}


class FakeTokenizer:
    """Character-level ChatML tokenizer: exact encode/decode, specials recognised in text."""

    eos_token = "<|im_end|>"
    eos_token_id = 2

    def apply_chat_template(self, conversation, *, tokenize=True, add_generation_prompt=False,
                            **kwargs):
        text = "".join(
            f"<|im_start|>{msg['role']}\n{msg['content']}<|im_end|>\n" for msg in conversation
        )
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            for tok, tid in SPECIALS.items():
                if text.startswith(tok, i):
                    out.append(tid)
                    i += len(tok)
                    break
            else:
                out.append(16 + ord(text[i]))
                i += 1
        return out

    def decode(self, token_ids, *, skip_special_tokens: bool = False) -> str:
        return "".join(
            ("" if skip_special_tokens else INV_SPECIALS[t]) if t < 16 else chr(t - 16)
            for t in token_ids
        )


TOK = FakeTokenizer()


class FakeWorker:
    """An inference worker double. ``respond(request) -> (text, finish)`` scripts the answer:
    the tokens are ``encode(text)`` (+ eos when finish is "stop" and ``add_eos``), cut at
    ``max_tokens`` with finish "length"."""

    def __init__(self, name: str, respond: Callable[[m.Generate], str] | None = None, *,
                 latency_s: float = 0.0, add_eos: bool = True,
                 max_prefix_tokens: int = DEFAULT_MAX_PREFIX_TOKENS) -> None:
        self.name = name
        self.address = f"fake://{name}"
        self.prefixes = PrefixStore(max_prefix_tokens)
        #: the whole prompt (token ids) of each request, resolved from its delta
        self.prompts: list[list[int]] = []
        #: requests failed with ``prefix_unknown``
        self.prefix_misses: list[m.Generate] = []
        self.respond = respond or (lambda req: "ok")
        self.latency_s = latency_s
        self.add_eos = add_eos
        self.version = 0
        self.last_stats: m.WorkerStats | None = None
        self._dead = False
        self._running = asyncio.Event()
        self._running.set()
        self.requests: list[m.Generate] = []
        self.aborted: list[str] = []
        self.applied: list[tuple[int, bool]] = []
        self.pauses = 0
        self.in_flight = 0

    @property
    def dead(self) -> bool:
        return self._dead

    def kill(self) -> None:
        self._dead = True

    def _stats(self) -> m.WorkerStats:
        return m.WorkerStats(worker=self.name, num_running=self.in_flight, num_waiting=0,
                             version=self.version, paused=not self._running.is_set())

    async def generate(self, request: m.Generate, *, timeout_s=None) -> m.GenerateResult:
        if self._dead:
            raise PeerDeadError(f"{self.name} is dead")
        try:
            prompt = self.prefixes.take_prompt(request)
        except RemoteError as exc:
            if exc.code == "prefix_unknown":
                self.prefix_misses.append(request)
            raise
        self.requests.append(request)
        self.prompts.append(tb.view_i32(prompt).tolist())
        self.in_flight += 1
        try:
            await self._running.wait()
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            if self._dead:
                raise PeerDeadError(f"{self.name} died during {request.request_id}")
            text = self.respond(request)
            if isinstance(text, BaseException):
                raise text
            ids = TOK.encode(text)
            finish = "stop"
            if self.add_eos:
                ids.append(TOK.eos_token_id)
            if len(ids) > request.sampling.max_tokens:
                ids, finish = ids[: request.sampling.max_tokens], "length"
        except asyncio.CancelledError:
            self.aborted.append(request.request_id)
            raise
        finally:
            self.in_flight -= 1
        self.last_stats = self._stats()
        token_bytes = tb.pack_i32(ids)
        self.prefixes.keep(request.trajectory_id, prompt, token_bytes)
        return m.GenerateResult(request_id=request.request_id, token_ids=token_bytes,
                                logprobs=tb.pack_f32([-0.5] * len(ids)),
                                versions=tb.pack_i32([self.version] * len(ids)),
                                finish_reason=finish, num_prompt_tokens=len(prompt) // 4,
                                stats=self.last_stats)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def pause(self, mode="keep") -> None:
        if self._dead:
            raise PeerDeadError(self.name)
        self.pauses += 1
        self._running.clear()

    async def resume(self) -> None:
        if self._dead:
            raise PeerDeadError(self.name)
        self._running.set()

    async def apply_weights(self, version: int, *, reprefill: bool = False) -> m.WeightsApplied:
        if self._dead:
            raise PeerDeadError(self.name)
        self.version = version
        self.applied.append((version, reprefill))
        return m.WeightsApplied(version=version, apply_time_s=0.0, stats=self._stats())

    async def stats(self) -> m.WorkerStats:
        return self._stats()


class _Session(msgspec.Struct):
    env: str
    seed: int
    index: int
    steps: int = 0


class FakeEnvHost:
    """Env ``count``: ``turns`` steps then terminated; reward 1.0 per ``"ok"`` action.

    Sessions are numbered in open order (``index``). ``latency(index, step) -> seconds`` delays
    steps; ``fail(index, step) -> bool`` makes a step raise EnvError("env_error")."""

    def __init__(self, name: str = "envhost", *, turns: int = 2,
                 latency: Callable[[int, int], float] | None = None,
                 fail: Callable[[int, int], bool] | None = None) -> None:
        self.name = name
        self.turns = turns
        self.latency = latency or (lambda index, step: 0.0)
        self.fail = fail or (lambda index, step: False)
        self._dead = False
        self.sessions: dict[str, _Session] = {}
        self.closed: list[str] = []
        self.opened: list[str] = []
        self.steps_started = 0
        self.steps_done = 0
        self._ids = itertools.count()

    @property
    def dead(self) -> bool:
        return self._dead

    async def open(self, env_name, seed, options=None, *, timeout_s=None) -> m.EnvOpened:
        if self._dead:
            raise PeerDeadError(self.name)
        index = next(self._ids)
        sid = f"s{index}"
        self.sessions[sid] = _Session(env_name, seed, index)
        self.opened.append(sid)
        return m.EnvOpened(session_id=sid, observation=f"start {seed}",
                           info={"reference": "ok", "session": sid})

    async def step(self, session_id, action, *, timeout_s=None) -> m.EnvStepResult:
        s = self.sessions[session_id]
        self.steps_started += 1
        delay = self.latency(s.index, s.steps)
        if delay:
            await asyncio.sleep(delay)
        if self.fail(s.index, s.steps):
            raise EnvError("env_error", f"env raised in session {s.index} step {s.steps}")
        s.steps += 1
        self.steps_done += 1
        return m.EnvStepResult(session_id=session_id, observation=f"obs {s.steps}",
                               reward=1.0 if action == "ok" else 0.0,
                               terminated=s.steps >= self.turns, truncated=False)

    async def close_session(self, session_id) -> None:
        self.sessions.pop(session_id, None)
        self.closed.append(session_id)


class _Scored(msgspec.Struct):
    reward: float
    details: dict = {}


class FakeReward:
    """Reward service double: reward = metadata["env_return"] (or ``fn``); raises RewardError
    when ``fail`` says so."""

    def __init__(self, fn: Callable[[str, dict], float] | None = None,
                 fail: Callable[[dict], bool] | None = None) -> None:
        self.fn = fn or (lambda response, md: float(md["env_return"]))
        self.fail = fail or (lambda md: False)
        self.calls: list[dict[str, Any]] = []

    async def score(self, name, prompt, response, reference=None, metadata=None):
        md = metadata or {}
        self.calls.append({"name": name, "prompt": prompt, "response": response,
                           "reference": reference, "metadata": md})
        if self.fail(md):
            raise RewardError(f"reward {name!r} failed", 500)
        return _Scored(self.fn(response, md))


class FakeTrainer:
    """Trainer double: ``train`` takes ``train_s`` seconds; records batches and the loop time
    at which each train started/ended; ``push_weights`` takes ``push_s`` seconds."""

    push_needs_pause = False

    def __init__(self, *, train_s: float = 0.0, push_s: float = 0.0) -> None:
        self._version = 0
        self.train_s = train_s
        self.push_s = push_s
        self.batches: list[list] = []
        self.train_spans: list[tuple[float, float]] = []
        self.pushed: list[int] = []

    @property
    def version(self) -> int:
        return self._version

    async def train(self, samples) -> TrainResult:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if self.train_s:
            await asyncio.sleep(self.train_s)
        self.batches.append(list(samples))
        self._version += 1
        self.train_spans.append((t0, loop.time()))
        return TrainResult(version=self._version, metrics={"loss": 0.0})

    async def set_workers(self, workers) -> None:
        self.workers = list(workers)

    async def push_weights(self, version, workers) -> None:
        if self.push_s:
            await asyncio.sleep(self.push_s)
        self.pushed.append(version)


#: the previous default staleness policy, spelled out ([run] fields): weights applied at the
#: next step's pause, greedy admission, domains by weight, no fresh start, no hold. Tests of
#: what goes stale (restarts, AReaL's stale samples, held samples) ask for it explicitly, as
#: the default policy leaves little to go stale.
LAZY_POLICY: dict[str, Any] = {
    "weight_apply": "at_batch", "fresh_start": False, "admission": "greedy",
    "domain_mix": "weight", "hold_batch_for_groups": False}


def make_scenario(**run: Any) -> Scenario:
    """A two-pool, two-domain scenario over the fakes; ``run`` overrides [run] fields."""
    base = {"mode": "rollart", "alpha": 1, "batch_size": 4, "group_size": 2, "max_turns": 4,
            "max_tokens_per_turn": 16, "max_tokens_per_trajectory": 256, "seed": 1}
    base.update(run)
    lines = ["[run]"] + [f"{k} = {_toml(v)}" for k, v in base.items()]
    lines += [
        '[[pools]]\nname = "p1"\nhardware = "cpu"',
        '[[pools]]\nname = "p2"\nhardware = "cpu"',
        '[[domains]]\nname = "game"\nenv = "count"\npool = "p1"\nreward = "env_return"\n'
        'reward_url = "local"',
        '[[domains]]\nname = "math"\nenv = "count"\npool = "p2"\nreward = "fake"',
    ]
    return parse_scenario("\n".join(lines), "fake.toml")


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, dict):  # an inline table, e.g. worker_checks = {agreement_policy = "stop"}
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    return str(v)


async def test_fakes_smoke() -> None:
    w = FakeWorker("w")
    req = m.Generate(request_id="r", new_token_ids=tb.pack_i32([1, 2]),
                     sampling=m.SamplingParams(max_tokens=2))
    res = await w.generate(req)
    assert res.finish_reason == "length" and res.num_tokens == 2
    with_eos = await w.generate(m.Generate(request_id="r2", new_token_ids=tb.pack_i32([1]),
                                           sampling=m.SamplingParams(max_tokens=8)))
    assert tb.view_i32(with_eos.token_ids).tolist() == [*TOK.encode("ok"), 2]
    assert with_eos.finish_reason == "stop"
    assert isinstance(RemoteError("x", "y"), Exception)
