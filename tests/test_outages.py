"""Outages told apart from bugs: while Postgres or Temporal does not answer, the logs name the error
in one line; any other error keeps its traceback."""

from __future__ import annotations

import logging

import asyncpg
import pytest
from temporalio.service import RPCError, RPCStatusCode

from activities.outages import OutageInOneLine, in_words


def raised(error: BaseException, during: BaseException | None = None) -> BaseException:
    """`error` as Python leaves it when raised while handling `during`."""
    try:
        try:
            raise during or error
        except BaseException:
            if during is None:
                raise
            raise error
    except BaseException as e:
        return e


def record(logger: str, message: str, error: BaseException) -> logging.LogRecord:
    return logging.LogRecord(logger, logging.WARNING, "x.py", 1, message, None, (type(error), error, error.__traceback__))


RECONNECT = ("asyncpg.pool", "Failed to restore the pool connection floor; retrying")
ACTIVITY = ("temporalio.activity", "Completing activity as failed ({'activity_type': 'plan_cycle', 'attempt': 2})")
CLOSED = "cannot call Transaction.__aexit__(): the underlying connection is closed"
TEMPORAL_DOWN = RPCError("tcp connect error", RPCStatusCode.UNAVAILABLE, b"")


@pytest.mark.parametrize("name, logged, error, said", [
    ("the pool's refused reconnection is one line", RECONNECT,
     ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)"), "the database"),
    ("the pool's reconnection to a database shutting down is one line", RECONNECT,
     asyncpg.AdminShutdownError("terminating connection"), "the database"),
    ("the pool's reconnection to a database still starting is one line", RECONNECT,
     asyncpg.CannotConnectNowError("the database system is starting up"), "the database"),
    ("an activity failed on a broken connection is one line", ACTIVITY,
     asyncpg.ConnectionDoesNotExistError("connection was closed"), "the database"),
    ("an activity failed on a refused connection is one line", ACTIVITY, ConnectionRefusedError(111, "refused"),
     "the database"),
    ("an activity whose database died mid-transaction is one line", ACTIVITY,
     raised(asyncpg.InterfaceError(CLOSED), during=asyncpg.InternalClientError("cannot switch to state 13")),
     "the database"),
    ("an activity whose idle connection the database shut down is one line", ACTIVITY,
     asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress"), "the database"),
    ("an activity whose connection's protocol failed is one line", ACTIVITY,
     asyncpg.InternalClientError('cannot switch to state 12; protocol is in the "failed" state'), "the database"),
    ("an activity that could not reach Temporal is one line", ACTIVITY, TEMPORAL_DOWN, "Temporal"),
    ("an error raised while Temporal could not be reached is one line", ACTIVITY,
     raised(RuntimeError("wake failed"), during=TEMPORAL_DOWN), "Temporal"),
    ("a wrong password keeps its traceback", RECONNECT, asyncpg.InvalidPasswordError("password authentication failed"),
     None),
    ("an activity's bug keeps its traceback", ACTIVITY, TypeError("unsupported operand"), None),
    ("a connection used twice at once keeps its traceback", ACTIVITY,
     asyncpg.InterfaceError("cannot perform operation: another operation is in progress"), None),
    ("a protocol busy with another query keeps its traceback", ACTIVITY,
     asyncpg.InternalClientError("cannot switch to state 12; another operation (11) is in progress"), None),
    ("a workflow Temporal does not know keeps its traceback", ACTIVITY,
     RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b""), None),
])
def test_warnings_while_a_server_is_down_are_one_line_each(name, logged, error, said):
    error = error if error.__traceback__ else raised(error)
    entry = record(*logged, error)
    assert OutageInOneLine().filter(entry)
    if said is None:
        assert entry.exc_info[1] is error and "Traceback" in logging.Formatter().format(entry)
        return
    assert entry.exc_info is None and "\n" not in logging.Formatter().format(entry)
    message = entry.getMessage()
    assert message.startswith(f"{logged[1]} ({said} does not answer: ") and message == f"{logged[1]} ({in_words(error)})"


def test_a_chain_that_loops_is_read_to_an_end():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert in_words(a) is None
