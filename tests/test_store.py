"""The Postgres store on a real Postgres: migrations, admission, the cycle's commit with its
version check, attempts, and the database's own refusal to double-book a GPU."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import threading
import time
from datetime import datetime
from pathlib import Path

import asyncpg
import pytest
from asyncpg.transaction import Transaction
from pydantic import ValidationError

from activities import queries as q
from activities.store import (HELD_BACK_MAX, UNPICKED_COOL_DOWN, CycleConflict, GpuReport, MigrationBlocked, Store,
                              held_back)
from scheduler.cycle import run_cycle
from scheduler.models import CycleResult, Machine, Placement, PolicyConfig, Preemption, Quota
from live.servers import until_blocked_or_done
from workers.servers import with_database
from workflows.types import CheckpointReport, EndReason, JobRequest, JobState

pytestmark = pytest.mark.live
_names = itertools.count()
NOW_SQL = "extract(epoch from clock_timestamp())"
SHIPPED_MIGRATIONS = len(list((Path(__file__).parents[1] / "activities" / "migrations").glob("*.sql")))


def machines(n: int = 2, gpus: int = 4, cluster: str = "c1") -> list[Machine]:
    return [Machine(id=f"{cluster}/b0/r0/m{i}", cluster=cluster, block="b0", rack="r0", gpus=gpus,
                    gpu_type="H100") for i in range(n)]


def job(job_id: str, gpus: int = 2, team: str = "vision", **kw) -> JobRequest:
    return JobRequest(job_id=job_id, team=team, num_gpus=gpus, **{"command": ["true"], **kw})


def placed(run, store, job_id: str = "a", gpus: int = 2) -> int:
    """Admit a job alone in the queue and place it in cycle 1, not started yet; its allocation id."""
    run(store.admit(job(job_id, gpus=gpus)))
    return run(store.plan_cycle("c1", 1, run_cycle)).placements[0].signal.allocation_id


def started(run, store, job_id: str = "a", gpus: int = 2) -> int:
    """As `placed`, and started; its allocation id."""
    alloc = placed(run, store, job_id, gpus)
    run(store.start_attempt(job_id, alloc))
    return alloc


@pytest.fixture
def store_env(live_servers):
    """A fresh database with the schema, a 2 × 4-GPU cluster whose agents have reported, and a
    quota for team vision; yields (run, store) where run(coro) runs on one event loop."""
    dsn = live_servers.new_database(f"store_{next(_names)}")
    loop = asyncio.new_event_loop()
    store = loop.run_until_complete(Store.connect(dsn))

    async def setup():
        await store.migrate()
        await store.register_fleet("c1", machines())
        for m in machines():
            await store.machine_heartbeat(m.id, 1, [GpuReport(index=i) for i in range(4)])
        await store.set_quota("vision", Quota(guaranteed=4, max=8, queue_cap=3))

    loop.run_until_complete(setup())
    yield loop.run_until_complete, store
    loop.run_until_complete(store.close())
    loop.close()


@pytest.mark.parametrize("overwrite, partition", [(False, "inference"), (True, "training")],
                         ids=["machines registered again without being declared keep the partition set since",
                              "machines declared again are written as declared"])
def test_registering_known_machines_again_overwrites_them_only_when_asked(store_env, overwrite, partition):
    """`gpusched dev up` registers its machines at every start: one that only brought a killed
    agent back put back the partitions `fleet apply` had set."""
    run, store = store_env
    moved = [m.model_copy(update={"partition": "inference"}) for m in machines()]
    run(store.register_fleet("c1", moved))
    run(store.register_fleet("c1", machines(), overwrite=overwrite))
    assert {m["partition"] for m in run(store.list_machines("c1"))} == {partition}


def test_migrations_apply_once_and_are_recorded(store_env):
    run, store = store_env
    assert run(store.migrate()) == []
    versions = run(store.pool.fetch("SELECT version FROM schema_migrations ORDER BY version"))
    assert [r["version"] for r in versions] == list(range(1, SHIPPED_MIGRATIONS + 1))
    assert run(store.unmigrated()) == []


def test_processes_migrating_a_fresh_database_at_once_all_succeed_and_apply_each_migration_once(live_servers):
    dsn = live_servers.new_database(f"store_{next(_names)}")

    async def scenario():
        stores = [await Store.connect(dsn) for _ in range(4)]
        try:
            applied = await asyncio.gather(*(s.migrate() for s in stores))
            versions = await stores[0].pool.fetch("SELECT version FROM schema_migrations ORDER BY version")
            return applied, [r["version"] for r in versions]
        finally:
            for s in stores:
                await s.close()

    applied, versions = asyncio.run(scenario())
    assert sorted(name for names in applied for name in names) == sorted(set(n for names in applied for n in names))
    assert len([n for names in applied for n in names]) == len(versions) == SHIPPED_MIGRATIONS


def _with_a_migration_altering_machines(monkeypatch, tmp_path) -> str:
    """A next migration, 9999, that changes the machines table; its file name."""
    import activities.store as store_module

    extra = tmp_path / "9999_a_column_for_the_test.sql"
    extra.write_text("ALTER TABLE machines ADD COLUMN test_column integer;")
    shipped = store_module._migration_files()
    monkeypatch.setattr(store_module, "_migration_files", lambda: (*shipped, extra))
    return extra.name


def test_a_migration_waiting_for_a_locked_table_lets_other_queries_on_it_through(live_servers, monkeypatch, tmp_path):
    """An ALTER TABLE queued behind another session's transaction made every later query on the
    table queue behind it: the scheduler, the API and the agents stalled until that transaction
    ended. The migration now gives up its place in the lock queue and tries again."""
    dsn = live_servers.migrated_database(f"store_{next(_names)}")
    name = _with_a_migration_altering_machines(monkeypatch, tmp_path)

    async def scenario():
        store, holder, reader = await Store.connect(dsn), await asyncpg.connect(dsn), await asyncpg.connect(dsn)
        try:
            holding = holder.transaction()
            await holding.start()
            await holder.fetch("SELECT * FROM machines")  # holds the table's ACCESS SHARE lock to its end
            migrating = asyncio.create_task(store.migrate(lock_wait=0.2, patience=30))
            slowest = 0.0
            for _ in range(8):
                await asyncio.sleep(0.1)
                began = time.monotonic()
                await asyncio.wait_for(reader.fetchval("SELECT count(*) FROM machines"), timeout=5)
                slowest = max(slowest, time.monotonic() - began)
            assert not migrating.done()
            await holding.commit()
            return slowest, await asyncio.wait_for(migrating, timeout=10)
        finally:
            for conn in (holder, reader):
                await conn.close()
            await store.close()

    slowest, applied = asyncio.run(scenario())
    assert slowest < 1.0, f"a query on the table waited {slowest:.1f} s behind the migration"
    assert applied == [name]


def test_a_migration_blocked_past_its_patience_says_which_and_applies_nothing(live_servers, monkeypatch, tmp_path):
    dsn = live_servers.migrated_database(f"store_{next(_names)}")
    name = _with_a_migration_altering_machines(monkeypatch, tmp_path)

    async def scenario():
        store, holder = await Store.connect(dsn), await asyncpg.connect(dsn)
        try:
            async with holder.transaction():
                await holder.fetch("SELECT * FROM machines")
                with pytest.raises(MigrationBlocked) as blocked:
                    await asyncio.wait_for(store.migrate(lock_wait=0.1, patience=1.0), timeout=10)
            versions = {r["version"] for r in await store.pool.fetch("SELECT version FROM schema_migrations")}
            columns = await store.pool.fetchval(
                "SELECT count(*) FROM information_schema.columns WHERE table_name = 'machines' AND column_name = 'test_column'")
            return str(blocked.value), versions, columns
        finally:
            await holder.close()
            await store.close()

    message, versions, columns = asyncio.run(scenario())
    assert name in message and "pg_stat_activity" in message
    assert 9999 not in versions and columns == 0


def test_a_worker_told_to_stop_while_its_migration_waits_for_a_lock_stops_at_once_and_applies_nothing(
        live_servers, monkeypatch, tmp_path):
    """The control worker migrates as `keep_connecting` tries it; a stop was looked at only
    between tries, so SIGTERM waited out the migration's patience (2 minutes)."""
    from workers.settings import keep_connecting

    dsn = live_servers.migrated_database(f"store_{next(_names)}")
    _with_a_migration_altering_machines(monkeypatch, tmp_path)

    async def scenario():
        store, holder = await Store.connect(dsn), await asyncpg.connect(dsn)
        try:
            async with holder.transaction():
                await holder.fetch("SELECT * FROM machines")
                stop = asyncio.Event()
                asyncio.get_running_loop().call_later(0.5, stop.set)
                began = time.monotonic()
                answer = await asyncio.wait_for(
                    keep_connecting("Postgres, to migrate it,", lambda: store.migrate(lock_wait=0.1, patience=60),
                                    stop, within=60), timeout=10)
                waited = time.monotonic() - began
            versions = {r["version"] for r in await store.pool.fetch("SELECT version FROM schema_migrations")}
            return answer, waited, versions
        finally:
            await holder.close()
            await store.close()

    answer, waited, versions = asyncio.run(scenario())
    assert answer is None and waited < 3.0, f"stopped after {waited:.1f} s"
    assert 9999 not in versions


@pytest.mark.parametrize("request_, field, words", [
    (job("a", team="nobody"), "team", "has no quota"),
    (job("a", gpus=9), "num_gpus", "at most 8"),
    (job("a", gpus=8, topology="machine"), "num_gpus", "largest has 4"),
    (job("a", gpu_type="A100"), "gpu_type", "GPU type A100"),
    (job("a", cluster="c9"), "cluster", "unknown cluster 'c9'"),
])
def test_a_job_the_fleet_or_quota_cannot_take_is_refused_naming_the_field(store_env, request_, field, words):
    run, store = store_env
    verdict = run(store.admit(request_))
    assert not verdict.accepted and verdict.field == field and words in verdict.reason
    assert run(store.job_view("a")) is None


