"""Fair share: borrowing up to the maximum, waiting at the maximum, reclaiming borrowed capacity."""

from __future__ import annotations

import pytest
from builders import (
    NOW,
    after_preemption,
    cycle,
    filler,
    fleet,
    job,
    mid,
    pending,
    placements,
    preempted,
    running,
    snapshot,
)

from scheduler.models import Quota
from scheduler.quotas import team_usage

M0, M1, M2, M3 = (mid(0, 0, i) for i in range(4))


def _ran(job_id, team, machine, gpus, started=0.0, priority="normal"):
    return running(job(job_id).team(team).gpus(len(list(gpus))).priority(priority)).on(machine, gpus).started(started)


# --- borrowing and the maximum ---------------------------------------------------------------------

MAX_CASES = [
    # (quotas, running, queue, expected placed, expected waiting)
    (
        {"a": {"guaranteed": 0, "max": 16}}, [],
        [job("a1").team("a").gpus(8).submitted(NOW)],
        {"a1"}, set(),
    ),
    (
        {"a": {"guaranteed": 0, "max": 8}}, [_ran("r", "a", M0, range(8))],
        [job("a1").team("a").gpus(2).submitted(NOW)],
        set(), {"a1"},
    ),
    (
        {"a": {"guaranteed": 0, "max": 8}}, [_ran("r", "a", M0, range(6))],
        [job("a1").team("a").gpus(2).submitted(NOW)],
        {"a1"}, set(),
    ),
    (
        {"a": {"guaranteed": 0, "max": 8}}, [_ran("r", "a", M0, range(6))],
        [job("a1").team("a").gpus(2).submitted(NOW), job("a2").team("a").gpus(1).submitted(NOW + 1)],
        {"a1"}, {"a2"},
    ),
    (
        {"*": {"guaranteed": 0, "max": 4}}, [],
        [job("z1").team("zeta").gpus(4).submitted(NOW), job("z2").team("zeta").gpus(4).submitted(NOW + 1)],
        {"z1"}, {"z2"},
    ),
    (
        {"a": {"guaranteed": 0, "max": 4}, "*": {"max": 100}}, [],
        [job("a1").team("a").gpus(8).submitted(NOW), job("b1").team("b").gpus(8).submitted(NOW + 1)],
        {"b1"}, {"a1"},
    ),
    (
        {"a": {"guaranteed": 8, "max": 8}}, [_ran("r", "a", M0, range(8), priority="low")],
        [job("a1").team("a").gpus(8).priority("critical").submitted(NOW)],
        set(), {"a1"},
    ),
]
MAX_IDS = [
    "a team with no guarantee borrows an idle machine up to its maximum",
    "a team holding its maximum waits for even 2 more GPUs",
    "a job that brings its team exactly to its maximum starts",
    "GPUs placed earlier in the same cycle count towards the maximum",
    "the default quota '*' caps a team without its own entry",
    "a team's own maximum applies to it, other teams are not held back by it",
    "a critical job at its team's maximum waits rather than preempting its own team's low job",
]


@pytest.mark.parametrize("quotas,run,queue,placed,waiting", MAX_CASES, ids=MAX_IDS)
def test_borrowing_and_the_maximum(quotas, run, queue, placed, waiting):
    result = cycle(snapshot(fleet(machines=4), running=run, queue=queue, quotas=quotas))
    assert set(placements(result)) == placed
    assert set(pending(result)) == waiting
    assert not result.preemptions
    for job_id in waiting:
        reason = pending(result)[job_id].reason
        assert "maximum" in reason, reason


def test_the_maximum_reason_names_the_team_and_the_numbers():
    result = cycle(snapshot(fleet(machines=2), running=[_ran("r", "vision", M0, range(6))],
                            queue=[job("v").team("vision").gpus(4).submitted(NOW)],
                            quotas={"vision": {"guaranteed": 4, "max": 8}}))
    reason = pending(result)["v"].reason
    assert reason == "team vision would pass its maximum with this job's 4 GPUs (6 of 8 GPUs held)", reason


# --- which running jobs are borrowed ------------------------------------------------------------------


