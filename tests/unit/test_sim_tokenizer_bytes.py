"""``SimTokenizer.encode_i32`` (one packed id per domain, reused; a lone marker returned without
a join) gives exactly ``encode``'s ids, call after call."""

from __future__ import annotations

from rollart.sim.workload import DomainSpec, DomainTable, SimTokenizer, observation
from rollart.transport import tokenbytes as tb

TABLE = DomainTable([DomainSpec("a"), DomainSpec("b")])


def test_repeated_domains_and_words_match_encode_on_every_call() -> None:
    tok = SimTokenizer(TABLE)
    texts = [observation("a", 5), observation("a", 5, "s17"),
             f"{observation('a', 2)} mid {observation('b', 3)}{observation('a', 1)} end </s>",
             "   " + observation("b", 0) + "   ", "plain words only"]
    for _ in range(2):  # the second round reuses the packed ids
        for text in texts:
            assert tok.encode_i32(text) == tb.pack_i32(tok.encode(text)), text
    assert len(tok.encode_i32(observation("b", 16_384))) == 4 * 16_384