def test_a_team_at_its_queue_cap_is_refused_and_nothing_accepted_is_lost(store_env):
    run, store = store_env
    for name in "abc":
        assert run(store.admit(job(name))).accepted
    verdict = run(store.admit(job("d")))
    assert not verdict.accepted and "queue cap" in verdict.reason
    assert [v.job_id for v in run(store.list_jobs(team="vision"))] == ["a", "b", "c"]


def test_admitting_the_same_job_twice_keeps_one_job(store_env):
    run, store = store_env
    assert run(store.admit(job("a"))).accepted
    assert run(store.admit(job("a"))).accepted
    assert len(run(store.list_jobs())) == 1


def test_an_admission_does_not_wait_for_the_cycle_that_holds_its_cluster(store_env):
    """A job's row refers to its cluster's: the cycle's lock on that row kept every admission
    (and a new machine's first heartbeat) waiting for the whole cycle, and made a third party
    of deadlocks between the cycle and an attempt's end."""
    run, store = store_env

    async def during_a_cycle():
        async with store.pool.acquire() as cycle, cycle.transaction(isolation="repeatable_read"):
            await cycle.fetchrow(q.LOCK_CLUSTER, "c1")
            return await asyncio.wait_for(store.admit(job("a")), 5)

    assert run(during_a_cycle()).accepted


def test_two_admissions_of_one_job_at_once_both_accept_it_even_at_the_last_queue_slot(store_env):
    """An admission activity retried while its first try still runs (a database stall past its
    timeout): the second must find the job admitted, not count it against the queue cap."""
    run, store = store_env
    for name in "ab":
        assert run(store.admit(job(name))).accepted  # one slot of the cap of 3 left

    async def twice():
        return await asyncio.gather(*(store.admit(job("c")) for _ in range(6)))

    verdicts = run(twice())
    assert all(v.accepted for v in verdicts), [v.reason for v in verdicts]
    assert [v.job_id for v in run(store.list_jobs(team="vision"))] == ["a", "b", "c"]


def test_a_team_of_the_default_quota_cannot_pass_its_queue_cap_by_submitting_at_once(store_env):
    run, store = store_env
    run(store.set_quota("*", Quota(guaranteed=0, max=8, queue_cap=2)))

    async def at_once():
        return await asyncio.gather(*(store.admit(job(f"n{i}", team="newcomers")) for i in range(8)))

    accepted = [v for v in run(at_once()) if v.accepted]
    assert len(accepted) == 2 and len(run(store.list_jobs(team="newcomers"))) == 2


def test_a_cycle_commits_placements_and_a_repeated_or_stale_cycle_changes_nothing(store_env):
    run, store = store_env
    run(store.admit(job("a")))
    first = run(store.plan_cycle("c1", 1, run_cycle))
    assert first.committed and [p.job_id for p in first.placements] == ["a"]
    run(store.admit(job("b")))
    repeated = run(store.plan_cycle("c1", 1, run_cycle))
    stale = run(store.plan_cycle("c1", 0, run_cycle))
    assert not repeated.committed and not stale.committed
    assert run(store.job_view("b")).state == "queued"
    assert run(store.plan_cycle("c1", 2, run_cycle)).committed
    assert run(store.job_view("b")).state == "placed"


def test_the_database_refuses_a_second_live_hold_of_a_gpu_whatever_the_planner_says(store_env):
    run, store = store_env
    run(store.admit(job("a")))
    run(store.admit(job("b")))
    same_gpus = (("c1/b0/r0/m0", 0), ("c1/b0/r0/m0", 1))

    def greedy(snapshot) -> CycleResult:  # a broken planner: both jobs on the same GPUs
        return CycleResult(placements=tuple(Placement(job_id=j.spec.job_id, gpus=same_gpus, reason="bug")
                                            for j in snapshot.queue))

    outcome = run(store.plan_cycle("c1", 1, greedy))
    # Refused by the exclusion constraint; the cycle still commits, without its placements, so
    # that a planner that keeps making the mistake cannot stop every later cycle.
    assert outcome.committed and outcome.placements == []
    assert run(store.pool.fetchval("SELECT count(*) FROM allocations")) == 0
    assert [v.state for v in run(store.list_jobs())] == ["queued", "queued"]
    assert run(store.pool.fetchval("SELECT cycle_seq FROM clusters WHERE name = 'c1'")) == 1


def test_a_placement_onto_a_held_gpu_is_dropped_and_the_rest_of_the_cycle_commits(store_env):
    run, store = store_env
    run(store.admit(job("a")))
    run(store.plan_cycle("c1", 1, run_cycle))  # a holds two GPUs of one machine
    held = run(store.pool.fetchval("SELECT gpus FROM allocations WHERE job_id = 'a'"))[0]
    machine, gpu = held.rsplit("/", 1)
    other = next(m.id for m in machines() if m.id != machine)
    run(store.admit(job("b")))
    run(store.admit(job("c")))

    def half_wrong(snapshot) -> CycleResult:
        return CycleResult(placements=(
            Placement(job_id="b", gpus=((machine, int(gpu)), (other, 3)), reason="bug"),
            Placement(job_id="c", gpus=((other, 0), (other, 1)), reason="fine")))

    outcome = run(store.plan_cycle("c1", 2, half_wrong))
    assert outcome.committed and [p.job_id for p in outcome.placements] == ["c"]
    assert {v.job_id: v.state for v in run(store.list_jobs())} == {"a": "placed", "b": "queued", "c": "placed"}


def test_a_gang_that_lost_a_machine_keeps_its_other_gpus_until_its_attempt_ends(store_env):
    run, store = store_env
    run(store.admit(job("gang", gpus=8)))  # both machines of the fixture's fleet
    alloc = run(store.plan_cycle("c1", 1, run_cycle)).placements[0].signal.allocation_id
    run(store.start_attempt("gang", alloc))
    run(store.admit(job("next", gpus=4)))
    run(store.configure_cluster("c1", machine_timeout=0.5))
    run(asyncio.sleep(0.7))
    run(store.machine_heartbeat("c1/b0/r0/m0", 1, [GpuReport(index=i) for i in range(4)]))  # m1 is silent
    second = run(store.plan_cycle("c1", 2, run_cycle))  # committed, where it used to fail every time
    assert second.committed and second.placements == []
    assert [p.job_id for p in second.preemptions] == ["gang"]
    run(store.machine_heartbeat("c1/b0/r0/m0", 1, [GpuReport(index=i) for i in range(4)]))
    assert run(store.plan_cycle("c1", 3, run_cycle)).committed  # m1 still silent, the gang still draining
    # Ordered once: before, each cycle of its grace audited the order again (every 2 s).
    assert [e["event"] for e in run(store.audit_trail("gang"))].count("preempt_ordered") == 1
    run(store.end_attempt("gang", alloc, EndReason.machine_failure, None, JobState.queued, "requeued: m1"))
    third = run(store.plan_cycle("c1", 4, run_cycle))
    assert [p.job_id for p in third.placements] == ["next"]


def test_an_attempt_is_acknowledged_once_and_its_end_frees_the_gpus_for_the_next_cycle(store_env):
    run, store = store_env
    run(store.admit(job("a", gpus=4)))
    run(store.admit(job("b", gpus=4)))
    run(store.admit(job("c", gpus=4)))
    placed = run(store.plan_cycle("c1", 1, run_cycle)).placements
    assert sorted(p.job_id for p in placed) == ["a", "b"]
    alloc = next(p.signal.allocation_id for p in placed if p.job_id == "a")
    assert run(store.start_attempt("a", alloc)) == (True, None)
    assert run(store.start_attempt("a", alloc)) == (True, None)  # the same acknowledgement again
    assert run(store.start_attempt("b", alloc)) == (False, None)  # not b's allocation
    run(store.end_attempt("a", alloc, EndReason.completed, 0, JobState.succeeded, "completed"))
    run(store.end_attempt("a", alloc, EndReason.completed, 0, JobState.succeeded, "completed"))
    view = run(store.job_view("a"))
    assert view.state == "succeeded" and view.exit_code == 0 and view.attempts[0].end_reason == "completed"
    assert [p.job_id for p in run(store.plan_cycle("c1", 2, run_cycle)).placements] == ["c"]


def test_unacknowledged_placements_are_sent_again_in_later_cycles(store_env):
    run, store = store_env
    run(store.admit(job("a")))
    first = run(store.plan_cycle("c1", 1, run_cycle))
    run(store.pool.execute("UPDATE allocations SET placed_at = placed_at - 10, order_sent_at = order_sent_at - 10"))
    again = run(store.plan_cycle("c1", 2, run_cycle))
    assert [p.signal.allocation_id for p in again.placements] == [first.placements[0].signal.allocation_id]
    # Each sending says why the job was placed there, as the job's history in Temporal shows it.
    for sent in (first, again):
        assert sent.placements[0].signal.reason.startswith("2 GPU(s) free: c1/b0/r0/m"), sent.placements[0].signal