@pytest.mark.parametrize(
    "guaranteed,jobs,borrowed",
    [
        (8, [("old", 8, 0), ("new", 8, 100)], {"new"}),
        (16, [("old", 8, 0), ("new", 8, 100)], set()),
        (0, [("old", 8, 0), ("new", 8, 100)], {"old", "new"}),
        (4, [("old", 8, 0), ("new", 2, 100)], {"old", "new"}),
        (5, [("old", 4, 0), ("mid", 2, 50), ("new", 2, 100)], {"new", "mid"}),
    ],
    ids=[
        "with one job beyond the guarantee, the most recently started is the borrowed one",
        "a team within its guarantee has borrowed nothing",
        "a team without a guarantee has borrowed all it holds",
        "a job only partly beyond the guarantee counts as borrowed",
        "borrowed jobs are taken newest first until the excess is covered",
    ],
)
def test_borrowed_jobs_are_the_newest_beyond_the_guarantee(guaranteed, jobs, borrowed):
    run = [_ran(job_id, "b", mid(0, 0, i), range(n), started=started).build()
           for i, (job_id, n, started) in enumerate(jobs)]
    usage = team_usage({"b": Quota(guaranteed=guaranteed)}, run)
    assert usage.borrowed == borrowed


@pytest.mark.parametrize(
    "guaranteed,jobs,protected,borrowed",
    [
        (8, [("old", 8, 0), ("new", 8, 100)], {"new"}, {"old"}),
        (4, [("a", 4, 0), ("b", 4, 50), ("c", 4, 100)], {"a", "c"}, {"b", "c"}),
        (8, [("a", 4, 0), ("b", 4, 50), ("c", 4, 100)], {"a", "b", "c"}, {"c"}),
        (4, [("a", 4, 0), ("b", 4, 50), ("c", 4, 100)], set(), {"b", "c"}),
        (8, [("old", 8, 0), ("new", 4, 100)], {"new"}, {"new"}),
        (8, [("old", 4, 0), ("new", 8, 100)], set(), {"old"}),
    ],
    ids=[
        "a protected newest job is passed over for the preemptible one",
        "when the preemptible jobs do not cover the excess, the protected ones count too, newest first",
        "with every job protected, the newest are borrowed",
        "with none protected, the newest are borrowed",
        "a preemptible job bigger than the excess is not borrowed: given back, it would leave the team below "
        "its guarantee",
        "the newest job, bigger than the excess, is passed over for an older one that fits it",
    ],
)
def test_borrowed_jobs_are_the_preemptible_ones_first(guaranteed, jobs, protected, borrowed):
    run = [_ran(job_id, "b", mid(0, 0, i), range(n), started=started).build()
           for i, (job_id, n, started) in enumerate(jobs)]
    usage = team_usage({"b": Quota(guaranteed=guaranteed)}, run)
    usage.preemptible = lambda job: job.spec.job_id not in protected
    assert usage.borrowed == borrowed


# --- reclaim ----------------------------------------------------------------------------------------


def _full_of_b(priority="normal", started=(0, 100)):
    """Two machines, both held by team b: 'b-old' started first, 'b-new' last."""
    return [
        _ran("b-old", "b", M0, range(8), started=started[0], priority=priority),
        _ran("b-new", "b", M1, range(8), started=started[1], priority=priority),
    ]


