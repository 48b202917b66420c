"""The API's view of machine tokens' generations (workers/token_generations.py): fresh enough that
a renewal refuses the old token within seconds, read again at once for a token that does not match,
and never a read per request."""

from __future__ import annotations

import asyncio

import pytest

from workers.token_generations import TokenGenerations


class Table:
    """The store's table of generations, counting its reads; `fail` makes the next read raise."""

    def __init__(self, rows: dict[str, int]):
        self.rows, self.reads, self.fail = dict(rows), 0, False

    async def read(self) -> dict[str, int]:
        self.reads += 1
        await asyncio.sleep(0)  # a real read lets other requests run meanwhile
        if self.fail:
            self.fail = False
            raise ConnectionRefusedError("the database does not answer")
        return dict(self.rows)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def generations(table: Table, clock: Clock) -> TokenGenerations:
    return TokenGenerations(table.read, fresh_for=5.0, again_after=1.0, clock=clock)


# (sentence, seconds after the first read, asked again?, reads in all, generation answered)
ASKED = [
    ("a machine never renewed is at generation 0", 0.0, False, 1, 0),
    ("within its freshness the table is not read again", 4.9, False, 1, 0),
    ("past its freshness the table is read again and a renewal is seen", 5.0, False, 2, 3),
    ("a token that did not match reads the table again at once", 0.1, True, 2, 3),
]


@pytest.mark.parametrize("sentence, after, again, reads, answered", ASKED, ids=[row[0] for row in ASKED])
def test_the_table_is_read_when_stale_or_when_a_token_did_not_match(sentence, after, again, reads, answered):
    async def go():
        table, clock = Table({"c1/b0/r0/m1": 2}), Clock()
        known = generations(table, clock)
        assert await known.of("c1/b0/r0/m0") == 0 and await known.of("c1/b0/r0/m1") == 2
        table.rows["c1/b0/r0/m0"] = 3  # renewed three times since
        clock.t += after
        assert await known.of("c1/b0/r0/m0", again=again) == answered
        assert table.reads == reads

    asyncio.run(go())


def test_tokens_that_do_not_match_read_the_table_once_a_second_at_most():
    async def go():
        table, clock = Table({}), Clock()
        known = generations(table, clock)
        await known.of("m")
        for step in range(20):  # a wrong token every 0.1 s for 2 s
            clock.t += 0.1
            assert await known.of("m", again=True) == 0
        assert table.reads == 1 + 2

    asyncio.run(go())


def test_requests_that_find_the_table_stale_together_share_one_read():
    async def go():
        table, clock = Table({"m": 1}), Clock()
        known = generations(table, clock)
        assert await asyncio.gather(*(known.of("m") for _ in range(50))) == [1] * 50
        assert table.reads == 1

    asyncio.run(go())


def test_a_failed_read_raises_and_the_next_request_reads_again():
    async def go():
        table, clock = Table({"m": 1}), Clock()
        known = generations(table, clock)
        table.fail = True
        with pytest.raises(ConnectionRefusedError):
            await known.of("m")  # the API answers 503: no token is taken against an unread table
        assert await known.of("m") == 1 and table.reads == 2
        table.rows["m"], clock.t = 2, clock.t + 5.0
        table.fail = True
        with pytest.raises(ConnectionRefusedError):
            await known.of("m")  # stale and unreadable: not answered from the stale table either
        assert await known.of("m") == 2

    asyncio.run(go())
