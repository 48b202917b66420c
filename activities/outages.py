"""Outages of the servers gpusched depends on, told apart from bugs.

Postgres or Temporal down, restarting or out of reach is expected in operation: the API answers
503 and the caller tries again; workers retry their activities. Logs name such an error in one
line instead of a traceback per try (one per heartbeat of the fleet, per reconnection of every
pool), so the tracebacks left in a log are the bugs.

An error is read with what it was raised from or during: a connection that breaks inside a
transaction surfaces as the transaction's own complaint that its connection is closed.
"""

from __future__ import annotations

import logging
import re

import asyncpg
from temporalio.service import RPCError, RPCStatusCode

# The errors of a database that is down, restarting or out of reach: a refused or reset
# connection, one that broke, and "shutting down" or "starting up" (operator intervention).
DATABASE_DOWN = (OSError, asyncpg.PostgresConnectionError, asyncpg.OperatorInterventionError)
# asyncpg's words when a transaction or statement finds its connection gone under it (the
# database died mid-transaction); its other interface errors are the caller's mistakes.
_CONNECTION_CLOSED = "the underlying connection is closed"
# And when the database shut down under an idle pooled connection: the server's farewell error
# left its protocol consuming an error (state 2) or failed, and the next query cannot start.
# Busy with another of our queries (any other state) would be our bug.
_PROTOCOL_LEFT_BROKEN = re.compile(r'cannot switch to state \d+; (another operation \(2\) is in progress|'
                                   r'protocol is in the "failed" state)')
_CHAIN_MOST = 8  # links followed: a chain is a few exceptions long, and may loop


def _chain(error: BaseException | None):
    seen = 0
    while error is not None and seen < _CHAIN_MOST:
        yield error
        seen += 1
        error = error.__cause__ or error.__context__


def database_down(error: BaseException | None) -> BaseException | None:
    """The error in `error`'s chain that shows the database does not answer, or None."""
    for link in _chain(error):
        if isinstance(link, DATABASE_DOWN):
            return link
        if isinstance(link, asyncpg.InterfaceError) and _CONNECTION_CLOSED in str(link):
            return link
        if isinstance(link, asyncpg.InternalClientError) and _PROTOCOL_LEFT_BROKEN.match(str(link)):
            return link
    return None


def temporal_down(error: BaseException | None) -> BaseException | None:
    """The error in `error`'s chain that shows the Temporal server does not answer, or None."""
    for link in _chain(error):
        if isinstance(link, RPCError) and link.status == RPCStatusCode.UNAVAILABLE:
            return link
    return None


def in_words(error: BaseException | None) -> str | None:
    """'the database does not answer: …' or 'Temporal does not answer: …' for an outage's error;
    None for any other."""
    for who, found in (("the database", database_down(error)), ("Temporal", temporal_down(error))):
        if found is not None:
            return f"{who} does not answer: {type(found).__name__}: {found}"
    return None


class OutageInOneLine(logging.Filter):
    """While Postgres is down, asyncpg's pool logs a full traceback each time it fails to
    reconnect (every 1-60 s per pool, in every process), and Temporal's worker one for each try
    of an activity that could not reach Postgres or Temporal. Such a record becomes one line that
    names the error. Any other error keeps its traceback."""

    LOGGERS = ("asyncpg.pool", "temporalio.activity")

    def filter(self, record: logging.LogRecord) -> bool:
        said = in_words(record.exc_info[1] if record.exc_info else None)
        if said is not None:
            record.msg = f"{record.getMessage()} ({said})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


_IN_ONE_LINE = OutageInOneLine()


def log_outages_in_one_line() -> None:
    for name in OutageInOneLine.LOGGERS:
        logging.getLogger(name).addFilter(_IN_ONE_LINE)  # added once: filters are a set