RECLAIM_CASES = [
    (
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 8}}, _full_of_b(),
        job("a1").team("a").gpus(8).priority("low").submitted(NOW),
        ["b-new"],
    ),
    (
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 0}}, _full_of_b(priority="critical"),
        job("a1").team("a").gpus(8).priority("low").submitted(NOW),
        ["b-new"],
    ),
    (
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 16}}, _full_of_b(),
        job("a1").team("a").gpus(8).submitted(NOW),
        [],
    ),
    (
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 0}},
        _full_of_b() + [_ran("a-run", "a", M2, range(8))],
        job("a1").team("a").gpus(8).submitted(NOW),
        [],
    ),
    (
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 0}},
        _full_of_b() + [_ran("a-run", "a", M2, range(4)), filler("f", M2, range(4, 8))],
        job("a1").team("a").gpus(4).submitted(NOW),
        ["b-new"],
    ),
    (
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 0}},
        _full_of_b() + [_ran("a-run", "a", M2, range(4)), filler("f", M2, range(4, 8))],
        job("a1").team("a").gpus(6).submitted(NOW),
        [],
    ),
    (
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 8}}, _full_of_b(started=(0, NOW - 60)),
        job("a1").team("a").gpus(8).submitted(NOW),
        ["b-old"],
    ),
    (
        {"a": {"guaranteed": 8}, "b": {"guaranteed": 0}}, _full_of_b(started=(0, NOW - 60)),
        job("a1").team("a").gpus(8).submitted(NOW),
        ["b-old"],
    ),
]
RECLAIM_IDS = [
    "a team under its guarantee reclaims the other team's most recently started borrowed job",
    "reclaim takes borrowed capacity whatever its class: a low job displaces a critical borrowed one",
    "a job of another team within its guarantee is not reclaimed",
    "a team already at its guarantee does not reclaim",
    "a team exactly reaching its guarantee with the job (4 held + 4 asked = 8) still reclaims",
    "a team that would go beyond its guarantee with the job (4 held + 6 asked > 8) does not reclaim",
    "when the newest job beyond a guarantee is protected, the team's preemptible job counts as borrowed and goes",
    "a borrowed job still within its minimum runtime is protected, the other borrowed one goes",
]


@pytest.mark.parametrize("quotas,run,claimant,victims", RECLAIM_CASES, ids=RECLAIM_IDS)
def test_reclaim(quotas, run, claimant, victims):
    machines = fleet(machines=2) if len(run) <= 2 else fleet(machines=3)
    quotas = {**quotas, "ops": {"guaranteed": 1000}}  # the fillers' team is never borrowing
    result = cycle(snapshot(machines, running=run, queue=[claimant], quotas=quotas))
    assert not result.placements
    assert preempted(result) == victims
    if victims:
        assert all(p.for_job == claimant.job_id for p in result.preemptions)
        assert all("reclaims" in p.reason for p in result.preemptions)
        assert [e.job_id for e in result.earmarks] == [claimant.job_id]
    else:
        assert not result.earmarks


def _three_borrowed_machines():
    return [_ran(f"b{i}", "b", mid(0, 0, i), range(8), started=i) for i in range(3)]


def test_a_team_reclaims_no_more_than_its_guarantee_in_one_cycle():
    queue = [job("a1").team("a").gpus(8).priority("low").submitted(NOW),
             job("a2").team("a").gpus(8).priority("low").submitted(NOW + 1)]
    result = cycle(snapshot(fleet(machines=3), running=_three_borrowed_machines(), queue=queue,
                            quotas={"a": {"guaranteed": 8}, "b": {"guaranteed": 0}}))
    assert [(p.job_id, p.for_job) for p in result.preemptions] == [("b2", "a1")]


def test_gpus_promised_to_a_waiting_job_count_towards_its_teams_guarantee():
    """a1 reclaimed a machine last cycle and waits for it; a2 must not reclaim another."""
    quotas = {"a": {"guaranteed": 8}, "b": {"guaranteed": 0}}
    first = snapshot(fleet(machines=3), running=_three_borrowed_machines(), quotas=quotas,
                     queue=[job("a1").team("a").gpus(8).priority("low").submitted(NOW)])
    result = cycle(first)
    assert preempted(result) == ["b2"]
    later = after_preemption(first, result, now=NOW + 30, victims_gone=False)
    later = later.model_copy(update={"queue": later.queue + (job("a2").team("a").gpus(8).priority("low")
                                                            .submitted(NOW + 30).queued(),)})
    result = cycle(later)
    assert not result.preemptions
    assert "a2" in pending(result) and "a1" in pending(result)


