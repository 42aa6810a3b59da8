"""SIMULATED workloads: seeded distributions, task domains and a token-count tokenizer.

A simulated observation is the text ``<sim:DOMAIN:N>``, which ``SimTokenizer`` encodes as ``N``
tokens whose ids name the domain. That is how a simulated inference worker, which only sees
token ids (like a real engine), knows which domain's response-length distribution to draw from,
without any side channel through the controller.

Randomness: every draw comes from ``random.Random`` seeded with a string (``seeded_rng``), which
Python hashes with SHA-512, so runs are reproducible across processes regardless of
``PYTHONHASHSEED`` and independent of the order in which requests arrive. Draws made once per
call on a hot path (the simulated reward) use ``counter_rng`` instead: the same string seeding
through BLAKE2b, SplitMix64 draws, no Mersenne Twister state to initialise.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: ids below this are plain words / special tokens; domain ``i`` uses id ``DOMAIN_TOKEN_BASE+i``.
DOMAIN_TOKEN_BASE = 1000
EOS_TOKEN_ID = 2
GEN_TOKEN_ID = 3
#: plain words map to ids in [WORD_TOKEN_BASE, WORD_TOKEN_BASE + 2**20) by CRC32 of the word
WORD_TOKEN_BASE = 100_000
_MARKER = re.compile(r"<sim:([A-Za-z0-9_.\-]+):(\d+)>")


def seeded_rng(*parts: object) -> random.Random:
    """A ``random.Random`` seeded from ``parts`` joined as a string (SHA-512 seeding)."""
    return random.Random(":".join(str(p) for p in parts))


_MASK64 = (1 << 64) - 1
_TWO_M53 = 2.0 ** -53


class CounterRng(random.Random):
    """A counter-based ``random.Random``: draw ``i`` is SplitMix64 (Steele, Lea & Flood,
    OOPSLA 2014; the seeding generator of Java's ``SplittableRandom``) of ``key + i``, where
    ``key`` is a 64-bit BLAKE2b digest of the seed's string. Uniform on [0, 1) with 53 bits
    like ``random.Random.random``, and every derived draw (``gauss``, ``lognormvariate``,
    ``uniform``) is ``random.Random``'s own code on top of it; it skips the Mersenne Twister's
    2.5 KB state initialisation, which costs ~10 us per construction (the simulated reward
    builds one per call). Not for ``getrandbits``-based draws (``randrange``, ``choice``),
    which raise NotImplementedError.
    """

    _ctr: int  # the SplitMix64 counter

    def seed(self, a: object = None, version: int = 2) -> None:  # called by __init__
        digest = hashlib.blake2b(str(a).encode(), digest_size=8).digest()
        self._ctr = int.from_bytes(digest, "little")

    def random(self) -> float:
        self._ctr = (self._ctr + 0x9E3779B97F4A7C15) & _MASK64
        z = self._ctr
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return ((z ^ (z >> 31)) >> 11) * _TWO_M53

    def getrandbits(self, k: int) -> int:
        raise NotImplementedError("CounterRng draws floats only (random, gauss, ...)")

    def getstate(self) -> object:
        return self._ctr

    def setstate(self, state: object) -> None:
        if not isinstance(state, int):
            raise TypeError(f"CounterRng state must be the int getstate returned, got {state!r}")
        self._ctr = state


def counter_rng(*parts: object) -> random.Random:
    """A ``CounterRng`` seeded from ``parts`` joined as a string (like ``seeded_rng``)."""
    return CounterRng(":".join(str(p) for p in parts))


@dataclass(frozen=True)
class Dist:
    """A seeded scalar distribution (SIMULATED workloads).

    ``kind``: ``const`` (always ``mean``), ``normal`` (mean, std), ``lognormal`` (parameterised
    by the mean and std of the variable itself, not of its log), ``uniform`` (mean +- std*sqrt(3),
    which has that mean and std). Samples are clipped to ``[low, high]``.
    """

    kind: Literal["const", "normal", "lognormal", "uniform"] = "const"
    mean: float = 0.0
    std: float = 0.0
    low: float = 0.0
    high: float = math.inf

    def __post_init__(self) -> None:
        if self.kind not in ("const", "normal", "lognormal", "uniform"):
            raise ValueError(f"Dist.kind must be const/normal/lognormal/uniform, got {self.kind!r}")
        if self.std < 0 or self.low > self.high:
            raise ValueError(f"Dist needs std >= 0 and low <= high, got {self}")
        if self.kind == "lognormal" and self.mean <= 0:
            raise ValueError(f"lognormal Dist needs mean > 0, got {self.mean}")

    @property
    def draws(self) -> bool:
        """Whether :meth:`sample` consumes randomness (not for ``const`` or ``std == 0``)."""
        return not (self.kind == "const" or self.std == 0)

    def sample(self, rng: random.Random | None) -> float:
        """One draw, clipped to ``[low, high]``; ``rng`` may be ``None`` when not ``draws``."""
        if not self.draws:
            x = self.mean
        elif rng is None:
            raise ValueError(f"{self} draws: sample() needs a random generator")
        elif self.kind == "normal":
            x = rng.gauss(self.mean, self.std)
        elif self.kind == "uniform":
            half = self.std * math.sqrt(3.0)
            x = rng.uniform(self.mean - half, self.mean + half)
        else:
            # For X ~ LogNormal(mu, s): E[X] = exp(mu + s^2/2), Var[X] = (exp(s^2) - 1) E[X]^2.
            s2 = math.log1p((self.std / self.mean) ** 2)
            x = rng.lognormvariate(math.log(self.mean) - s2 / 2.0, math.sqrt(s2))
        return min(max(x, self.low), self.high)

    def sample_int(self, rng: random.Random) -> int:
        return int(round(self.sample(rng)))


def const(value: float) -> Dist:
    return Dist("const", value)


@dataclass(frozen=True)
class DomainSpec:
    """One simulated task domain.

    The field defaults are placeholders (ASSUMED, no source): the benchmarks' domains, each
    number with its public source or marked assumed, are ``benchmarks.workloads.reasoning``
    and ``.agentic``.

    Attributes:
        name: domain name; the env name is ``"sim:" + name``.
        prompt_tokens: first-observation length (tokens).
        obs_tokens: length of each later observation (tokens).
        response_tokens: length the simulated policy wants to generate per turn (tokens); the
            worker cuts it at ``max_tokens`` (finish ``"length"``).
        num_turns: turns until the episode terminates.
        step_latency_s / reset_latency_s: env latency per step / per open (seconds).
        step_failure_prob: probability that one env step raises ``env_error``.
        reward_latency_s: reward-call latency (seconds).
    """

    name: str
    prompt_tokens: Dist = field(default_factory=lambda: const(256))
    obs_tokens: Dist = field(default_factory=lambda: const(64))
    response_tokens: Dist = field(default_factory=lambda: Dist("lognormal", 512, 256, 1, 1e9))
    num_turns: Dist = field(default_factory=lambda: const(1))
    step_latency_s: Dist = field(default_factory=lambda: const(0.0))
    reset_latency_s: Dist = field(default_factory=lambda: const(0.0))
    step_failure_prob: float = 0.0
    reward_latency_s: Dist = field(default_factory=lambda: const(0.0))

    def __post_init__(self) -> None:
        if not _MARKER.fullmatch(f"<sim:{self.name}:1>"):
            raise ValueError(f"domain name {self.name!r} must match [A-Za-z0-9_.-]+")
        if not 0.0 <= self.step_failure_prob <= 1.0:
            raise ValueError(f"step_failure_prob must be in [0, 1], got {self.step_failure_prob}")


class DomainTable:
    """Domains by name and by token id (shared by the sim env, tokenizer and workers)."""

    def __init__(self, domains: list[DomainSpec]) -> None:
        names = [d.name for d in domains]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate domain names in {names}")
        self.domains = list(domains)
        self._by_name = {d.name: d for d in domains}
        self._by_token = {DOMAIN_TOKEN_BASE + i: d for i, d in enumerate(domains)}
        self._token_of = {d.name: DOMAIN_TOKEN_BASE + i for i, d in enumerate(domains)}

    def by_name(self, name: str) -> DomainSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"unknown simulated domain {name!r}; known: {sorted(self._by_name)}")\
                from None

    def token_id(self, name: str) -> int:
        return self._token_of[self.by_name(name).name]

    def for_prompt(self, prompt_token_ids: Sequence[int]) -> DomainSpec | None:
        """The domain whose observation opens this prompt, or ``None`` if there is none."""
        for tok in prompt_token_ids[:64]:
            spec = self._by_token.get(tok)
            if spec is not None:
                return spec
        return None


class SimTokenizer:
    """Tokenizer for simulated text (SIMULATED; fits ``rollart.controller.ports.Tokenizer``).

    ``<sim:D:N>`` -> N copies of domain D's token id; every other whitespace-separated word ->
    one token (id from the word's CRC32, so a unique word such as a session tag makes prompts
    distinguishable for prefix caching). ``decode`` returns ``<gen:N>`` for ``N`` ids (the
    text of simulated actions). The chat template joins message contents with spaces.
    """

    eos_token = "</s>"
    eos_token_id = EOS_TOKEN_ID

    def __init__(self, table: DomainTable) -> None:
        self.table = table
        #: domain name -> its token id as int32 bytes
        self._packed: dict[str, bytes] = {}

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        pos = 0
        for match in _MARKER.finditer(text):
            ids.extend(_words(text[pos:match.start()]))
            ids.extend([self.table.token_id(match.group(1))] * int(match.group(2)))
            pos = match.end()
        ids.extend(_words(text[pos:]))
        return ids

    def encode_i32(self, text: str) -> bytes:
        """``encode(text)`` as little-endian int32 bytes, built without a Python int per token
        (a ``<sim:D:N>`` run is one fill of ``N`` items): the controller's prompt path."""
        parts: list[bytes] = []
        pos = 0
        for match in _MARKER.finditer(text):
            start = match.start()
            if start > pos:
                words = _words(text[pos:start])
                if words:
                    parts.append(struct.pack(f"<{len(words)}i", *words))
            name, count = match.groups()
            packed = self._packed.get(name)
            if packed is None:  # one pack per domain, not one per marker
                packed = self._packed[name] = struct.pack("<i", self.table.token_id(name))
            parts.append(packed * int(count))
            pos = match.end()
        if pos < len(text):
            words = _words(text[pos:])
            if words:
                parts.append(struct.pack(f"<{len(words)}i", *words))
        # one part (a bare observation, most prompts' bulk): no copy through join
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return f"<gen:{len(token_ids)}>"

    def apply_chat_template(self, conversation: list[dict[str, str]], *, tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        # Assistant turns end with the eos token, as ChatML's <|im_end|> does.
        text = " ".join(msg["content"] + (f" {self.eos_token}" if msg["role"] == "assistant"
                                          else "") for msg in conversation)
        return self.encode(text) if tokenize else text


def _words(text: str) -> list[int]:
    return [EOS_TOKEN_ID if w == SimTokenizer.eos_token
            else WORD_TOKEN_BASE + (zlib.crc32(w.encode()) & 0xFFFFF) for w in text.split()]


def observation(domain: str, num_tokens: int, tag: str = "") -> str:
    """The simulated observation text: ``tag`` (one word, e.g. a session id) then
    ``num_tokens`` tokens of ``domain`` — ``num_tokens + 1`` tokens in all when tagged."""
    marker = f"<sim:{domain}:{max(0, int(num_tokens))}>"
    return f"{tag} {marker}" if tag else marker