def test_a_cycle_answers_with_at_most_a_payload_s_worth_of_orders_and_the_rest_follow(store_env, monkeypatch):
    """Temporal refuses an activity result over 2 MiB: a cycle of ~5,000 placements was
    committed and recorded as sent, refused on upload, and rebuilt whole at every resend, so its
    jobs stayed placed and their GPUs held for good (a helper's run on a real server). Each
    answer now holds what fits, stops first; the rest are not recorded as sent, and follow."""
    from activities import store as store_module

    run, store = store_env
    for name in ("a", "b", "c"):  # the team's queue cap
        assert run(store.admit(job(name, gpus=1))).accepted
    monkeypatch.setattr(store_module, "ORDERS_BYTES_MAX", 1)  # one order an answer
    first = run(store.plan_cycle("c1", 1, run_cycle))
    assert first.committed and len(first.placements) == 1
    unsent = run(store.pool.fetchval("SELECT count(*) FROM allocations WHERE state = 'placed' AND orders_sent = 0"))
    assert unsent == 2
    answered, seq = [first.placements[0].signal.allocation_id], 1
    while len(answered) < 3 and seq < 12:
        run(store.pool.execute("UPDATE allocations SET placed_at = placed_at - 10 WHERE orders_sent = 0"))
        seq += 1
        answered += [p.signal.allocation_id for p in run(store.plan_cycle("c1", seq, run_cycle)).placements]
    assert sorted(answered) == sorted(set(answered)) and len(answered) == 3


def test_a_cycle_with_room_for_fewer_orders_than_it_has_sends_the_stops_first(store_env, monkeypatch):
    from activities import store as store_module

    run, store = store_env
    alloc = started(run, store)  # a runs: its victim's grace is what the stop order spends
    run(store.admit(job("b", gpus=1)))
    monkeypatch.setattr(store_module, "ORDERS_BYTES_MAX", 1)
    answer = run(store.plan_cycle("c1", 2, stop("a")))
    assert [p.signal.allocation_id for p in answer.preemptions] == [alloc] and answer.placements == []


@pytest.mark.parametrize("sent, ago, again", [
    (1, 2.0, False), (1, 4.0, True),  # after the first send: 3 s
    (3, 11.0, False), (3, 13.0, True),  # then twice as long each time: 12 s after the third
    (12, 55.0, False), (12, 65.0, True),  # and never more than a minute apart
])
def test_a_stop_not_acted_on_is_sent_again_less_and_less_often(store_env, sent, ago, again):
    """A stop is acted on only when its attempt ends, a grace period or more later: sent every
    cycle it would spend its job workflow's signal and history limits on copies."""
    run, store = store_env
    alloc = started(run, store)
    run(store.plan_cycle("c1", 2, stop("a")))
    run(store.pool.execute("UPDATE allocations SET orders_sent = $2, order_sent_at = "
                           "extract(epoch from now()) - $3, preempt_ordered_at = preempt_ordered_at - 100 "
                           "WHERE id = $1", alloc, sent, ago))
    resent = run(store.plan_cycle("c1", 3, run_cycle)).preemptions
    assert [p.signal.allocation_id for p in resent] == ([alloc] if again else [])


def test_a_requeued_job_goes_back_to_the_queue_with_its_preemption_counted(store_env):
    run, store = store_env
    alloc = started(run, store)
    run(store.end_attempt("a", alloc, EndReason.preempted, None, JobState.queued, "preempted: for b"))
    row = run(store.pool.fetchrow("SELECT state, preemptions FROM jobs WHERE id = 'a'"))
    assert row["state"] == "queued" and len(row["preemptions"]) == 1
    second = run(store.plan_cycle("c1", 2, run_cycle)).placements
    assert second[0].signal.attempt == 2


@pytest.mark.parametrize("backoff, failures, held", [
    (60, 1, 0),  # its machine died: another one will do, at once
    (60, 2, 60),
    (60, 3, 120),
    (60, 4, 240),
    (60, 40, HELD_BACK_MAX),  # never longer than an hour
    (0, 4, 0),  # the cluster turned it off
], ids=["a first failure is not held back", "a second is held back the cluster's backoff",
        "a third twice that", "a fourth four times", "never longer than the cap", "a backoff of 0 holds none"])
def test_a_job_queued_again_after_failures_in_a_row_is_held_back_longer_each_time(backoff, failures, held):
    assert held_back(backoff, failures) == held


def test_a_queued_job_says_whether_it_misses_its_deadline_hint_and_how_often_it_was_preempted(store_env):
    """The cycle wrote whether each queued job misses its deadline, but no view showed it."""
    run, store = store_env
    run(store.set_quota("vision", Quota(guaranteed=4, max=8, queue_cap=None)))
    run(store.admit(job("a", gpus=4)))
    run(store.admit(job("b", gpus=4)))
    assert sorted(p.job_id for p in run(store.plan_cycle("c1", 1, run_cycle)).placements) == ["a", "b"]
    soon, late = time.time() + 60, time.time() + 10 * 86400
    run(store.admit(job("c", gpus=4, deadline=soon, expected_duration=3600)))
    assert run(store.admit(job("d", gpus=4, deadline=late, expected_duration=3600))).accepted
    assert run(store.plan_cycle("c1", 2, run_cycle)).placements == []
    run(store.pool.execute("UPDATE jobs SET preemptions = ARRAY[1.0, 2.0] WHERE id = 'c'"))
    c, d, a = (run(store.job_view(j)) for j in "cda")
    assert (c.misses_deadline, d.misses_deadline, a.misses_deadline) == (True, False, None)
    assert datetime.fromisoformat(c.deadline).timestamp() == pytest.approx(soon, abs=0.001) and a.deadline is None
    assert (c.preemptions, d.preemptions) == (2, 0)


def test_an_attempt_told_to_stop_says_why_and_when_its_grace_ends_until_it_has_ended(store_env):
    """Before, a job checkpointing for its second preemption showed only why it was requeued the
    first time, and a first preemption nothing at all."""
    run, store = store_env
    run(store.configure_cluster("c1", policy={"min_runtime": 0}))
    run(store.admit(job("a", gpus=4, priority="low")))
    run(store.admit(job("b", gpus=4, priority="low")))
    for p in run(store.plan_cycle("c1", 1, run_cycle)).placements:
        run(store.start_attempt(p.job_id, p.signal.allocation_id))
    run(store.set_quota("speech", Quota(guaranteed=4, max=8)))
    run(store.admit(job("c", gpus=4, priority="critical", team="speech")))
    [stop] = run(store.plan_cycle("c1", 2, run_cycle)).preemptions
    [attempt] = run(store.job_view(stop.job_id)).attempts
    assert attempt.stopping == stop.signal.reason and "critical job c" in attempt.stopping
    assert datetime.fromisoformat(attempt.stop_by).timestamp() > time.time() + 60
    run(store.end_attempt(stop.job_id, stop.signal.allocation_id, EndReason.preempted, None, JobState.queued,
                          "requeued: preempted"))
    [attempt] = run(store.job_view(stop.job_id)).attempts
    assert (attempt.stopping, attempt.stop_by) == (None, None)


def test_an_attempt_its_cancel_stops_says_so_and_is_not_displaced_while_it_checkpoints(store_env):
    """A running job being cancelled showed `running` through its grace, with nothing said, and
    the cycle displaced it for a claimant; then, once it showed, the claimant displaced `b`
    instead, whose GPUs come back no sooner."""
    run, store = store_env
    run(store.configure_cluster("c1", policy={"min_runtime": 0}))
    run(store.admit(job("a", gpus=4, priority="low")))
    run(store.admit(job("b", gpus=4, priority="normal")))
    placed = {p.job_id: p for p in run(store.plan_cycle("c1", 1, run_cycle)).placements}
    for job_id, placement in placed.items():
        run(store.start_attempt(job_id, placement.signal.allocation_id))
    p = placed["a"]
    assert run(store.mark_stopping(p.signal.allocation_id, 120.0, "cancelled by request"))
    assert not run(store.mark_stopping(p.signal.allocation_id, 5.0, "again"))  # the first grace stands
    [attempt] = run(store.job_view("a")).attempts
    assert attempt.stopping == "cancelled by request"
    assert time.time() + 100 < datetime.fromisoformat(attempt.stop_by).timestamp() < time.time() + 121
    run(store.set_quota("speech", Quota(guaranteed=4, max=8)))
    run(store.admit(job("c", gpus=4, priority="critical", team="speech")))
    outcome = run(store.plan_cycle("c1", 2, run_cycle))
    assert outcome.preemptions == [] and outcome.placements == []
    assert run(store.job_view("c")).pending_reason.startswith("enough GPUs are expected to free up")
    run(store.end_attempt("a", p.signal.allocation_id, EndReason.cancelled, None, JobState.cancelled,
                          "cancelled by request"))
    [attempt] = run(store.job_view("a")).attempts
    assert (attempt.stopping, attempt.stop_by) == (None, None)
    assert not run(store.mark_stopping(p.signal.allocation_id, 120.0, "too late"))


def test_a_held_back_job_stays_out_of_the_queue_until_its_hold_ends_and_says_why(store_env):
    """Exit 75 or a dead agent twice in a row: placed again at once, it would spend its five
    failures within seconds of a passing outage."""
    run, store = store_env
    run(store.configure_cluster("c1", policy={"retry_backoff": 30}))
    alloc = started(run, store)
    run(store.end_attempt("a", alloc, EndReason.machine_failure, 75, JobState.queued,
                          "requeued: the command could not run for now (exit code 75)", failures_in_a_row=3))
    row = run(store.pool.fetchrow(f"SELECT held_until - {NOW_SQL} AS left, pending_reason FROM jobs WHERE id = 'a'"))
    assert 50 < row["left"] <= 60  # 30 s doubled once, for the third failure in a row (read a moment later)
    assert "held back after 3 infrastructure failures in a row" in row["pending_reason"]
    assert "placed again 60 s after it was queued" in row["pending_reason"]
    view = run(store.job_view("a"))
    assert view.state == "queued" and view.pending_reason == row["pending_reason"]
    assert view.position is None and view.estimated_start is not None  # the hold's end: the earliest it starts
    assert [j.spec.job_id for j in run(store.snapshot("c1")).queue] == []
    assert run(store.plan_cycle("c1", 2, run_cycle)).placements == []
    run(store.pool.execute("UPDATE jobs SET held_until = held_until - 60 WHERE id = 'a'"))  # its hold has passed
    placed = run(store.plan_cycle("c1", 3, run_cycle)).placements
    assert [p.job_id for p in placed] == ["a"] and placed[0].signal.attempt == 2


