"""The scenarios of ``test_rpc.py`` (matching, per-item errors, bad input, timeouts and dead
peers) again on uvloop: the transport drives its sockets through ``loop.add_reader``, whose
behaviour differs between uvloop and the default selector loop that pytest-asyncio runs."""

from __future__ import annotations

import pytest
import test_rpc  # the sibling module (pytest puts tests/unit on sys.path)
import uvloop

SCENARIOS = [
    test_rpc.test_concurrent_calls_are_matched_by_call_id,
    test_rpc.test_handler_error_is_per_item_and_server_keeps_serving,
    test_rpc.test_malformed_unknown_and_oversized_messages_get_error_replies,
    test_rpc.test_timeout_and_dead_peer_are_distinct,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.removeprefix("test_"))
def test_rpc_scenario_on_uvloop(scenario) -> None:
    uvloop.run(scenario())
