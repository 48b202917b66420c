"""The generation of each machine's token, as the API checks agents' requests against it.

A machine's token is made from the API's token, the machine's id and its generation
(`workers.settings.machine_token`); renewing it (`gpusched fleet token MACHINE --renew`) moves the
machine to its next generation in the store, and from then on the API takes only the new token.
Every heartbeat of the fleet needs the generation, so the API keeps the store's table in memory:

  1. Read whole (only the machines ever renewed have a row) when older than `fresh_for`: a
     renewal refuses the old token within that many seconds, in every API process.
  2. Read again at once when a machine's token does not match what is known, but such reads not
     more than once per `again_after`: the new token works as soon as the renewal is printed (or
     within `again_after`), and a stream of wrong tokens cannot turn into a stream of reads.

A read that fails raises: the API answers 503, as for any request while the database does not
answer, and never takes a token against a table it could not read.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

FRESH_FOR_S = 5.0
AGAIN_AFTER_S = 1.0


class TokenGenerations:
    def __init__(self, read: Callable[[], Awaitable[dict[str, int]]], *, fresh_for: float = FRESH_FOR_S,
                 again_after: float = AGAIN_AFTER_S, clock: Callable[[], float] = time.monotonic):
        self._read = read
        self._fresh_for = fresh_for
        self._again_after = again_after
        self._clock = clock
        self._known: dict[str, int] | None = None
        self._read_at = float("-inf")
        self._again_at = float("-inf")  # the last read for a token that did not match
        self._reading = asyncio.Lock()

    async def of(self, machine_id: str, *, again: bool = False) -> int:
        """The machine's current generation; with `again` (its token did not match what was
        known), read afresh unless such a read was made within `again_after`."""
        if self._stale(again):
            async with self._reading:  # one read for the requests that found it stale together
                if self._stale(again):
                    started = self._clock()
                    if again:
                        self._again_at = started
                    self._known = await self._read()
                    self._read_at = started
        assert self._known is not None
        return self._known.get(machine_id, 0)

    def _stale(self, again: bool) -> bool:
        now = self._clock()
        return (self._known is None or now - self._read_at >= self._fresh_for
                or (again and now - self._again_at >= self._again_after))