def test_a_job_queued_again_after_a_first_failure_or_a_preemption_is_not_held_back(store_env):
    run, store = store_env
    alloc = started(run, store)
    run(store.end_attempt("a", alloc, EndReason.machine_failure, None, JobState.queued,
                          "requeued: its machine's agent stopped heartbeating", failures_in_a_row=1))
    alloc = run(store.plan_cycle("c1", 2, run_cycle)).placements[0].signal.allocation_id
    run(store.start_attempt("a", alloc))
    run(store.end_attempt("a", alloc, EndReason.preempted, None, JobState.queued, "preempted: for b"))
    row = run(store.pool.fetchrow("SELECT held_until, pending_reason FROM jobs WHERE id = 'a'"))
    assert row["held_until"] is None and row["pending_reason"] is None
    assert [p.job_id for p in run(store.plan_cycle("c1", 3, run_cycle)).placements] == ["a"]


def test_policy_changes_sent_at_once_all_stand_and_a_bad_one_changes_nothing(store_env):
    """`gpusched cluster set` read the overrides, merged its own and wrote the whole: of two
    operators' changes at once, one was silently lost."""
    run, store = store_env
    knobs = [{"grace_period": 31.0}, {"min_runtime": 901.0}, {"retry_backoff": 7.0}, {"grace_period": 32.0}]

    async def at_once():
        return await asyncio.gather(*(store.set_cluster_policy("c1", k) for k in knobs))

    run(at_once())
    [cluster] = run(store.clusters())
    assert cluster["policy"] in ({"grace_period": g, "min_runtime": 901.0, "retry_backoff": 7.0} for g in (31.0, 32.0))
    with pytest.raises(ValidationError):
        run(store.set_cluster_policy("c1", {"min_runtime": -1}))
    assert run(store.clusters())[0]["policy"] == cluster["policy"]
    assert run(store.set_cluster_policy("c9", {"min_runtime": 5.0})) is None


def test_the_snapshot_expects_the_restart_time_resumed_jobs_reported_unless_the_cluster_sets_one(store_env):
    run, store = store_env
    run(store.admit(job("a")))
    run(store.admit(job("b")))
    fresh, resumed = (p.signal.allocation_id for p in
                      sorted(run(store.plan_cycle("c1", 1, run_cycle)).placements, key=lambda p: p.job_id))
    run(store.pool.execute("UPDATE allocations SET resumed_from = 1 WHERE id = $1", resumed))
    assert run(store.snapshot("c1")).config.expected_restart_s == 0  # nothing measured yet
    assert not run(store.record_restart("a", fresh, 5.0))  # a fresh start does not restart
    assert not run(store.record_restart("a", resumed, 12.5))  # not a's allocation
    assert run(store.record_restart("b", resumed, 12.5))
    assert not run(store.record_restart("b", resumed, 99.0))  # the first report counts
    assert run(store.job_view("b")).attempts[0].restart_s == 12.5
    assert run(store.snapshot("c1")).config.expected_restart_s == 12.5
    run(store.configure_cluster("c1", policy={"expected_restart_s": 60}))
    assert run(store.snapshot("c1")).config.expected_restart_s == 60


def test_a_restart_time_longer_than_its_attempt_has_run_is_kept_as_that_long(store_env):
    """The time comes from the job's own process: a job that said a day would move its cluster's
    learned restart time, and every estimate there, by a day."""
    run, store = store_env
    run(store.admit(job("b")))
    alloc = run(store.plan_cycle("c1", 1, run_cycle)).placements[0].signal.allocation_id
    run(store.pool.execute("UPDATE allocations SET resumed_from = 1 WHERE id = $1", alloc))
    run(store.start_attempt("b", alloc))
    assert run(store.record_restart("b", alloc, 86399.0))
    assert 0 <= run(store.job_view("b")).attempts[0].restart_s < 60


def test_a_stored_policy_override_out_of_todays_bounds_takes_its_default_and_the_cycle_still_runs(store_env, caplog):
    """An older release let `cluster set` store checkpoint_slot=1e-300; a cycle must not fail on it."""
    run, store = store_env
    run(store.configure_cluster("c1", policy={"checkpoint_slot": 1e-300, "grace_period": 30}))
    config = run(store.snapshot("c1")).config
    assert (config.checkpoint_slot, config.grace_period) == (PolicyConfig().checkpoint_slot, 30)
    assert "ignoring checkpoint_slot=1e-300" in caplog.text


@pytest.mark.parametrize("request_, field, words", [
    (job("a", env={"A": "x\0y"}), "env", "NUL"),
    (job("a", command=["echo", "a\0b"]), "command", "NUL"),
    (job("a", team="vi\0sion"), "team", "NUL"),
    (job("a", gpu_type="H1\0"), "gpu_type", "NUL"),
    (job("a", cluster="c\0"), "cluster", "NUL"),
    (job("a", submit_time=1.7e12), "submit_time", "epoch seconds"),
    (job("a", deadline=-5), "deadline", "epoch seconds"),
    (job("a", command=["echo", "x" * 200_000]), "command", "bytes"),
    (job("a", env={"BIG": "x" * 200_000}), "env", "bytes"),
    (job("a", command=["EPOCHS=3", "python", "train.py"]), "command", "a variable's assignment, not a program"),
], ids=["an environment value with a NUL", "a command word with a NUL", "a team with a NUL",
        "a GPU type with a NUL", "a cluster with a NUL", "a submit time in milliseconds",
        "a negative deadline", "a command of 200 kB", "an environment of 200 kB",
        "a command that starts with a variable, which no process runs without a shell"])
def test_a_request_the_database_or_a_process_could_not_take_is_refused_at_admission(store_env, request_, field, words):
    run, store = store_env
    verdict = run(store.admit(request_))
    assert (verdict.accepted, verdict.field) == (False, field) and words in verdict.reason


def test_a_submit_time_in_the_future_is_taken_as_now(store_env):
    run, store = store_env
    now = run(store.now())
    assert run(store.admit(job("a", submit_time=now + 10**6))).accepted
    assert run(store.pool.fetchval("SELECT submit_time FROM jobs WHERE id = 'a'")) <= now + 5


def test_a_machine_that_stops_heartbeating_leaves_the_snapshot(store_env):
    run, store = store_env
    run(store.configure_cluster("c1", machine_timeout=0.5))
    run(asyncio.sleep(0.7))
    run(store.machine_heartbeat("c1/b0/r0/m1", 1, [GpuReport(index=i) for i in range(4)]))
    snap = run(store.snapshot("c1"))
    assert {m.id: m.reachable for m in snap.machines} == {"c1/b0/r0/m0": False, "c1/b0/r0/m1": True}


def test_a_job_on_a_machine_that_stopped_heartbeating_is_stopped_with_no_grace(store_env):
    """No machine is there to checkpoint on: a grace would only keep its other GPUs idle."""
    run, store = store_env
    run(store.admit(job("gang", gpus=8)))
    alloc = run(store.plan_cycle("c1", 1, run_cycle)).placements[0].signal.allocation_id
    run(store.start_attempt("gang", alloc))
    run(store.configure_cluster("c1", machine_timeout=0.5))
    run(asyncio.sleep(0.7))
    run(store.machine_heartbeat("c1/b0/r0/m0", 1, [GpuReport(index=i) for i in range(4)]))  # m1 is silent
    [stop] = run(store.plan_cycle("c1", 2, run_cycle)).preemptions
    assert (stop.job_id, stop.signal.grace_period, stop.signal.end_reason.value) == ("gang", 0.0, "machine_failure")


@pytest.mark.parametrize("end, quiet_for, takes_work", [
    (EndReason.machine_failure, 10, False),
    (EndReason.not_started, 40, False),
    (EndReason.machine_failure, 0, True),
    (EndReason.preempted, 10, True),
    (EndReason.failed, 10, True),
], ids=["an attempt lost with its quiet agent leaves its machine taking no work",
        "an attempt its quiet agent never picked up leaves its machine taking no work",
        "an attempt lost on a machine whose agent was heard just now (a GPU failing, a gang's other machine) does not",
        "a preempted attempt does not",
        "a failed command does not"])
def test_a_machine_whose_agent_owes_an_answer_takes_no_work_until_it_heartbeats(store_env, end, quiet_for, takes_work):
    run, store = store_env
    alloc = started(run, store, gpus=4)
    [machine] = {g.rsplit("/", 1)[0] for g in run(store.job_view("a")).attempts[0].gpus}
    run(store.pool.execute("UPDATE machines SET last_heartbeat = last_heartbeat - $1", float(quiet_for)))
    run(store.end_attempt("a", alloc, end, None, JobState.queued, f"requeued: {end.value}"))
    by_id = {m.id: m for m in run(store.snapshot("c1")).machines}
    assert by_id[machine].reachable and by_id[machine].takes_work is takes_work
    assert all(m.takes_work for i, m in by_id.items() if i != machine)
    [again] = run(store.plan_cycle("c1", 2, run_cycle)).placements
    if not takes_work:
        assert [h.machine_id for h in again.signal.hosts] != [machine], "placed back where nobody answers"
    run(store.machine_heartbeat(machine, 1, [GpuReport(index=i) for i in range(4)]))
    run(store.pool.execute("UPDATE machines SET unpicked_until = NULL"))  # not_started's cool-down: below
    assert all(m.takes_work for m in run(store.snapshot("c1")).machines)


def _takes_work(run, store) -> dict[str, bool]:
    return {m.id: m.takes_work for m in run(store.snapshot("c1")).machines}


@pytest.mark.parametrize("named", [True, False], ids=["the machine the workflow names is held out",
                                                      "no machine when none is named (a placement nobody took up)"])