def test_gpus_promised_to_a_waiting_job_count_towards_its_teams_maximum():
    """a preempts for 8 GPUs, its team's maximum; b, which would fit on free GPUs now, must wait,
    or the team holds 12 of its 8 once a starts on what it was promised."""
    quotas = {"o": {"guaranteed": 0}, "t": {"guaranteed": 0, "max": 8}}
    first = snapshot(
        fleet(machines=2),
        running=[running(job("v").gpus(8).priority("low").team("o")).on(M0, range(8)), filler("guard", M1, range(4))],
        queue=[job("a").gpus(8).priority("critical").team("t").submitted(NOW - 10),
               job("b").gpus(4).team("t").submitted(NOW)],
        quotas=quotas)
    result = cycle(first)
    assert preempted(result) == ["v"] and "b" in pending(result)
    later = cycle(after_preemption(first, result, now=NOW + 400))
    assert set(placements(later)) == {"a"} and "b" in pending(later)


def test_a_promise_to_a_job_whose_teams_maximum_was_lowered_under_it_is_dropped():
    """Kept, the promised machine stood idle until the promise lapsed, the victim waiting beside
    it ("the largest free is 0"), and the claimant was told it starts now."""
    quotas = {"o": {"guaranteed": 0}, "t": {"guaranteed": 8, "max": 16}}
    first = snapshot(fleet(machines=1), running=[running(job("v").gpus(8).priority("low").team("o")).on(M0, range(8))],
                     queue=[job("claim").gpus(8).priority("normal").team("t").submitted(NOW)], quotas=quotas)
    result = cycle(first)
    assert preempted(result) == ["v"]
    later = after_preemption(first, result, now=NOW + 130)
    lowered = later.model_copy(update={"quotas": {**later.quotas, "t": Quota(guaranteed=4, max=4)}})
    result = cycle(lowered)
    assert set(placements(result)) == {"v"} and not result.earmarks
    assert "more than team t's maximum of 4" in pending(result)["claim"].reason
    assert pending(result)["claim"].estimated_start is None


def test_no_reclaim_while_free_gpus_let_the_job_start():
    result = cycle(snapshot(
        fleet(machines=3), running=_full_of_b(), queue=[job("a1").team("a").gpus(8).submitted(NOW)],
        quotas={"a": {"guaranteed": 8}, "b": {"guaranteed": 0}},
    ))
    assert set(placements(result)) == {"a1"}
    assert not result.preemptions
    assert placements(result)["a1"].gpus == tuple((mid(0, 0, 2), g) for g in range(8))


def test_a_team_borrows_idle_capacity_beyond_its_guarantee_up_to_its_maximum():
    """Guarantee 8, maximum 24, an idle 4-machine cluster: three 8-GPU jobs start, the fourth waits."""
    queue = [job(f"a{i}").team("a").gpus(8).submitted(NOW + i) for i in range(4)]
    result = cycle(snapshot(fleet(machines=4), queue=queue, quotas={"a": {"guaranteed": 8, "max": 24}}))
    assert set(placements(result)) == {"a0", "a1", "a2"}
    assert "maximum" in pending(result)["a3"].reason


# --- free GPUs go to a team's guarantee before anyone borrows them -----------------------------------

def _critical_b_then_low_a(gpus=8, low_jobs=1):
    """Team b's critical job, then team a's low jobs, all of `gpus` GPUs, in submit order."""
    return [job("b1").team("b").gpus(gpus).priority("critical").submitted(NOW)] + [
        job(f"a{i}").team("a").gpus(gpus).priority("low").submitted(NOW + i) for i in range(1, low_jobs + 1)]


FIRST_CASES = [
    # (quotas, queue, expected placed, expected waiting); one free machine of 8 GPUs
    ({"a": {"guaranteed": 8}, "b": {"guaranteed": 0}}, _critical_b_then_low_a(), {"a1"}, {"b1"}),
    ({"a": {"guaranteed": 4}, "b": {"guaranteed": 0}}, _critical_b_then_low_a(), {"b1"}, {"a1"}),
    ({"a": {"guaranteed": 8}, "b": {"guaranteed": 8}}, _critical_b_then_low_a(), {"b1"}, {"a1"}),
    ({"a": {"guaranteed": 4}, "b": {"guaranteed": 0}}, _critical_b_then_low_a(gpus=4, low_jobs=2),
     {"a1", "b1"}, {"a2"}),
]
FIRST_IDS = [
    "a low job within its team's guarantee takes a free machine before a critical job that would borrow it",
    "a job that would take its own team beyond its guarantee keeps its place in the queue order",
    "between two jobs both within their guarantees the queue order decides",
    "once a team's guarantee is covered its next job waits its turn behind the borrowers",
]


