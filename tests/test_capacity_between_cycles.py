"""The free GPUs a cycle starts from are derived from the last cycle's: always what a fresh count gives.

`Capacity` keeps what the last cycle's running jobs held and looks only at the jobs that started
or ended since. Each case is a run of cycles over one fleet, every cycle naming the running jobs
(the same objects from cycle to cycle, as the simulator and the live store pass them); after each,
the capacity must equal a count made from nothing: every healthy GPU of a usable machine that no
running job holds.
"""

from __future__ import annotations

import pytest
from builders import examples, fleet, job, mid, running, unhealthy, unreachable
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.capacity import Capacity, all_on_healthy_machines
from scheduler.models import Machine, RunningJob

M0, M1 = mid(0, 0, 0), mid(0, 0, 1)
MACHINES = fleet(blocks=2, racks=1, machines=2)  # b0: m0, m1; b1: m0, m1
B1M0 = mid(1, 0, 0)


def _on(job_id: str, *where: tuple[str, range]) -> RunningJob:
    b = running(job(job_id).gpus(sum(len(g) for _, g in where)))
    for machine, gpus in where:
        b = b.on(machine, gpus)
    return b.build()


JOBS = {
    "a": _on("a", (M0, range(0, 4))),
    "b": _on("b", (M0, range(4, 6))),
    "c": _on("c", (M1, range(0, 8))),
    "d": _on("d", (B1M0, range(0, 2))),
    "wide": _on("wide", (B1M0, range(4, 8)), (mid(1, 0, 1), range(0, 4))),
    "lost": _on("lost", ("c1/b9/r0/m0", range(0, 2))),  # on a machine the fleet does not know
}
# Jobs that stay on while others come and go: a cycle is derived from the last one only when
# few of its jobs changed (when most did, it is counted from nothing).
STAY = ["x1", "x2", "x3"]
JOBS.update({name: _on(name, (mid(1, 0, 1), range(4 + k, 5 + k))) for k, name in enumerate(STAY)})
# The same job id on other GPUs: a changed job is a new object, and must be read afresh.
MOVED_A = _on("a", (M1, range(0, 4)))


def _expected_free(machines: list[Machine], jobs: list[RunningJob]) -> dict[str, list[int]]:
    held = {(m, g) for j in jobs for m, g in j.gpus}
    return {m.id: [g for g in range(m.gpus) if g not in m.unhealthy_gpus and (m.id, g) not in held]
            for m in machines if m.reachable}


def _check(machines: list[Machine], jobs: list[RunningJob]) -> None:
    cap = Capacity(machines, jobs)
    free = {m.id: list(cap.free[i]) for i, m in enumerate(cap.machines)}
    assert free == _expected_free(machines, jobs)
    for pool in cap.pools.values():  # the buckets, the pools' and the blocks' totals agree
        for count, bucket in enumerate(pool.buckets):
            assert all(len(cap.free[i]) == count for i in bucket)
        assert sorted(i for b in pool.buckets for i in b) == sorted(pool.members)
        assert pool.free == sum(len(cap.free[i]) for i in pool.members)
    for block, total in cap.block_free.items():
        assert total == sum(len(cap.free[i]) for i, b in enumerate(cap.block_of) if b == block)
    known = {m.id for m in machines if m.reachable}
    healthy = all(m.reachable and not m.unhealthy_gpus for m in machines)
    assert all_on_healthy_machines(machines, jobs) == (
        healthy and all(m in known for j in jobs for m, _ in j.gpus))


CASES = [
    ("a job that ends gives its GPUs back", [["a", "b", "c"], ["a", "c"]]),
    ("a job that starts takes its GPUs", [["a"], ["a", "b"], ["a", "b", "d"]]),
    ("two jobs on one machine: when one ends the other's GPUs stay held", [["a", "b"], ["b"], []]),
    ("the same jobs in another order change nothing", [["a", "b", "c"], ["c", "a", "b"]]),
    ("a job across blocks comes and goes whole", [["wide"], ["wide", "a"], ["a"], ["a", "wide"]]),
    ("a job on an unknown machine holds nothing, and the fleet is healthy again once it leaves",
     [["a", "lost"], ["a"], ["a", "b", "lost"], ["b"]]),
    ("most jobs changing at once is counted from nothing", [["a"], ["b", "c", "d", "wide"], ["a"]]),
    ("a job moved to other GPUs is a new object and is read afresh", [["a", "c"], ["moved-a"], ["a"]]),
]


@pytest.mark.parametrize("steps", [steps for _, steps in CASES], ids=[name for name, _ in CASES])
@pytest.mark.parametrize("others", [[], STAY], ids=["alone", "among jobs that stay"])
def test_each_cycle_starts_from_what_a_fresh_count_gives(steps, others):
    pool = dict(JOBS, **{"moved-a": MOVED_A})
    for names in steps:
        _check(MACHINES, [pool[n] for n in others + names])


def test_a_cycles_decisions_do_not_carry_into_the_next():
    jobs = [JOBS["a"]]
    first = Capacity(MACHINES, jobs)
    first.take([(M1, 0), (M1, 1)])
    first.give([(M0, 0)])
    _check(MACHINES, jobs)


def test_machines_that_change_health_are_counted_with_their_new_health():
    jobs = [JOBS["a"], JOBS["c"]]
    _check(MACHINES, jobs)
    _check(unhealthy(MACHINES, M0, [6]), jobs)
    _check(unreachable(MACHINES, M1), jobs)
    _check(MACHINES, jobs)


def test_two_clusters_planned_in_turn_keep_their_own():
    other = fleet(machines=2, cluster="c2")
    theirs = [_on("x", (mid(0, 0, 0, cluster="c2"), range(0, 8)))]
    for step in (["a"], ["a", "b"], ["b"]):
        _check(MACHINES, [JOBS[n] for n in step])
        _check(other, theirs)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.sets(st.sampled_from(sorted(JOBS) + ["moved-a"])), min_size=1, max_size=8))
def test_any_run_of_cycles_counts_like_a_fresh_count(steps):
    pool = dict(JOBS, **{"moved-a": MOVED_A})
    for names in steps:
        _check(MACHINES, [pool[n] for n in sorted(names)])