def test_a_machine_whose_agent_heartbeats_but_picked_an_attempt_up_not_takes_no_work_for_a_while(store_env, named):
    """Its worker does not poll (another task queue, no way to Temporal): its heartbeats say
    nothing of that, so they do not end the cool-down."""
    run, store = store_env
    alloc = started(run, store, gpus=4)
    [machine] = {g.rsplit("/", 1)[0] for g in run(store.job_view("a")).attempts[0].gpus}
    run(store.end_attempt("a", alloc, EndReason.not_started, None, JobState.queued, "requeued: not picked up",
                          machine if named else None))
    run(store.machine_heartbeat(machine, 1, [GpuReport(index=i) for i in range(4)]))
    assert _takes_work(run, store) == {m.id: m.id != machine or not named for m in machines()}
    run(store.pool.execute("UPDATE machines SET unpicked_until = unpicked_until - $1", UNPICKED_COOL_DOWN))
    assert all(_takes_work(run, store).values())


def test_an_attempt_not_picked_up_by_an_agent_that_said_it_takes_no_work_leaves_no_cool_down(store_env):
    """Placed just before its agent began shutting down: once the agent is back and says it
    takes work, the job may go there again at once."""
    run, store = store_env
    alloc = started(run, store, gpus=4)
    [machine] = {g.rsplit("/", 1)[0] for g in run(store.job_view("a")).attempts[0].gpus}
    run(store.machine_heartbeat(machine, 1, [GpuReport(index=i) for i in range(4)], accepting_work=False))
    run(store.end_attempt("a", alloc, EndReason.not_started, None, JobState.queued, "requeued: not picked up",
                          machine))
    assert _takes_work(run, store)[machine] is False
    run(store.machine_heartbeat(machine, 2, [GpuReport(index=i) for i in range(4)]))
    assert all(_takes_work(run, store).values())


def test_a_machine_whose_agent_says_it_takes_no_work_is_given_none(store_env):
    run, store = store_env
    m0, m1 = (m.id for m in machines())
    run(store.machine_heartbeat(m0, 1, [GpuReport(index=i) for i in range(4)], accepting_work=False))
    assert _takes_work(run, store) == {m0: False, m1: True}
    run(store.admit(job("a", gpus=4)))
    [placed] = run(store.plan_cycle("c1", 1, run_cycle)).placements
    assert [h.machine_id for h in placed.signal.hosts] == [m1]
    run(store.machine_heartbeat(m0, 1, [GpuReport(index=i) for i in range(4)]))  # an agent from before: it does
    assert _takes_work(run, store) == {m0: True, m1: True}


def test_a_gpu_reported_unhealthy_is_marked_alone(store_env):
    run, store = store_env
    reports = [GpuReport(index=i, healthy=i != 2, faults=["ecc_uncorrectable"] if i == 2 else []) for i in range(4)]
    run(store.machine_heartbeat("c1/b0/r0/m0", 1, reports))
    snap = run(store.snapshot("c1"))
    assert {m.id: set(m.unhealthy_gpus) for m in snap.machines} == {"c1/b0/r0/m0": {2}, "c1/b0/r0/m1": set()}


def test_a_known_machine_that_reports_fewer_or_more_gpus_has_its_inventory_follow(store_env):
    run, store = store_env
    run(store.machine_heartbeat("c1/b0/r0/m0", 1, [GpuReport(index=i) for i in (0, 1, 3)]))  # GPU 2 is gone
    run(store.machine_heartbeat("c1/b0/r0/m1", 1, [GpuReport(index=i) for i in range(6)]))  # two more
    by_id = {m.id: m for m in run(store.snapshot("c1")).machines}
    assert (by_id["c1/b0/r0/m0"].gpus, set(by_id["c1/b0/r0/m0"].unhealthy_gpus)) == (4, {2})
    assert (by_id["c1/b0/r0/m1"].gpus, set(by_id["c1/b0/r0/m1"].unhealthy_gpus)) == (6, set())
    run(store.machine_heartbeat("c1/b0/r0/m0", 1, [GpuReport(index=i) for i in range(4)]))  # it is back
    assert not run(store.snapshot("c1")).machines[0].unhealthy_gpus


def test_an_unknown_machine_joins_the_fleet_by_heartbeat(store_env):
    run, store = store_env
    run(store.machine_heartbeat("c1/b1/r0/m0", 1, [GpuReport(index=i, gpu_type="H200") for i in range(8)]))
    snap = run(store.snapshot("c1"))
    joined = next(m for m in snap.machines if m.id == "c1/b1/r0/m0")
    assert (joined.block, joined.gpus, joined.gpu_type) == ("b1", 8, "H200")


H100 = dict(gpu_type="H100", memory_gb=80.0)
UNREAD = dict(gpu_type="unknown", memory_gb=0.0)  # what the agent reports of a GPU NVML could not open


JOINING_TYPES = [
    ("GPU 0 unreadable as its agent started", [UNREAD] + [H100] * 7, "H100", 80.0),
    ("two types: the most GPUs'", [dict(gpu_type="A100", memory_gb=40.0)] * 3 + [H100] * 5, "H100", 80.0),
    ("two types as many: the lowest index's", [dict(gpu_type="A100", memory_gb=40.0)] * 4 + [H100] * 4, "A100", 40.0),
    ("no GPU named", [UNREAD] * 8, "unknown", 80.0),
]


@pytest.mark.parametrize("name, reported, gpu_type, memory_gb", JOINING_TYPES, ids=[row[0] for row in JOINING_TYPES])
def test_a_machine_joins_as_the_type_most_of_its_gpus_report(store_env, name, reported, gpu_type, memory_gb):
    """Before, a machine took GPU 0's type: one whose GPU 0 NVML could not open joined as
    "unknown" for good, and no job asks for that type."""
    run, store = store_env
    run(store.machine_heartbeat("c1/b1/r0/m0", 1, [GpuReport(index=i, **g) for i, g in enumerate(reported)]))
    joined = next(m for m in run(store.snapshot("c1")).machines if m.id == "c1/b1/r0/m0")
    assert (joined.gpu_type, joined.gpu_memory_gb) == (gpu_type, memory_gb)


def test_a_machine_that_joined_with_no_gpu_named_takes_the_type_its_agent_reports_later(store_env):
    run, store = store_env
    machine = "c1/b1/r0/m0"
    run(store.machine_heartbeat(machine, 1, [GpuReport(index=i, **UNREAD) for i in range(8)]))
    run(store.machine_heartbeat(machine, 2, [GpuReport(index=i, **H100) for i in range(8)]))  # its agent again
    joined = next(m for m in run(store.snapshot("c1")).machines if m.id == machine)
    assert (joined.gpu_type, joined.gpu_memory_gb) == ("H100", 80.0)
    run(store.machine_heartbeat(machine, 2, [GpuReport(index=i, gpu_type="A100", memory_gb=40.0) for i in range(8)]))
    named = next(m for m in run(store.snapshot("c1")).machines if m.id == machine)
    assert named.gpu_type == "H100"  # a type once known is kept: a fleet file changes it, not a heartbeat


@pytest.mark.parametrize("reported, count, missing", [
    ((0, 1, 2, 3, 5), 6, {4}),
    ((0, 1, 2, 3, 4, 7), 8, {5, 6}),
    ((2, 3), 4, {0, 1}),
], ids=["one missing", "two missing in a row", "the first ones missing"])
def test_a_machine_that_joins_missing_gpus_has_those_gpus_out_of_use_and_a_cycle_places_on_the_others(
        store_env, reported, count, missing):
    """Before, rows were made for as many GPUs as reported and then for the indices reported:
    two missing in a row left an index without a row, which the scheduler (numbering GPUs 0 to
    the count) placed a job on, and the hold's foreign key failed every cycle of the cluster."""
    run, store = store_env
    machine = "c2/b0/r0/m0"
    run(store.machine_heartbeat(machine, 1, [GpuReport(index=i) for i in reported]))
    joined = next(m for m in run(store.snapshot("c2")).machines if m.id == machine)
    assert joined.gpus == count and set(joined.unhealthy_gpus) == missing
    run(store.admit(job("wide", gpus=len(reported), cluster="c2", topology="machine")))
    [placed] = run(store.plan_cycle("c2", 1, run_cycle)).placements
    assert {g.index for host in placed.signal.hosts for g in host.gpus} == set(reported)


def test_a_machine_joining_by_heartbeat_as_a_fleet_file_declares_it_keeps_the_file_s_partition(store_env):
    """The heartbeat looked before the fleet file's transaction committed, took the machine for
    new, and once it could write, overwrote the file's partition with the default: inference jobs
    never went there, training jobs did, and `fleet apply` had said it was added as inference."""
    run, store = store_env
    new = "c1/b0/r0/m7"

    async def scenario():
        async with store.pool.acquire() as declaring, declaring.transaction():
            await declaring.fetchval(q.DECLARE_MACHINE, new, "c1", "b0", "r0", "H100", 80.0, "inference")
            beat = asyncio.ensure_future(store.machine_heartbeat(new, 1, [GpuReport(index=i) for i in range(4)]))
            await until_blocked_or_done(declaring, beat)
        live = await asyncio.wait_for(beat, 10)
        return live, await store.pool.fetchrow("SELECT partition, last_heartbeat FROM machines WHERE id = $1", new)

    live, machine = run(scenario())
    assert live == [] and machine["partition"] == "inference" and machine["last_heartbeat"] is not None
    assert run(store.pool.fetchval("SELECT count(*) FROM gpus WHERE machine_id = $1", new)) == 4


def fleet_file(*ids: str, gpus: int = 4):
    """A fleet file of cluster c1 declaring the machines `ids` (`gpus` each) in that order (a file
    lists a rack's m9 before its m10, which sorts first)."""
    from scheduler.fleet import ClusterFleet, Fleet
    declared = tuple(Machine(id=i, cluster="c1", block="b0", rack="r0", gpus=gpus, gpu_type="H100") for i in ids)
    return Fleet(clusters=(ClusterFleet(name="c1", machines=declared),),
                 quotas={"vision": Quota(guaranteed=4, max=8, queue_cap=3)})