@pytest.mark.parametrize("quotas,queue,placed,waiting", FIRST_CASES, ids=FIRST_IDS)
def test_free_gpus_go_to_guarantees_before_borrowers(quotas, queue, placed, waiting):
    result = cycle(snapshot(fleet(machines=1), queue=queue, quotas=quotas))
    assert set(placements(result)) == placed
    assert set(pending(result)) == waiting
    assert not result.preemptions


def test_waiting_jobs_keep_their_queue_positions_when_a_guarantee_goes_first():
    queue = [job("b1").team("b").gpus(8).priority("critical").submitted(NOW),
             job("b2").team("b").gpus(8).priority("high").submitted(NOW + 1),
             job("a1").team("a").gpus(8).priority("low").submitted(NOW + 2)]
    result = cycle(snapshot(fleet(machines=1), queue=queue, quotas={"a": {"guaranteed": 8}, "b": {"guaranteed": 0}}))
    assert set(placements(result)) == {"a1"}
    assert {job_id: p.position for job_id, p in pending(result).items()} == {"b1": 1, "b2": 2}


# --- a job that would borrow takes nothing from another team's guarantee ---------------------------

def _low_of(team):
    return _ran("low", team, M0, range(8), priority="low")


BORROWER_CASES = [
    ({"a": {"guaranteed": 8}, "b": {"guaranteed": 0}}, _low_of("a"), "b", []),
    ({"a": {"guaranteed": 0}, "b": {"guaranteed": 0}}, _low_of("a"), "b", ["low"]),
    ({"b": {"guaranteed": 0}}, _low_of("b"), "b", ["low"]),
    ({"a": {"guaranteed": 8}, "c": {"guaranteed": 8}}, _low_of("a"), "c", ["low"]),
]
BORROWER_IDS = [
    "a critical job that would borrow does not preempt a low job within its own team's guarantee",
    "a critical job that would borrow preempts a low job that is borrowed itself",
    "a critical job that would borrow preempts a low job of its own team",
    "a critical job within its team's guarantee preempts a low job whatever that job's team",
]


@pytest.mark.parametrize("quotas,victim,team,victims", BORROWER_CASES, ids=BORROWER_IDS)
def test_who_a_critical_job_may_preempt_by_guarantees(quotas, victim, team, victims):
    guard = filler("guard", M1, range(8))
    claimant = job("claim").team(team).gpus(8).priority("critical").submitted(NOW)
    result = cycle(snapshot(fleet(machines=2), running=[victim, guard], queue=[claimant],
                            quotas={**quotas, "ops": {"guaranteed": 1000}}))
    assert preempted(result) == victims


# --- the start order kept from cycle to cycle -------------------------------------------------------


def test_the_start_order_kept_between_cycles_equals_one_made_from_nothing():
    """Jobs start and end between cycles (some at the same second, some teams emptying): the
    order and counts carried per cluster must be those built from the running jobs alone."""
    import random

    from scheduler.quotas import StartOrder

    rng = random.Random(7)
    pool = [_ran(f"j{k:03d}", rng.choice("abc"), mid(0, 0, k % 4), range(rng.choice((1, 2, 4))),
                 started=float(rng.choice((0, 50, 100, 100, 150)))).build() for k in range(120)]
    quotas = {t: Quota(guaranteed=4) for t in "abc"}
    running = pool[:30]
    for step in range(40):
        usage = team_usage(quotas, running, "order-test")
        fresh = StartOrder(running)
        assert usage.start_order.by_team == fresh.by_team
        assert usage.used == fresh.used
        assert usage.borrowed == team_usage(quotas, running).borrowed
        ended = set(rng.sample(range(len(running)), rng.randint(0, 4)))
        running = [j for k, j in enumerate(running) if k not in ended]
        running += rng.sample([j for j in pool if j not in running], rng.randint(0, 4))
        if step == 20:
            running = [j for j in running if j.spec.team != "a"]  # a team's last jobs end
