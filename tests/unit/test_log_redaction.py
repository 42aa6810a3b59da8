"""No secret reaches a log line: an agent trajectory logged at DEBUG (the controller, httpx,
httpcore and openai inside it) never shows a trajectory's token, also not in a traceback;
bearer tokens, key assignments and registered secrets are redacted at every level."""

from __future__ import annotations

import logging
import re

import openai
import pytest
from test_agents_endpoint import cluster_for, echo
from test_controller_modes import run_steps

from rollart import logredact
from rollart.logredact import REDACTED, add_secret, redact

TOKEN_IN_URL = re.compile(r"/t/([A-Za-z0-9_\-]+)/v1")


async def test_an_agent_trajectory_logged_at_debug_shows_no_token(caplog) -> None:
    caplog.set_level(logging.DEBUG)  # the root logger: every library's records propagate here
    for name in ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "rollart", "aiohttp"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    tokens: set[str] = set()

    async def agent(client: openai.AsyncOpenAI, task: dict) -> None:
        tokens.add(TOKEN_IN_URL.search(str(client.base_url)).group(1))
        messages = [{"role": "user", "content": task["prompt"]}]
        first = await client.chat.completions.create(model="m", messages=messages)
        messages += [echo(first.choices[0].message), {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=messages)
        with pytest.raises(openai.BadRequestError):  # an error reply: logged by the client
            await client.chat.completions.create(model="m", messages=[], n=3)
        try:  # user code logging an error that names its URL, with the traceback
            raise RuntimeError(f"call to {client.base_url}chat/completions failed")
        except RuntimeError:
            logging.getLogger("user.agent").exception("agent saw an error at %s",
                                                      client.base_url)

    cluster, _reward = cluster_for()
    cluster.agent("math")(agent)
    async with cluster:
        await run_steps(cluster, 1)
    assert tokens, "no agent trajectory ran"
    # The client's per-request lines for the agent endpoint are not logged at all (httpx, or
    # the copy openai may bundle); the client did log (at DEBUG) around them.
    assert not [r for r in caplog.records if r.name.startswith("httpx")]
    assert any(r.name.startswith("openai") for r in caplog.records)
    text = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    leaked = [t for t in tokens if t in text]
    assert not leaked, f"{len(leaked)} token(s) in the log, e.g. near: " + \
        text[max(0, text.find(leaked[0]) - 200):text.find(leaked[0]) + 50]
    assert f"/t/{REDACTED}/v1" in text
    assert "Traceback" in caplog.text  # the traceback itself is kept, only the token goes


@pytest.mark.parametrize("line,secret", [
    ("Authorization: Bearer abcDEF123456789xyz", "abcDEF123456789xyz"),
    ("headers={'authorization': 'Bearer tok_9f8e7d6c5b4a'}", "tok_9f8e7d6c5b4a"),
    ("GET http://h:1/t/AbCdEfGh12345678_-xyz/v1/models", "AbCdEfGh12345678_-xyz"),
    ("reward.token=s3cr3tvalue99", "s3cr3tvalue99"),
    ('{"api_key": "sk-live-0123456789"}', "sk-live-0123456789"),
    ("url?token=qwertyuiop&x=1", "qwertyuiop"),
])
def test_secret_shapes_are_redacted(line: str, secret: str) -> None:
    out = redact(line)
    assert secret not in out and REDACTED in out


def test_ordinary_lines_are_left_alone() -> None:
    for line in ("num_tokens=512 max_tokens_per_turn: 8", "3 tokens: 12", "step 4 done",
                 "http://127.0.0.1:8000/v1/reward/math"):
        assert redact(line) == line


def test_registered_secrets_and_every_level_and_template_kept(caplog) -> None:
    logredact.install()  # idempotent (import rollart ran it)
    add_secret("plain-secret-value-42")
    caplog.set_level(logging.DEBUG)
    log = logging.getLogger("rollart.test")
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        log.log(level, "value %s here", "plain-secret-value-42")
    log.info("nothing %s", "secret-free")
    assert "plain-secret-value-42" not in caplog.text
    assert caplog.text.count(REDACTED) == 4
    kept = caplog.records[-1]
    assert (kept.msg, kept.args) == ("nothing %s", ("secret-free",))  # untouched records


@pytest.mark.parametrize("text", ["OPENAI_API_KEY=sk-abcdefgh12", "REWARD_TOKEN=abcdefgh12",
                                  '"access_token": "abcdefgh12"', "key='abcdefgh12'"])
def test_prefixed_and_bare_secret_names_are_redacted(text) -> None:
    assert "abcdefgh12" not in redact(text) and REDACTED in redact(text)


@pytest.mark.parametrize("text", ["num_tokens=12345", "monkey=bananas12"])
def test_names_that_only_contain_a_secret_word_are_kept(text) -> None:
    assert redact(text) == text