def test_a_fleet_file_declaring_a_machine_as_its_first_heartbeat_joins_it_does_not_add_it_again(store_env):
    """The declaration's snapshot could not see the heartbeat's join, not yet committed; its
    insert waited for it and updated the row, but the machine was taken for new: reported added,
    and given the file's 8 GPUs where its agent had reported 4 (4 that do not exist, healthy)."""
    run, store = store_env
    new = "c1/b0/r0/m7"

    async def scenario():
        async with store.pool.acquire() as joining:
            async with joining.transaction():
                await joining.execute(q.JOIN_MACHINE, new, "c1", "b0", "r0", "H100", 80.0, "training")
                await joining.execute(q.ADD_REPORTED_GPUS, new, list(range(4)))
                applying = asyncio.ensure_future(store.apply_fleet(fleet_file(new, gpus=8)))
                await until_blocked_or_done(joining, applying)
        return await asyncio.wait_for(applying, 10)

    applied = run(scenario())
    assert applied.added == []
    assert run(store.pool.fetchval("SELECT count(*) FROM gpus WHERE machine_id = $1", new)) == 4


def test_a_fleet_apply_and_the_end_of_an_attempt_across_its_machines_do_not_deadlock(store_env):
    """The end marks the attempt's machines silent in the order its plan reads them; the file's
    declarations took them in the file's order (m1 before m0): each waited for the other, and
    Postgres broke it after a second by failing one. Both now take them in id order."""
    run, store = store_env
    run(store.admit(job("gang", gpus=8)))  # both machines of the fixture's fleet
    alloc = run(store.plan_cycle("c1", 1, run_cycle)).placements[0].signal.allocation_id
    run(store.start_attempt("gang", alloc))
    run(store.machine_heartbeat("c1/b0/r0/m2", 1, [GpuReport(index=i) for i in range(4)]))
    run(store.pool.execute("UPDATE machines SET last_heartbeat = NULL"))  # the gang's agents are silent

    async def waiting() -> int:
        async with store.pool.acquire() as looking:
            return await looking.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                          "AND wait_event_type = 'Lock'")

    async def scenario():
        async with store.pool.acquire() as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM machines WHERE id = 'c1/b0/r0/m2' FOR NO KEY UPDATE")
                applying = asyncio.ensure_future(
                    store.apply_fleet(fleet_file("c1/b0/r0/m1", "c1/b0/r0/m2", "c1/b0/r0/m0")))
                await until_blocked_or_done(holder, applying)
                ending = asyncio.ensure_future(store.end_attempt("gang", alloc, EndReason.machine_failure, None,
                                                                 JobState.queued, "requeued: its machines are silent"))
                for _ in range(100):  # until the end waits too, for a row the file's declarations hold
                    if ending.done() or await waiting() >= 2:
                        break
                    await asyncio.sleep(0.05)
        return await asyncio.wait_for(asyncio.gather(applying, ending, return_exceptions=True), 10)

    applied, ended = run(scenario())
    assert not isinstance(applied, BaseException), applied
    assert not isinstance(ended, BaseException), ended


@pytest.mark.parametrize("name, machine, gpus, words", [
    ("an unknown machine that reports no GPUs does not join", "c1/b1/r0/m0", [], "reports no GPUs"),
    ("a GPU reported twice", "c1/b0/r0/m0", [GpuReport(index=0), GpuReport(index=0)], "GPU 0 more than once"),
    # A blank cluster sorts first and would take the jobs submitted for any cluster.
    ("a blank cluster does not join", " /b0/r0/m9", [GpuReport(index=0)], "its cluster name ' ' is not a name"),
    ("a machine name with a space", "c1/b0/r0/m 9", [GpuReport(index=0)], "its machine name 'm 9' is not a name"),
    ("a control character", "c1/b0/r0/m\u202e9", [GpuReport(index=0)], "its machine name"),
    # Too long for the database's index: it answered with a 500 before.
    ("a name longer than 64 characters", "c1/b0/r0/" + "m" * 3000, [GpuReport(index=0)], "up to 64 printable"),
])
def test_a_heartbeat_that_cannot_be_so_is_refused_and_changes_nothing(store_env, name, machine, gpus, words):
    run, store = store_env
    before = run(store.snapshot("c1")).machines
    with pytest.raises(ValueError, match=words):
        run(store.machine_heartbeat(machine, 1, gpus))
    assert run(store.snapshot("c1")).machines == before
    assert run(store.cluster_names()) == ["c1"]


def test_a_negative_gpu_index_is_no_gpu():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        GpuReport(index=-1)


def test_every_decision_and_state_change_is_audited(store_env):
    run, store = store_env
    alloc = started(run, store)
    run(store.end_attempt("a", alloc, EndReason.failed, 3, JobState.failed, "exit code 3"))
    events = [e["event"] for e in run(store.audit_trail("a"))]
    assert events == ["submitted", "placed", "started", "released", "failed"]


def test_a_job_held_for_its_change_does_not_hold_up_rows_that_only_name_it(store_env):
    """An attempt's end holds its job, then waits for its allocation, which a cycle's commit may
    hold; that commit also writes allocations naming the job, whose key Postgres checks (KEY
    SHARE). Were that check to wait for the held job, the two would deadlock (Postgres breaks it
    after a second, failing one of them: bench/chaos.py saw it)."""
    run, store = store_env
    run(store.admit(job("b", gpus=1)))

    async def scenario():
        async with store.pool.acquire() as holder, holder.transaction():
            await holder.fetchrow(q.JOB_FOR_UPDATE, "b")
            async with store.pool.acquire() as other, other.transaction():
                return await asyncio.wait_for(other.fetchval(
                    q.INSERT_ALLOCATION, "b", "c1", 1, ["c1/b0/r0/m0/0"], 7, None, 0.0, 1.0, "a cycle's placement"), 5)

    assert run(scenario()) is not None


async def ending_as(store, alloc: int, other):
    """An attempt's end, taken as end_attempt takes it (job a's row, then its allocation's),
    while `other` runs: what the end returned, and what `other` returned or raised."""
    async with store.pool.acquire() as ending, ending.transaction():
        await ending.fetchrow(q.JOB_FOR_UPDATE, "a")
        meanwhile = asyncio.ensure_future(other)
        await until_blocked_or_done(ending, meanwhile)  # the other takes what it takes first
        ended = await asyncio.wait_for(ending.fetchval(q.END_ALLOCATION, alloc, "not_started", None), 10)
    return ended, (await asyncio.wait_for(asyncio.gather(meanwhile, return_exceptions=True), 10))[0]


def test_an_attempt_s_start_and_its_end_at_once_do_not_deadlock(store_env):
    """The end holds the job, then ends its allocation; the start used to take the allocation,
    then wait for the job: Postgres broke the deadlock after a second by failing one of them."""
    run, store = store_env
    alloc = placed(run, store)
    ended, (launch, _) = run(ending_as(store, alloc, store.start_attempt("a", alloc)))
    assert ended == "a" and not launch


def test_a_cycle_taking_a_placement_back_as_its_attempt_ends_does_not_deadlock(store_env):
    """An attempt's end (not started, cancelled) holds the job, then ends its allocation; a cycle
    that took the same placement back ended the allocation, then waited for the job: Postgres
    broke the deadlock after a second by failing the cycle. The cycle now waits for the job
    first, and only conflicts with what the end changed (and is run again)."""
    run, store = store_env
    alloc = placed(run, store)
    ended, cycle = run(ending_as(store, alloc, store.plan_cycle("c1", 2, stop("a", planner=lambda s: CycleResult()))))
    assert ended == "a"
    assert isinstance(cycle, CycleConflict) and not isinstance(cycle.__cause__, asyncpg.DeadlockDetectedError), \
        repr(cycle.__cause__ if isinstance(cycle, Exception) else cycle)
    assert run(store.plan_cycle("c1", 2, run_cycle)).committed  # run again, on what the end left


def test_the_snapshot_expects_the_last_days_submissions_again_a_day_later(store_env):
    run, store = store_env
    run(store.admit(job("a", priority="high", expected_duration=1800.0)))
    run(store.admit(job("b", gpus=1, priority="low")))
    snap = run(store.snapshot("c1"))
    got = sorted((a.priority.value, a.num_gpus, a.expected_duration) for a in snap.expected_arrivals)
    assert got == [("high", 2, 1800.0), ("low", 1, 3600.0)]
    assert all(snap.now < a.at <= snap.now + snap.config.forecast_window for a in snap.expected_arrivals)


def test_consecutive_snapshots_hand_back_the_same_models_for_rows_that_did_not_change(store_env):
    run, store = store_env
    run(store.admit(job("a")))
    run(store.admit(job("b", gpus=4)))
    run(store.admit(job("c", gpus=4)))
    alloc = run(store.plan_cycle("c1", 1, run_cycle)).placements[0].signal.allocation_id
    first, second = run(store.snapshot("c1")), run(store.snapshot("c1"))
    assert all(map(lambda x, y: x is y, first.machines, second.machines))
    assert first.running[0] is second.running[0] and first.queue[0] is second.queue[0]

    run(store.start_attempt("a", alloc))  # the allocation row changes: a new model for it alone
    sick = [GpuReport(index=i, healthy=i != 3) for i in range(4)]
    run(store.machine_heartbeat("c1/b0/r0/m1", 1, sick))
    third = run(store.snapshot("c1"))
    assert third.running[0] is not second.running[0] and third.running[1] is second.running[1]
    assert third.queue[0] is second.queue[0]
    by_id = {m.id: m for m in second.machines}
    assert [m is by_id[m.id] for m in third.machines] == [True, False]
    assert third.machines[1].unhealthy_gpus == {3}


