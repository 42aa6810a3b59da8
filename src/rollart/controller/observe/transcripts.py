"""Transcripts: a sample of each step's finished trajectories, decoded to text, as JSONL.

The controller tells a :class:`TranscriptRecorder` about every finished trajectory
(:meth:`~TranscriptRecorder.finished`), every completed sample the buffer discards
(:meth:`~TranscriptRecorder.dropped`, with the buffer's waste reason: ``stale``,
``unselected``, ``retired``) and every batch (:meth:`~TranscriptRecorder.step`). A finished
trajectory is *chosen* with probability ``rate`` (seeded RNG) and followed until its fate is
known: trained (``"kept"``) or thrown away (``"wasted"`` and why). At each step the first
``per_step`` chosen trajectories whose fate became known are decoded and appended to the file;
a step with fewer is topped up with trained samples of its batch drawn at random, so every step
writes ``per_step`` records when its batch has that many (without the top-up a step's count
was the luck of its ``rate`` draws: the first 32 draws of seed 0 choose one trajectory at 0.25,
so step 1 of a 32-sample batch wrote one record where later steps wrote 8).

Cost to the controller: ``finished`` / ``dropped`` are a dict operation each; decoding (the
tokenizer) and writing run on one worker thread, so the event loop only hands over references to
the (immutable) samples. At most ``max_pending`` chosen trajectories wait for their fate at once
(the rest are not chosen), so memory stays bounded whatever the run's length.

One line per trajectory::

    {"step": 3, "sample_id": "g5/2#0", "group": "g5", "domain": "arith", "status": "wasted",
     "reason": "stale", "reward": 1.0, "reward_details": {...}, "reference": "12",
     "finish_reason": "terminated",
     "num_turns": 1, "num_tokens": 210, "num_generated": 17, "versions": [2, 2],
     "turns": [{"prompt": "<chat-templated prompt>", "response": "12", "versions": [2, 2],
                "num_tokens": 17, "context_tokens": 193}]}

``turns[i].prompt`` is the text the policy saw before turn i that was not in the sequence
already: the whole templated prompt for turn 0, the templated env observation afterwards (the
observation *delta*); ``context_tokens`` its length in tokens (the planner's measured prompt and observation
lengths, ``rollart.planner.measured``); ``response`` the decoded generated tokens (special tokens kept, so an eos
is visible); ``versions`` the min / max policy version of the turn's tokens. Texts longer than
``max_chars`` are cut, with ``"...[cut N chars]"`` appended. ``reference`` is the task's
reference answer as the env gave it to the reward function (``null`` where it gives none).
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from rollart.controller.buffer.sample import Sample
from rollart.controller.ports import Tokenizer


class TranscriptRecorder:
    """See the module docstring.

    Args:
        path: the JSONL file (appended to; its folder is created).
        tokenizer: the policy's tokenizer (``decode`` is called on the worker thread only).
        per_step: records written per step at most (>= 0).
        rate: probability in [0, 1] that a finished trajectory is chosen (followed to its
            fate, so wasted ones are seen too); 0: no records at all.
        max_chars: characters kept per decoded text (>= 16).
        seed: seed of the choosing RNG.
        max_pending: chosen trajectories waiting for their fate at most.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, path: str | Path, tokenizer: Tokenizer, *, per_step: int = 8,
                 rate: float = 0.25, max_chars: int = 4000, seed: int = 0,
                 max_pending: int | None = None) -> None:
        if per_step < 0 or not 0.0 <= rate <= 1.0 or max_chars < 16:
            raise ValueError(f"TranscriptRecorder: per_step {per_step} (>= 0), rate {rate} "
                             f"(0..1), max_chars {max_chars} (>= 16)")
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.per_step, self.rate, self.max_chars = per_step, rate, max_chars
        self.max_pending = max_pending if max_pending is not None else max(64, 8 * per_step)
        self._rng = random.Random(seed)
        self._pending: dict[str, Sample] = {}
        self._resolved: list[tuple[Sample, str, str | None]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollart-transcripts")
        self._lock = threading.Lock()  # guards the file and ``written``
        #: records written so far (updated by the worker thread)
        self.written = 0

    # ------------------------------------------------------------------ controller side (loop)
    def finished(self, sample: Sample) -> None:
        """A trajectory finished with a reward: maybe choose it (before the buffer sees it)."""
        if (self.per_step and len(self._pending) < self.max_pending
                and self._rng.random() < self.rate):
            self._pending[sample.sample_id] = sample

    def dropped(self, traj_id: str, reason: str) -> None:
        """The buffer discarded completed sample ``traj_id`` for ``reason`` (its on_drop)."""
        sample = self._pending.pop(traj_id, None)
        if sample is not None:
            self._resolved.append((sample, "wasted", reason))

    def step(self, step: int, batch: Sequence[Sample]) -> Future[int] | None:
        """Batch of ``step`` taken: write the step's records on the worker thread (the
        followed trajectories whose fate is known, topped up from ``batch`` to ``per_step``).

        Returns the future of the write (its result: records written), or ``None`` when there
        was nothing to write."""
        followed = set()
        for s in batch:
            if self._pending.pop(s.sample_id, None) is not None:
                self._resolved.append((s, "kept", None))
                followed.add(s.sample_id)
        short = self.per_step - len(self._resolved)
        if short > 0 and self.rate > 0:
            rest = [s for s in batch if s.sample_id not in followed]
            self._resolved += [(s, "kept", None)
                               for s in self._rng.sample(rest, min(short, len(rest)))]
        chosen, self._resolved = self._resolved[: self.per_step], []
        if not chosen:
            return None
        return self._pool.submit(self._write, step, chosen)

    def close(self) -> None:
        """Finish pending writes and stop the worker thread (blocking; idempotent)."""
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ worker thread
    def _write(self, step: int, chosen: list[tuple[Sample, str, str | None]]) -> int:
        # default=str: a local reward's details may hold values JSON cannot encode.
        lines = [json.dumps(self.record(step, s, status, reason), default=str) + "\n"
                 for s, status, reason in chosen]
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.writelines(lines)
            self.written += len(lines)
        return len(lines)

    def _text(self, ids: np.ndarray) -> str:
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        if len(text) > self.max_chars:
            text = f"{text[: self.max_chars]}...[cut {len(text) - self.max_chars} chars]"
        return text

    def record(self, step: int, s: Sample, status: str, reason: str | None) -> dict[str, Any]:
        """The JSON-able transcript of sample ``s`` (see the module docstring)."""
        ids = np.frombuffer(s.token_ids, dtype=np.int32)
        mask = np.frombuffer(s.loss_mask, dtype=np.uint8)
        versions = np.frombuffer(s.full_versions(), dtype=np.int32)
        # Runs of equal mask values: 0 = context the policy was given, 1 = what it generated.
        edges = np.flatnonzero(np.diff(mask)) + 1
        bounds = [0, *edges.tolist(), len(mask)]
        turns: list[dict[str, Any]] = []
        context, context_tokens = "", 0
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if a == b:
                continue
            if mask[a] == 0:
                context, context_tokens = self._text(ids[a:b]), b - a
                continue
            v = versions[a:b]
            turns.append({"prompt": context, "response": self._text(ids[a:b]),
                          "versions": [int(v.min()), int(v.max())], "num_tokens": b - a,
                          "context_tokens": context_tokens})
            context, context_tokens = "", 0
        gen = versions[mask.view(np.bool_)]
        return {
            "step": step, "sample_id": s.sample_id, "group": s.group_key, "domain": s.domain,
            "status": status, "reason": reason, "reward": s.reward,
            "reward_details": s.metadata.get("reward_details", {}),
            "reference": s.metadata.get("reference"),
            "finish_reason": s.finish_reason, "num_turns": s.num_turns,
            "num_tokens": s.num_tokens, "num_generated": s.num_generated,
            "versions": [int(gen.min()), int(gen.max())] if len(gen) else None,
            "turns": turns,
        }
