"""When a machine's silence counts: not while the control plane could not hear it. After the API
or the database was down, machines it could not hear are not taken for dead (nor their jobs
requeued); machines that were gone before, or stay silent once it hears again, are. Real Postgres."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from activities.store import GpuReport, Store, hearing_verdict
from scheduler.models import Machine
from workflows.types import HEARD, SILENT, UNSURE

pytestmark = pytest.mark.live
_names = itertools.count()
NOW = "extract(epoch from clock_timestamp())"
TIMEOUT = 120.0  # the cluster's machine_timeout


@pytest.fixture
def one_machine(live_servers):
    """A fresh database with one reported machine; yields (run, store)."""
    loop = asyncio.new_event_loop()
    store = loop.run_until_complete(Store.connect(live_servers.new_database(f"listening_{next(_names)}")))

    async def setup():
        await store.migrate()
        await store.register_fleet("c1", [Machine(id="c1/b0/r0/m0", cluster="c1", block="b0", rack="r0",
                                                  gpus=2, gpu_type="H100")])
        await store.machine_heartbeat("c1/b0/r0/m0", 1, [GpuReport(index=i) for i in range(2)])
        await store.configure_cluster("c1", machine_timeout=TIMEOUT)

    loop.run_until_complete(setup())
    yield loop.run_until_complete, store
    loop.run_until_complete(store.close())
    loop.close()


# (name, the machine silent for, the listening row as seconds ago (at, since, deaf_from) or None, reachable)
CASES = [
    ("with no API ever run, a machine silent past its timeout is unreachable", 200, None, False),
    ("a machine heard lately is reachable", 10, (0.5, 1000, None), True),
    ("a machine silent past its timeout while the API heard throughout is unreachable", 200, (0.5, 1000, None), False),
    ("after five minutes of a deaf control plane, a machine it could not hear is reachable", 310, (0.5, 5, 305), True),
    ("once it has heard again for a whole timeout, a machine still silent is unreachable", 450, (0.5, 130, 440), False),
    ("a machine already gone when hearing stopped stays unreachable", 3600, (0.5, 5, 305), False),
    ("while nobody hears, a machine heard when hearing stopped stays reachable", 400, (390, 5000, None), True),
    ("while nobody hears, a machine gone before hearing stopped stays unreachable", 600, (390, 5000, None), False),
    ("a machine whose timeout ran out before the break was plain stays unreachable", 122, (4, 5000, None), False),
    ("... and so once hearing resumes", 126, (0.5, 2, 8), False),
    ("a machine still within its timeout when the break was plain stays reachable", 120.5, (4, 5000, None), True),
    ("a first API knows nothing of before it: a machine silent past its timeout is unreachable", 200,
     (0.5, 2, None), False),
]


@pytest.mark.parametrize("name, silent, listening, reachable", CASES, ids=[c[0] for c in CASES])
def test_silence_counts_only_while_the_control_plane_hears(one_machine, name, silent, listening, reachable):
    run, store = one_machine
    run(store.pool.execute(f"UPDATE machines SET last_heartbeat = {NOW} - $1", silent))
    if listening is not None:
        at, since, deaf_from = listening
        run(store.pool.execute(f"INSERT INTO listening (at, since, deaf_from) VALUES ({NOW} - $1, {NOW} - $2, "
                               f"{NOW} - $3)", at, since, deaf_from))
    [machine] = run(store.snapshot("c1")).machines
    [listed] = run(store.list_machines("c1"))
    assert (machine.reachable, listed["reachable"]) == (reachable, reachable), name


def test_a_break_in_hearing_starts_a_new_stretch_and_remembers_when_it_began(one_machine):
    run, store = one_machine
    row = "SELECT at, since, deaf_from FROM listening"
    run(store.listened())
    first = run(store.pool.fetchrow(row))
    assert first["since"] == first["at"] and first["deaf_from"] is None
    run(store.listened())
    assert run(store.pool.fetchrow(row))["since"] == first["since"]  # no break: the same stretch
    run(store.pool.execute("UPDATE listening SET at = at - 10"))  # nobody said it for 10 s
    run(store.listened())
    after = run(store.pool.fetchrow(row))
    assert after["since"] == after["at"] > first["at"]
    assert after["deaf_from"] == pytest.approx(first["at"] - 10, abs=1)


# (name, seconds ago: machine last heard, nobody said it hears, it hears without a break; verdict)
VERDICTS = [
    ("a machine heard 2 s ago while the API hears is heard", 2, 0.5, 1000, HEARD),
    ("a machine silent for 10 s while the API heard throughout is silent", 10, 0.5, 1000, SILENT),
    ("a machine never heard, while the API heard throughout, is silent", None, 0.5, 1000, SILENT),
    ("nobody has said it hears for 10 s (the API or the database is down): unsure", 2, 10, 1000, UNSURE),
    ("the API hears again for 1 s, not yet the machine: unsure", 20, 0.5, 1, UNSURE),
    ("the API hears again for 1 s and has heard the machine since: heard", 0.5, 0.5, 1, HEARD),
    ("the API hears again for 10 s and has not heard the machine: silent", 20, 0.5, 10, SILENT),
    ("with no API ever run, silence alone decides", 10, None, None, SILENT),
    ("with no API ever run, a machine heard lately is heard", 1, None, None, HEARD),
]


@pytest.mark.parametrize("name, silent_for, unsaid_for, listened_for, verdict", VERDICTS,
                         ids=[v[0] for v in VERDICTS])
def test_a_lost_watch_asks_whether_the_machine_was_heard_or_the_control_plane_cannot_tell(
        name, silent_for, unsaid_for, listened_for, verdict):
    assert hearing_verdict(silent_for, unsaid_for, listened_for, within=4.0) == verdict


def test_the_store_answers_what_it_heard_of_each_machine_in_order(one_machine):
    run, store = one_machine
    assert run(store.hearing(["c1/b0/r0/m0", "c1/b9/r9/m9"], 4.0)) == [HEARD, SILENT]  # no such machine: silent
    run(store.pool.execute(f"INSERT INTO listening (at, since) VALUES ({NOW} - 10, {NOW} - 1000)"))
    assert run(store.hearing(["c1/b0/r0/m0"], 4.0)) == [UNSURE]  # nobody has said it hears for 10 s
    run(store.listened())  # hearing again since now
    run(store.pool.execute(f"UPDATE machines SET last_heartbeat = {NOW} - 30"))
    assert run(store.hearing(["c1/b0/r0/m0"], 4.0)) == [UNSURE]
    run(store.pool.execute("UPDATE listening SET since = since - 5"))
    assert run(store.hearing(["c1/b0/r0/m0"], 4.0)) == [SILENT]


AT_THE_LIMIT = [
    ("a machine heard just within the seconds asked is heard", 4, 0.5, 1000, HEARD),
    ("a machine silent a little longer than asked, while the API heard throughout, is silent", 5, 0.5, 1000, SILENT),
]


@pytest.mark.parametrize("name, silent_for, unsaid_for, listened_for, verdict", AT_THE_LIMIT,
                         ids=[v[0] for v in AT_THE_LIMIT])
def test_a_machine_is_heard_for_as_long_as_asked_and_no_longer(name, silent_for, unsaid_for, listened_for, verdict):
    assert hearing_verdict(silent_for, unsaid_for, listened_for, within=4.0) == verdict