# --- late and repeated calls ----------------------------------------------------------------------
# Temporal retries an activity whose answer was lost, and a call that timed out may still commit
# afterwards: none of them may undo what the job has done since.

def stop(job_id: str, planner=run_cycle):
    """A planner that orders `job_id` off its GPUs (as a preemption for job x), then plans as usual."""
    def plan(snapshot) -> CycleResult:
        result = planner(snapshot)
        order = Preemption(job_id=job_id, for_job="x", reason="for x", grace_period=30.0)
        return result.model_copy(update={"preemptions": result.preemptions + (order,)})
    return plan


def test_a_placement_ordered_off_before_its_job_took_it_up_is_taken_back_at_once(store_env):
    run, store = store_env
    run(store.admit(job("a", gpus=4)))
    alloc = run(store.plan_cycle("c1", 1, run_cycle)).placements[0].signal.allocation_id
    before = run(store.pool.fetchrow("SELECT queued_since FROM jobs WHERE id = 'a'"))
    outcome = run(store.plan_cycle("c1", 2, stop("a", planner=lambda s: CycleResult())))
    assert outcome.preemptions == []  # no stop order: nothing runs there to stop
    row = run(store.pool.fetchrow("SELECT state, queued_since, preemptions FROM jobs WHERE id = 'a'"))
    assert (row["state"], row["queued_since"], row["preemptions"]) == ("queued", before["queued_since"], [])
    assert run(store.pool.fetchval("SELECT count(*) FROM gpu_holds WHERE upper_inf(held)")) == 0
    assert run(store.start_attempt("a", alloc)) == (False, None)  # its acknowledgement comes too late
    assert run(store.job_view("a")).state == "queued"
    again = run(store.plan_cycle("c1", 3, run_cycle)).placements
    assert [(p.job_id, p.signal.attempt) for p in again] == [("a", 2)]


def test_an_acknowledgement_repeated_after_a_stop_was_ordered_still_launches_so_the_stop_reaches_it(store_env):
    run, store = store_env
    run(store.admit(job("a", gpus=4)))
    alloc = run(store.plan_cycle("c1", 1, run_cycle)).placements[0].signal.allocation_id
    assert run(store.start_attempt("a", alloc)) == (True, None)  # its answer was lost
    assert [p.job_id for p in run(store.plan_cycle("c1", 2, stop("a"))).preemptions] == ["a"]
    assert run(store.start_attempt("a", alloc)) == (True, None)  # the retry


def test_an_end_repeated_after_the_job_was_placed_again_leaves_the_new_attempt_alone(store_env):
    run, store = store_env
    first = started(run, store, gpus=4)
    run(store.end_attempt("a", first, EndReason.preempted, None, JobState.queued, "preempted: for b"))
    second = run(store.plan_cycle("c1", 2, run_cycle)).placements[0].signal.allocation_id
    run(store.end_attempt("a", first, EndReason.preempted, None, JobState.queued, "preempted: for b"))
    row = run(store.pool.fetchrow("SELECT state, preemptions FROM jobs WHERE id = 'a'"))
    assert row["state"] == "placed" and len(row["preemptions"]) == 1  # counted once, not requeued
    assert run(store.plan_cycle("c1", 3, run_cycle)).committed  # a requeue would break every cycle
    assert run(store.start_attempt("a", second)) == (True, None)


def test_a_late_checkpointing_mark_does_not_hide_a_requeued_job_from_the_queue(store_env):
    run, store = store_env
    alloc = started(run, store, gpus=4)
    assert not run(store.mark_checkpointing("a"))  # running, but not asked to stop
    run(store.plan_cycle("c1", 2, stop("a")))
    assert run(store.mark_checkpointing("a"))
    run(store.end_attempt("a", alloc, EndReason.preempted, None, JobState.queued, "preempted: for x"))
    assert not run(store.mark_checkpointing("a"))  # the call that came late
    assert [j.spec.job_id for j in run(store.snapshot("c1")).queue] == ["a"]


@pytest.mark.parametrize("next_state", [JobState.failed, JobState.queued])
def test_an_attempt_whose_reason_holds_a_nul_still_ends_and_gives_its_gpus_back(store_env, next_state):
    """The reason carries the job's last log lines, which a binary log fills with anything."""
    run, store = store_env
    alloc = started(run, store)
    run(store.end_attempt("a", alloc, EndReason.failed, 1, next_state, "the command failed:\nbin\0ary"))
    view = run(store.job_view("a"))
    assert view.state == next_state.value and "bin\ufffdary" in view.reason
    assert run(store.pool.fetchval("SELECT count(*) FROM gpu_holds WHERE upper_inf(held)")) == 0


def test_the_id_of_a_job_that_has_ended_is_refused_to_a_new_job(store_env):
    run, store = store_env
    alloc = started(run, store)
    run(store.end_attempt("a", alloc, EndReason.completed, 0, JobState.succeeded, "completed"))
    verdict = run(store.admit(job("a")))
    assert not verdict.accepted and verdict.field == "job_id" and "has ended (succeeded)" in verdict.reason


def _row_versions(run, store, sql: str, *args) -> list[str]:
    """The rows' transaction ids of their last write (xmin): a row written again has a new one."""
    return [r[0] for r in run(store.pool.fetch(sql, *args))]


def test_a_heartbeat_writes_only_the_gpus_whose_health_changed(store_env):
    run, store = store_env
    machine = "c1/b0/r0/m0"
    versions = "SELECT xmin::text FROM gpus WHERE machine_id = $1 ORDER BY idx"
    before = _row_versions(run, store, versions, machine)
    run(store.machine_heartbeat(machine, 1, [GpuReport(index=i) for i in range(4)]))
    assert _row_versions(run, store, versions, machine) == before  # the same report: nothing written
    run(store.machine_heartbeat(machine, 1, [GpuReport(index=i, healthy=i != 1, faults=["xid:79"] if i == 1 else [])
                                             for i in range(4)]))
    after = _row_versions(run, store, versions, machine)
    assert [a != b for a, b in zip(after, before)] == [False, True, False, False]
    assert {m.id: set(m.unhealthy_gpus) for m in run(store.snapshot("c1")).machines}[machine] == {1}


def test_a_cycle_writes_only_the_queued_jobs_whose_place_estimate_or_reason_changed(store_env):
    run, store = store_env
    for name in ("a", "b"):
        run(store.admit(job(name, gpus=4)))
    for p in run(store.plan_cycle("c1", 1, run_cycle)).placements:  # the cluster full, vision at its maximum
        run(store.start_attempt(p.job_id, p.signal.allocation_id))
    run(store.admit(job("waits", gpus=2)))
    run(store.plan_cycle("c1", 2, run_cycle))
    versions = "SELECT xmin::text, pending_reason FROM jobs WHERE id = 'waits'"
    before = run(store.pool.fetchrow(versions))
    assert before["pending_reason"]  # the cycle told it why it waits
    assert run(store.plan_cycle("c1", 3, run_cycle)).committed
    assert run(store.pool.fetchrow(versions)) == before  # told the same: not written again


def test_a_cycle_lock_held_by_a_process_gone_quiet_inside_its_transaction_is_released_by_the_server(live_servers):
    """A control worker that hangs or loses its network mid-cycle held its cluster's lock until the
    server's TCP gave up (hours): the server now ends a session idle in its transaction."""
    dsn = live_servers.new_database(f"store_{next(_names)}")

    async def scenario():
        quiet = await Store.connect(dsn, idle_in_transaction=1.0)
        store = await Store.connect(dsn)
        try:
            await store.migrate()
            await store.register_fleet("c1", machines())
            conn = await quiet.pool.acquire()
            tx = conn.transaction()
            await tx.start()
            await conn.fetchrow(q.LOCK_CLUSTER, "c1")  # and then nothing, as a hung process does
            outcome = await asyncio.wait_for(store.plan_cycle("c1", 1, run_cycle), timeout=15)
            with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError)):
                await conn.fetchval("SELECT 1")  # its session was ended
            await quiet.pool.release(conn)
            settings = await store.pool.fetchrow("SELECT current_setting('tcp_keepalives_idle') AS idle, "
                                                 "current_setting('idle_in_transaction_session_timeout') AS quiet")
            return outcome.committed, dict(settings)
        finally:  # not close(): it would wait for ever for the session held in its transaction
            quiet.pool.terminate()
            store.pool.terminate()

    assert asyncio.run(scenario()) == (True, {"idle": "30", "quiet": "5min"})


def test_a_process_whose_statements_a_migration_made_stale_still_admits_starts_and_commits_checkpoints(store_env):
    """A rolling upgrade: the control worker adds a column while the API runs on statements it
    prepared before (`SELECT *`), which Postgres refuses once, inside the transaction."""
    run, store = store_env
    alloc = started(run, store, "a")  # admission, start: their statements prepared
    report = CheckpointReport(seq=1, key="a/1", size=1, sha256="0" * 64, progress=1.0)
    assert run(store.commit_checkpoint("a", alloc, report, None))[0].committed
    for table in ("jobs", "allocations", "checkpoints"):
        run(store.pool.execute(f"ALTER TABLE {table} ADD COLUMN added_by_an_upgrade integer"))
    run(store.admit(job("b")))
    assert run(store.job_view("b")).state == "queued"
    report2 = report.model_copy(update={"seq": 2, "key": "a/2", "progress": 2.0})
    assert run(store.commit_checkpoint("a", alloc, report2, None))[0].committed
    placed_b = run(store.plan_cycle("c1", 2, run_cycle)).placements[0].signal.allocation_id
    assert run(store.start_attempt("b", placed_b))[0]


@pytest.mark.parametrize("team, state", [(None, None), ("vision", None), (None, "queued"), ("vision", "queued")],
                         ids=["every job", "a team's", "those in a state", "a team's in a state"])
