"""Queue order: class, then team share held/guaranteed, then deadline, then submit time, then id."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError
from builders import NOW, cycle, filler, fleet, job, mid, pending_order, snapshot

from scheduler.models import Quota
from scheduler.ordering import ordered_queue
from scheduler.quotas import team_usage

M0 = mid(0, 0, 0)

# Each case: the queue (in some scrambled order), the teams' quotas, what each team holds
# (team -> GPUs, as one running job), and the order expected.
CASES = [
    (
        [job("low").priority("low").submitted(0), job("crit").priority("critical").submitted(30),
         job("norm").priority("normal").submitted(10), job("high").priority("high").submitted(20)],
        {}, {},
        ["crit", "high", "norm", "low"],
    ),
    (
        [job("busy").team("a").submitted(0), job("idle").team("b").submitted(50)],
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 8}}, {"a": 4},
        ["idle", "busy"],
    ),
    (
        [job("half").team("a").submitted(0), job("quarter").team("b").submitted(50)],
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 16}}, {"a": 4, "b": 4},
        ["quarter", "half"],
    ),
    (
        [job("noguar").team("z").submitted(0), job("over").team("a").submitted(50)],
        {"a": {"guaranteed": 4}}, {"a": 12},
        ["over", "noguar"],
    ),
    (
        [job("norm-idle").team("b").priority("normal").submitted(0),
         job("crit-busy").team("a").priority("critical").submitted(50)],
        {"a": {"guaranteed": 4}, "b": {"guaranteed": 100}}, {"a": 40},
        ["crit-busy", "norm-idle"],
    ),
    (
        [job("late").deadline(9_000).submitted(0), job("soon").deadline(5_000).submitted(50),
         job("none").submitted(-100)],
        {}, {},
        ["soon", "late", "none"],
    ),
    (
        [job("deadline-busy").team("a").deadline(100).submitted(0), job("idle").team("b").submitted(50)],
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 8}}, {"a": 4},
        ["idle", "deadline-busy"],
    ),
    (
        [job("b2").submitted(20), job("b1").submitted(10), job("b3").submitted(30)],
        {}, {},
        ["b1", "b2", "b3"],
    ),
    (
        [job("z").submitted(10), job("a").submitted(10), job("m").submitted(10)],
        {}, {},
        ["a", "m", "z"],
    ),
]

IDS = [
    "a critical job goes before high, high before normal, normal before low, whatever their submit times",
    "within a class, the team holding less of its guarantee goes first",
    "share is held over guaranteed: 4 of 16 goes before 4 of 8",
    "a team with no guarantee goes after a team even far over its guarantee",
    "class beats share: a critical job of a busy team goes before a normal job of an idle team",
    "within class and share, the earliest deadline goes first and no deadline goes last",
    "share beats deadline",
    "with everything else equal, the earlier submitted job goes first",
    "with everything else equal including submit time, the job id decides",
]


def _usage(quotas, holds):
    from builders import running

    quotas = {t: Quota(**q) for t, q in quotas.items()}
    jobs = [running(job(f"held-{t}").team(t).gpus(n)).on(M0, range(n)).build() for t, n in holds.items()]
    return quotas, team_usage(quotas, jobs)


@pytest.mark.parametrize("queue,quotas,holds,expected", CASES, ids=IDS)
def test_queue_order(queue, quotas, holds, expected):
    quotas, usage = _usage(quotas, holds)
    queued = [j.queued() for j in queue]
    assert [q.spec.job_id for q in ordered_queue(queued, usage)] == expected


@pytest.mark.parametrize("queue,quotas,holds,expected", CASES, ids=IDS)
def test_queue_order_is_a_total_order_whatever_the_input_order(queue, quotas, holds, expected):
    quotas, usage = _usage(quotas, holds)
    queued = [j.queued() for j in queue]
    for perm in itertools.permutations(queued):
        assert [q.spec.job_id for q in ordered_queue(list(perm), usage)] == expected


def test_a_requeued_job_keeps_its_place_by_submit_time():
    """Preempted at 500 and back in the queue, it still goes before a job submitted at 100."""
    _, usage = _usage({}, {})
    requeued = job("requeued").submitted(0).queued(since=500, progress=300, preemptions=[500])
    fresh = job("fresh").submitted(100).queued()
    assert [q.spec.job_id for q in ordered_queue([fresh, requeued], usage)] == ["requeued", "fresh"]


def test_pending_positions_follow_the_queue_order():
    """Nothing can start (each job needs more GPUs than a machine has), so all wait, in order."""
    queue = [
        job("low").priority("low").gpus(9).topology("machine").submitted(NOW),
        job("crit").priority("critical").gpus(9).topology("machine").submitted(NOW),
        job("norm-late").gpus(9).topology("machine").submitted(NOW),
        job("norm-early").gpus(9).topology("machine").submitted(NOW - 5),
    ]
    result = cycle(snapshot(fleet(machines=1), queue=queue))
    assert pending_order(result) == ["crit", "norm-early", "norm-late", "low"]
    assert [p.position for p in sorted(result.pending, key=lambda p: p.position)] == [1, 2, 3, 4]


def test_the_first_in_order_gets_the_only_free_machine():
    """Two 8-GPU jobs, one free machine: the higher class wins it although it was submitted later."""
    result = cycle(snapshot(
        fleet(machines=2),
        running=[filler("f", mid(0, 0, 1), range(8))],
        queue=[job("early-normal").gpus(8).submitted(NOW - 100), job("late-high").gpus(8).priority("high").submitted(NOW)],
    ))
    assert [p.job_id for p in result.placements] == ["late-high"]
    assert pending_order(result) == ["early-normal"]


def test_the_order_kept_from_the_last_cycle_follows_the_shares_and_the_jobs():
    """A cluster's order is given again only for the very same jobs with the same shares."""
    quotas, busy_a = _usage({"a": {"guaranteed": 8}, "b": {"guaranteed": 8}}, {"a": 4})
    _, busy_b = _usage({"a": {"guaranteed": 8}, "b": {"guaranteed": 8}}, {"b": 4})
    queued = [job("of-a").team("a").submitted(0).queued(), job("of-b").team("b").submitted(50).queued()]

    def order(queue, usage):
        return [q.spec.job_id for q in ordered_queue(queue, usage, cluster="kept")]

    assert order(queued, busy_a) == ["of-b", "of-a"]
    assert order(queued, busy_a) == ["of-b", "of-a"]
    assert order(queued, busy_b) == ["of-a", "of-b"]  # the same jobs, other shares
    sooner = job("of-b").team("b").submitted(50).deadline(NOW + 60).queued()  # a new object for a changed job
    assert order([queued[0], sooner], busy_a) == ["of-b", "of-a"]
    assert order([queued[0], sooner, job("of-c").priority("critical").queued()], busy_b) == ["of-c", "of-a", "of-b"]


@pytest.mark.parametrize("field, build", [
    ("deadline", lambda: job("a").deadline(float("nan")).queued()),
    ("submit_time", lambda: job("a").submitted(float("nan")).queued()),
    ("expected_duration", lambda: job("a").expected(float("inf")).queued()),
], ids=["a NaN deadline", "a NaN submit time", "an endless expected run"])
def test_a_job_whose_times_are_no_numbers_is_refused_by_the_model(field, build):
    """A NaN compares false both ways: three input orders of one queue gave three orders."""
    with pytest.raises(ValidationError, match=field):
        build()
