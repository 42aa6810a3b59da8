"""The reward service as a real subprocess: ``python -m rollart.reward.server --port 0``.

User functions come from ``reward_user_functions.py`` next to this file (``--functions``).
After every bad-input case the service must still answer a good request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import reasoning_gym

from rollart.reward.client import RewardClient
from rollart.transport.errors import RewardError

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
MAX_BODY = 65536


def _env() -> dict[str, str]:
    paths = [str(HERE), str(SRC), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("reward")
    ready, log = tmp / "ready", tmp / "server.log"
    cmd = [
        sys.executable, "-m", "rollart.reward.server", "--port", "0", "--ready-file", str(ready),
        "--functions", "reward_user_functions", "--max-body-bytes", str(MAX_BODY),
        "--processes", "1", "--timeout-s", "30", "--no-auth",
    ]  # fmt: skip
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=_env(), stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"reward service did not start (rc={proc.poll()}):\n{log.read_text()}")
        time.sleep(0.1)
    yield "http://" + ready.read_text().strip()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"reward service ignored SIGTERM:\n{log.read_text()}")
    assert rc == 0, log.read_text()


def _request(url: str, data: bytes | None = None, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _score(base: str, name: str, response: str, reference=None, metadata=None) -> tuple[int, dict]:
    body = {"prompt": "What is 6*7?", "response": response, "reference": reference}
    if metadata is not None:
        body["metadata"] = metadata
    return _request(f"{base}/v1/reward/{name}", json.dumps(body).encode())


def _assert_serving(base: str) -> None:
    assert _request(f"{base}/healthz", method="GET")[0] == 200
    assert _score(base, "math", r"so \boxed{42}", "42") == (
        200,
        {
            "reward": 1.0,
            "details": {"answer_source": "boxed", "reference_parsed": "42", "answer": "42"},
        },
    )


def test_health_and_listing(service: str) -> None:
    status, body = _request(f"{service}/v1/reward", method="GET")
    names = {f["name"] for f in body["functions"]}
    assert status == 200
    assert {"math", "reasoning_gym", "exact_match", "boxed_format", "raises", "hangs"} <= names
    status, health = _request(f"{service}/healthz", method="GET")
    assert status == 200 and health["status"] == "ok"


@pytest.mark.parametrize(
    ("response", "reference", "reward"),
    [
        (r"6*7 = 42, so the answer is \boxed{42}.", "42", 1.0),
        (r"The answer is \boxed{41}.", "42", 0.0),
        (r"\boxed{\frac{84}{2}}", 42, 1.0),
        ("I do not know.", "42", 0.0),
    ],
)
def test_math_reward(service: str, response: str, reference: object, reward: float) -> None:
    status, body = _score(service, "math", response, reference)
    assert status == 200
    assert body["reward"] == reward


def test_other_builtins(service: str) -> None:
    assert _score(service, "boxed_format", r"\boxed{x}")[1]["reward"] == 1.0
    assert _score(service, "boxed_format", "x")[1]["reward"] == 0.0
    assert _score(service, "exact_match", " a  b ", "a b")[1]["reward"] == 1.0
    entry = reasoning_gym.create_dataset("chain_sum", size=3, seed=11)[2]
    meta = {"dataset": "chain_sum", "entry": entry}
    good = _score(service, "reasoning_gym", f"<answer>{entry['answer']}</answer>", None, meta)
    assert good[0] == 200 and good[1]["reward"] == 1.0


def test_user_functions_sync_and_async(service: str) -> None:
    assert _score(service, "length_bonus", "abcd", None, {"target_len": 8})[1]["reward"] == 0.5
    assert _score(service, "async_echo", "0.75")[1]["reward"] == 0.75


BAD_INPUTS = [
    # (id, name, raw body, status, fragment of the error)
    ("malformed_json", "math", b'{"prompt": "p", "response": ', 400, "malformed JSON"),
    ("not_json", "math", b"hello", 400, "malformed JSON"),
    ("missing_field", "math", b'{"prompt": "p", "reference": "1"}', 400, "missing required field `response`"),
    ("wrong_type", "math", b'{"prompt": "p", "response": 5, "reference": "1"}', 400, "Expected `str`, got `int` - at `$.response`"),
    ("unknown_function", "nope", b'{"prompt": "p", "response": "r", "reference": 1}', 404, "unknown reward function 'nope'"),
    ("oversize_body", "math", b'{"prompt": "' + b"x" * MAX_BODY + b'", "response": "r", "reference": 1}', 413, f"limit is {MAX_BODY} bytes"),
    ("bad_reference", "math", b'{"prompt": "p", "response": "r", "reference": "\\\\frac{"}', 422, "does not parse"),
    ("bad_metadata", "reasoning_gym", b'{"prompt": "p", "response": "r", "reference": null}', 422, "metadata.dataset"),
    ("raises", "raises", b'{"prompt": "p", "response": "r", "reference": null}', 500, "raised RuntimeError: user function exploded"),
    ("returns_nan", "returns_nan", b'{"prompt": "p", "response": "r", "reference": null}', 422, "non-finite reward nan"),
    ("returns_none", "returns_none", b'{"prompt": "p", "response": "r", "reference": null}', 422, "returned None"),
    ("returns_text", "returns_text", b'{"prompt": "p", "response": "r", "reference": null}', 422, "returned str"),
    ("hangs", "hangs", b'{"prompt": "p", "response": "r", "reference": null}', 504, "timed out after 1 s"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "body", "status", "fragment"),
    [c[1:] for c in BAD_INPUTS],
    ids=[c[0] for c in BAD_INPUTS],
)
def test_bad_input_is_reported_and_service_keeps_serving(
    service: str, name: str, body: bytes, status: int, fragment: str
) -> None:
    got_status, got = _request(f"{service}/v1/reward/{name}", body)
    assert got_status == status
    assert set(got) == {"error"}  # never a reward
    assert fragment in got["error"]
    _assert_serving(service)


async def test_reward_client_against_the_service(service: str) -> None:
    async with RewardClient(service, max_retries=1, backoff_s=0.01, timeout_s=30) as client:
        ok = await client.score("math", "q", r"\boxed{7}", "7")
        assert ok.reward == 1.0
        names = {f["name"] for f in await client.list_functions()}
        assert "math" in names
        with pytest.raises(RewardError, match="returned None") as info:
            await client.score("returns_none", "q", "r")
        assert info.value.status == 422


def test_bad_command_lines_exit_2() -> None:
    for args, message in [
        (["--functions", "no_such_module_xyz:fn"], "cannot import module 'no_such_module_xyz'"),
        (["--port", "70000"], "--port must be in [0, 65535]"),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "rollart.reward.server", *args, "--no-auth"],
            env=_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2
        assert message in out.stderr