def test_listing_the_newest_jobs_reads_them_along_an_index_not_the_whole_table_sorted(store_env, team, state):
    run, store = store_env
    for k in range(3):
        run(store.admit(job(f"j{k}")))
    given = [value for value in (team, state) if value is not None]
    sql = q.LIST_JOBS[team is not None, state is not None]

    async def plan():
        async with store.pool.acquire() as conn, conn.transaction():
            await conn.execute("SET LOCAL enable_seqscan = off")  # a test's table is small enough for either
            return json.loads(await conn.fetchval("EXPLAIN (FORMAT JSON) " + sql, 2, *given))[0]["Plan"]

    def nodes(node):
        yield node
        for child in node.get("Plans", ()):
            yield from nodes(child)

    inner_limit = [n for n in nodes(run(plan())) if n["Node Type"] == "Limit"][0]
    reading = inner_limit["Plans"][0]
    assert reading["Node Type"] in ("Index Scan", "Index Only Scan") and reading["Scan Direction"] == "Backward", \
        reading
    assert [v.job_id for v in run(store.list_jobs(team=team, state=state, limit=2))] == ["j1", "j2"]


@pytest.mark.parametrize("seq, off_inside", [
    pytest.param(1, True, id="a cycle keeps the collector off from its read until its commit is done"),
    pytest.param(0, False, id="a stale cycle, which plans nothing, leaves it alone"),
])
def test_what_a_cycle_owes_the_collector_is_collected_after_its_commit(store_env, monkeypatch, seq, off_inside):
    run, store = store_env
    run(store.admit(job("a")))
    seen = {}

    def planner(snapshot):
        seen["planning"] = gc.isenabled()
        return run_cycle(snapshot)

    commit = Transaction._Transaction__commit

    async def committing(self):  # the outer transaction's COMMIT, not a savepoint's release
        if not self._nested:
            seen["committing"] = gc.isenabled()
        return await commit(self)

    monkeypatch.setattr(Transaction, "_Transaction__commit", committing)
    gc.enable()
    run(store.plan_cycle("c1", seq, planner))
    assert seen == ({"planning": False, "committing": False} if off_inside else {"committing": True})
    assert gc.isenabled()


def test_a_database_clock_stepped_back_does_not_stop_the_cycles_placing(store_env):
    """A hold closes at the database's clock; if that clock then steps back (a VM resumed, NTP
    stepping it), a new hold of the same GPU opened at the earlier clock would overlap the closed
    one, the constraint would refuse it, and every cycle would commit without any placement until
    the clock caught up. A hold opens no earlier than the GPU's last one closed."""
    run, store = store_env
    alloc = started(run, store, "a", gpus=4)
    run(store.end_attempt("a", alloc, EndReason.completed, 0, JobState.succeeded, "completed"))
    # As if the clock had stepped back an hour since: the closed hold ends an hour ahead of it.
    run(store.pool.execute(
        "UPDATE gpu_holds SET held = tstzrange(lower(held), clock_timestamp() + interval '1 hour') "
        "WHERE allocation_id = $1", alloc))
    run(store.admit(job("b", gpus=8)))  # the whole cluster: the GPUs a held among them
    outcome = run(store.plan_cycle("c1", 2, run_cycle))
    assert [p.job_id for p in outcome.placements] == ["b"]
    overlapping = run(store.pool.fetchval(
        "SELECT count(*) FROM gpu_holds x JOIN gpu_holds y ON x.machine_id = y.machine_id AND x.idx = y.idx "
        "AND x.allocation_id < y.allocation_id AND x.held && y.held"))
    assert overlapping == 0


def test_a_quota_changed_while_a_cycle_plans_applies_after_that_cycle_commits(store_env, live_servers):
    """A cycle reads the quotas once (its snapshot) and does not write them: a maximum lowered
    while it planned used to commit under it, and the cycle then placed past the new maximum.
    A change of quota now waits for the cycle in flight (and a cycle that read before it and
    locks after it reads again)."""
    run, store = store_env
    dsn = with_database(live_servers.pg_dsn, run(store.pool.fetchval("SELECT current_database()")))
    for name in ("a", "b"):
        run(store.admit(job(name, gpus=4)))  # vision's maximum (8) takes both
    changed = threading.Event()

    def lower_the_maximum() -> None:
        async def change() -> None:
            other = await Store.connect(dsn, max_size=1)
            try:
                await other.set_quota("vision", Quota(guaranteed=4, max=4, queue_cap=3))
            finally:
                await other.close()
        asyncio.run(change())
        changed.set()

    changer = threading.Thread(target=lower_the_maximum)

    def planner(snapshot):
        changer.start()
        seen["changed while planning"] = changed.wait(3.0)
        return run_cycle(snapshot)

    seen = {}
    outcome = run(store.plan_cycle("c1", 1, planner))
    changer.join(30)
    assert seen == {"changed while planning": False}
    assert sorted(p.job_id for p in outcome.placements) == ["a", "b"]  # as the quotas were when it read them
    assert changed.is_set() and run(store.list_quotas())["vision"].max == 4


def test_a_cycle_that_read_before_a_quota_change_and_locks_after_it_plans_again(store_env):
    """The other order: the change holds the clusters' rows when the cycle begins; the cycle's
    snapshot predates the change's commit, so taking its row then fails, and the planning
    activity's next read has the new quota."""
    run, store = store_env
    for name in ("a", "b"):
        run(store.admit(job(name, gpus=4)))

    async def change_during_the_cycles_first_read() -> None:
        async with store.pool.acquire() as conn:
            change = conn.transaction()
            await change.start()
            await conn.execute(q.ORDER_AFTER_CYCLES)
            cycle = asyncio.ensure_future(store.plan_cycle("c1", 1, run_cycle))
            await until_blocked_or_done(conn, cycle)
            await conn.execute(q.SET_QUOTA, "vision", 4, 4, 3)
            await change.commit()
            with pytest.raises(CycleConflict):
                await cycle

    run(change_during_the_cycles_first_read())
    assert [p.job_id for p in run(store.plan_cycle("c1", 1, run_cycle)).placements] == ["a"]


def test_a_heartbeat_answers_the_allocations_holding_the_machine_s_gpus_and_none_that_ended_or_are_elsewhere(
        store_env):
    """The answer is what the agent keeps: a local process of any other allocation is stopped as
    an orphan. Before, only an empty answer was checked (on a live stack)."""
    run, store = store_env
    alloc = placed(run, store, gpus=4)  # one machine's worth: on one machine
    [here] = {g.rsplit("/", 1)[0] for g in run(store.job_view("a")).attempts[0].gpus}
    [there] = [m.id for m in machines() if m.id != here]
    beat = [GpuReport(index=i) for i in range(4)]
    assert run(store.machine_heartbeat(here, 1, beat)) == [alloc]  # placed, not taken up yet
    assert run(store.machine_heartbeat(there, 1, beat)) == []
    run(store.start_attempt("a", alloc))
    assert run(store.machine_heartbeat(here, 1, beat)) == [alloc]  # running
    run(store.end_attempt("a", alloc, EndReason.preempted, None, JobState.queued, "requeued: preempted"))
    assert run(store.machine_heartbeat(here, 1, beat)) == []  # ended: its process is an orphan


def test_a_gpu_reported_sick_is_usable_again_once_its_agent_reports_it_healthy(store_env):
    """A fault that clears (a thermal throttle, an ECC error after a reset): the GPU comes back."""
    run, store = store_env
    m0 = machines()[0].id

    def unhealthy() -> set[int]:
        return set(next(m for m in run(store.snapshot("c1")).machines if m.id == m0).unhealthy_gpus)

    run(store.machine_heartbeat(m0, 1, [GpuReport(index=i, healthy=i != 2, faults=["ecc_uncorrectable"] * (i == 2))
                                        for i in range(4)]))
    assert unhealthy() == {2}
    run(store.machine_heartbeat(m0, 1, [GpuReport(index=i) for i in range(4)]))
    assert unhealthy() == set()


def test_a_known_machine_s_heartbeat_that_lists_no_gpus_is_heard_and_leaves_its_gpus_as_they_were(store_env):
    """"A heartbeat without GPUs says nothing about them": not a 422, nor every GPU gone missing."""
    run, store = store_env
    m0 = machines()[0].id
    assert run(store.machine_heartbeat(m0, 7, [])) == []
    by_id = {m.id: m for m in run(store.snapshot("c1")).machines}
    assert (by_id[m0].gpus, set(by_id[m0].unhealthy_gpus), by_id[m0].reachable) == (4, set(), True)


def test_a_placed_job_counts_against_its_team_s_queue_cap_and_a_running_one_does_not(store_env):
    """The cap counts the jobs waiting: queued, or placed and not started yet."""
    run, store = store_env  # vision's queue cap is 3
    for name in "ab":
        assert run(store.admit(job(name))).accepted
    assert len(run(store.plan_cycle("c1", 1, run_cycle)).placements) == 2
    run(store.start_attempt("a", run(store.job_view("a")).attempts[0].allocation_id))  # a runs, b is placed
    assert run(store.admit(job("c"))).accepted and run(store.admit(job("d"))).accepted  # b, c waiting: 2
    verdict = run(store.admit(job("e")))  # b, c and d waiting: the cap
    assert not verdict.accepted and verdict.field == "team" and "queue cap" in verdict.reason


def test_each_renewal_of_a_machine_s_token_moves_it_to_the_next_generation_and_no_other_machine_s(store_env):
    """`gpusched fleet token M --renew` twice (a machine taken over again): the token of the first
    renewal must be refused too. Before, only one renewal was tried (on a live stack)."""
    run, store = store_env
    m0, m1 = (m.id for m in machines())
    assert [run(store.renew_machine_token(m0)) for _ in range(3)] == [1, 2, 3]
    assert (run(store.token_generation(m0)), run(store.token_generation(m1))) == (3, 0)
    assert run(store.token_generations()) == {m0: 3}
