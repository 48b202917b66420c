"""Preemption: who may be displaced, who is protected, in which order, and only if it really helps."""

from __future__ import annotations

import pytest
from builders import (
    NOW,
    after_preemption,
    cycle,
    ends_in,
    filler,
    fleet,
    job,
    machines_of,
    mid,
    pending,
    placements,
    preempted,
    running,
    silent,
    snapshot,
    unhealthy,
)

from scheduler.models import Earmark

M0, M1, M2 = mid(0, 0, 0), mid(0, 0, 1), mid(0, 0, 2)
CRIT = job("claim").gpus(8).priority("critical").submitted(NOW)


def _run(job_id, machine, gpus=range(8), *, priority="low", team="t", started=0.0, **spec):
    b = job(job_id).gpus(len(list(gpus))).priority(priority).team(team)
    for k, v in spec.items():
        b = getattr(b, k)(v) if not isinstance(v, tuple) else getattr(b, k)(*v)
    return running(b).on(machine, gpus).started(started)


def _guard(machine, gpus=range(8), name=None):
    return filler(name or f"guard-{machine}", machine, gpus)


# Each case: running jobs on a 2-machine cluster, the claimant, and the victims expected.
WHO_CASES = [
    ([_run("low", M0), _guard(M1)], CRIT, ["low"]),
    ([_run("norm", M0, priority="normal"), _guard(M1)], job("claim").gpus(8).priority("normal").submitted(NOW), []),
    ([_run("high", M0, priority="high"), _guard(M1)], job("claim").gpus(8).priority("normal").submitted(NOW), []),
    ([_run("norm", M0, priority="normal"), _guard(M1)], job("claim").gpus(8).priority("high").submitted(NOW), ["norm"]),
    ([_run("low", M0, started=NOW - 599), _guard(M1)], CRIT, []),
    ([_run("low", M0, started=NOW - 600), _guard(M1)], CRIT, ["low"]),
    ([_run("low", M0).preempted_at(NOW - 2000, NOW - 1000), _guard(M1)], CRIT, []),
    ([_run("low", M0).preempted_at(NOW - 1000), _guard(M1)], CRIT, ["low"]),
    ([_run("low", M0).preempted_at(NOW - 3600, NOW - 1000), _guard(M1)], CRIT, []),
    ([_run("low", M0).preempted_at(NOW - 3601, NOW - 1000), _guard(M1)], CRIT, ["low"]),
    ([_run("low", M0, started=NOW - 901, checkpoint=None), _guard(M1)], CRIT, []),
    ([_run("low", M0, started=NOW - 900, checkpoint=None), _guard(M1)], CRIT, ["low"]),
    ([_run("low", M0, started=NOW - 700, checkpoint=None), _guard(M1)], CRIT, ["low"]),
    ([_run("low", M0).draining(NOW + 60, "someone"), _guard(M1)], CRIT, []),
]
WHO_IDS = [
    "a critical job preempts a low job when the cluster is full",
    "a job never preempts a job of its own class",
    "a job never preempts a job of a higher class",
    "a high job preempts a normal job",
    "a job that has run less than the minimum runtime is protected",
    "a job that has run exactly the minimum runtime may be preempted",
    "a job preempted twice within the thrash window is protected",
    "a job preempted once within the thrash window may be preempted",
    "a preemption exactly a window ago still counts towards thrash protection (the hour is closed)",
    "a preemption more than a window ago no longer counts towards thrash protection",
    "a job that cannot checkpoint is protected once it has run longer than max_unsaved_run",
    "a job that cannot checkpoint is still preemptable at exactly max_unsaved_run",
    "a job that cannot checkpoint is preemptable early in its run",
    "a job already draining for another claimant is not preempted again",
]


@pytest.mark.parametrize("run,claimant,victims", WHO_CASES, ids=WHO_IDS)
def test_who_may_be_preempted(run, claimant, victims):
    result = cycle(snapshot(fleet(machines=2), running=run, queue=[claimant], grace_period=300))
    assert preempted(result) == victims
    assert not result.placements
    assert "claim" in pending(result)
    for p in result.preemptions:
        assert p.for_job == "claim"
        assert p.grace_period == 300
    if not victims:
        assert not result.earmarks


# --- victim order --------------------------------------------------------------------------------------
# Two candidates, one on each machine; the claimant needs one machine's worth, so exactly one goes.

ORDER_CASES = [
    ([_run("low", M0, started=0), _run("normal", M1, priority="normal", started=NOW - 1000)], {}, "low"),
    ([_run("borrowed", M0, team="x", started=0), _run("owned", M1, team="y", started=NOW - 1000)],
     {"x": {"guaranteed": 0}, "y": {"guaranteed": 16}, "t": {"guaranteed": 8}}, "borrowed"),
    ([_run("older", M0, started=0), _run("newer", M1, started=5000)], {}, "newer"),
    ([_run("saved-long-ago", M0).checkpointed(5000), _run("saved-recently", M1).checkpointed(9000)], {}, "saved-recently"),
    ([_run("b", M0), _run("a", M1)], {}, "a"),
]
ORDER_IDS = [
    "the lowest class goes first, even if a higher-class candidate started more recently",
    "a borrowed job goes before one within its team's guarantee, even if it started earlier "
    "(the claimant's team under its guarantee, so that both may be displaced)",
    "among equals, the most recently started goes first",
    "among equals started together, the one with least work since its checkpoint goes first",
    "when all else is equal, the job id decides",
]


@pytest.mark.parametrize("run,quotas,victim", ORDER_CASES, ids=ORDER_IDS)
def test_victim_order(run, quotas, victim):
    result = cycle(snapshot(fleet(machines=2), running=run, queue=[CRIT], quotas=quotas))
    assert preempted(result) == [victim]
    [victim_job] = [r.build() for r in run if r.spec.job_id == victim]
    [earmark] = result.earmarks
    assert set(earmark.gpus) == set(victim_job.gpus)


def test_the_place_that_displaces_the_fewest_jobs_and_least_work_is_chosen():
    """x started last, so it is the first candidate, but displacing it and w frees M0 where w
    alone frees M1."""
    w = running(job("w").gpus(8).priority("low").team("t")).on(M0, range(4, 8)).on(M1, range(4)).started(1000)
    result = cycle(snapshot(fleet(machines=2), running=[_run("x", M0, range(4), started=5000), w], queue=[CRIT]))
    assert preempted(result) == ["w"]
    [earmark] = result.earmarks
    assert set(earmark.gpus) == {(M1, g) for g in range(8)}


# --- only if it really lets the claimant start -----------------------------------------------------------

WORKS_CASES = [
    (fleet(machines=2),
     [_run("l0", M0, range(4)), _guard(M0, range(4, 8)), _run("l1", M1, range(4)), _guard(M1, range(4, 8))],
     CRIT, set()),
    (fleet(machines=2), [_run("a", M0, range(4)), _run("b", M0, range(4, 8)), _guard(M1)], CRIT, {"a", "b"}),
    (fleet(machines=2), [_run("a", M0, range(4)), _guard(M0, range(4, 8)), _guard(M1, range(6))], job("claim").gpus(4).priority("critical").submitted(NOW), {"a"}),
    (fleet(blocks=2, machines=2),
     [_run("l0", mid(0, 0, 0)), _guard(mid(0, 0, 1)), _run("l1", mid(1, 0, 0)), _guard(mid(1, 0, 1))],
     job("claim").gpus(16).priority("critical").submitted(NOW), set()),
    (fleet(blocks=2, machines=2),
     [_run("l0", mid(0, 0, 0)), _run("l1", mid(0, 0, 1)), _run("l2", mid(1, 0, 0)), _guard(mid(1, 0, 1))],
     job("claim").gpus(16).priority("critical").submitted(NOW), {"l0", "l1"}),
    (fleet(machines=2), [running(job("gang").gpus(16).priority("low")).on(M0, range(8)).on(M1, range(8))], CRIT, {"gang"}),
    (fleet(machines=2), [_run("l0", M0, range(6)), _guard(M0, range(6, 8)), _guard(M1)], CRIT, set()),
    (fleet(machines=2), [_run("a", M0, [0]), _guard(M0, range(1, 8)), _guard(M1, range(5))],
     job("claim").gpus(4).priority("critical").topology("any").submitted(NOW), {"a"}),
    (fleet(machines=2), [_run("b", M0, [3], started=NOW - 5000), _guard(M0, range(4, 8)),
                         _run("a", M1, [0], started=NOW - 1000), _guard(M1, range(1, 8))],
     job("claim").gpus(4).priority("critical").topology("any").submitted(NOW), {"b"}),
]
WORKS_IDS = [
    "two low jobs freeing 4 GPUs on each of two machines are not preempted for an 8-GPU machine job",
    "two low jobs sharing one machine are both preempted to free it whole",
    "a 4-GPU claimant needs just the one low job next to the free GPUs",
    "low jobs in two different blocks are not preempted for a 16-GPU block job",
    "two low jobs in one block are preempted for a 16-GPU block job, the third stays",
    "a gang spanning two machines is preempted whole, and one Preemption names it",
    "a low job whose GPUs cannot complete a machine for the claimant is left alone",
    "a job that may go anywhere preempts one GPU that completes room across two machines",
    "a job that may go anywhere is given room on one machine first, though another victim comes first",
]


def _usable(machines):
    return {m.id for m in machines if m.reachable}


@pytest.mark.parametrize("machines,run,claimant,victims", WORKS_CASES, ids=WORKS_IDS)
def test_preemption_only_when_the_freed_gpus_really_let_the_job_start(machines, run, claimant, victims):
    snap = snapshot(machines, running=run, queue=[claimant])
    result = cycle(snap)
    assert set(preempted(result)) == victims
    assert len(preempted(result)) == len(set(preempted(result))), "one Preemption per victim gang"
    if not victims:
        assert not result.earmarks
        return
    [earmark] = result.earmarks
    spec = claimant.spec()
    assert earmark.job_id == spec.job_id
    assert len(set(earmark.gpus)) == spec.num_gpus
    held = {g: r.spec.job_id for r in snap.running for g in r.gpus}
    for g in earmark.gpus:
        assert held.get(g) in victims | {None}, f"{g} is held by {held.get(g)}, who is not leaving"
        assert g[0] in _usable(machines)
    if spec.topology is None and spec.num_gpus <= 8:
        assert len(machines_of(earmark.gpus)) == 1
    if spec.num_gpus > 8 and spec.topology is None:
        assert len({m.split("/")[1] for m in machines_of(earmark.gpus)}) == 1


def test_a_claimant_over_its_team_maximum_preempts_nobody():
    result = cycle(snapshot(fleet(machines=2), running=[_run("low", M0), _guard(M1)],
                            queue=[job("claim").gpus(8).priority("critical").team("a").submitted(NOW)],
                            quotas={"a": {"max": 4}}))
    assert not result.preemptions
    assert "maximum" in pending(result)["claim"].reason


def test_claimants_in_one_cycle_each_take_victims_the_ones_before_them_left():
    # low-a started last, so it goes first; the second claimant must not count it again, and the
    # third finds nobody left to displace.
    m2 = mid(0, 0, 2)
    running_jobs = [_run("low-a", M0, started=NOW - 1000), _run("low-b", M1, started=NOW - 5000), _guard(m2)]
    claimants = [job(f"claim-{k}").gpus(8).priority("critical").submitted(NOW + k) for k in (1, 2, 3)]
    result = cycle(snapshot(fleet(machines=3), running=running_jobs, queue=claimants))
    assert [(p.for_job, p.job_id) for p in result.preemptions] == [("claim-1", "low-a"), ("claim-2", "low-b")]
    assert "preempting" not in pending(result)["claim-3"].reason


def test_the_preempted_jobs_are_named_in_the_claimants_reason():
    result = cycle(snapshot(fleet(machines=2), running=[_run("low", M0), _guard(M1)], queue=[CRIT], grace_period=90))
    reason = pending(result)["claim"].reason
    assert reason == "preempting low; starts when they have checkpointed (grace 90 s)"
    assert result.preemptions[0].reason == "critical job claim needs its GPUs; low yields"


# --- the earmark, across cycles --------------------------------------------------------------------------
# m0: a low job on GPUs 0-5, GPUs 6-7 free; m1 full. A critical 8-GPU job preempts the low job and
# is earmarked all of m0; a normal 2-GPU job queued behind it must not take m0's free GPUs meanwhile.

EARMARK_RUNNING = [_run("low", M0, range(6)), _guard(M1)]
OTHER = job("other").gpus(2).submitted(NOW + 1)


def test_earmark_cycle_one_preempts_and_keeps_the_free_gpus_for_the_claimant():
    snap = snapshot(fleet(machines=2), running=EARMARK_RUNNING, queue=[CRIT, OTHER], grace_period=120)
    result = cycle(snap)
    assert preempted(result) == ["low"]
    assert [p.grace_period for p in result.preemptions] == [120]
    [earmark] = result.earmarks
    assert earmark.job_id == "claim"
    assert sorted(earmark.gpus) == [(M0, g) for g in range(8)]
    assert earmark.expires > snap.now
    assert "other" not in placements(result), "the earmarked free GPUs went to another job"


def test_earmark_cycle_two_while_the_victim_drains_nobody_else_gets_the_gpus():
    snap1 = snapshot(fleet(machines=2), running=EARMARK_RUNNING, queue=[CRIT, OTHER])
    result1 = cycle(snap1)
    snap2 = after_preemption(snap1, result1, now=NOW + 30, victims_gone=False)
    result2 = cycle(snap2)
    assert not result2.preemptions, "a claimant with draining victims preempts nobody else"
    assert not result2.placements
    assert [e.job_id for e in result2.earmarks] == ["claim"]
    assert result2.earmarks[0].gpus == result1.earmarks[0].gpus
    assert "waiting for 1 preempted job(s)" in pending(result2)["claim"].reason


def test_earmark_cycle_three_once_the_victim_left_the_claimant_starts_on_exactly_its_earmark():
    snap1 = snapshot(fleet(machines=2), running=EARMARK_RUNNING, queue=[CRIT, OTHER])
    result1 = cycle(snap1)
    snap2 = after_preemption(snap1, result1, now=NOW + 130, victims_gone=True)
    result2 = cycle(snap2)
    placed = placements(result2)
    assert set(placed) == {"claim"}
    assert placed["claim"].gpus == result1.earmarks[0].gpus
    assert not result2.earmarks
    assert "other" in pending(result2)


def test_an_earmark_holds_even_against_a_higher_class_job_queued_later():
    """Between cycles a critical job arrives; it must not take the GPUs promised to the claimant."""
    snap1 = snapshot(fleet(machines=2), running=EARMARK_RUNNING, queue=[job("claim").gpus(8).priority("high").submitted(NOW)])
    result1 = cycle(snap1)
    assert preempted(result1) == ["low"]
    snap2 = after_preemption(snap1, result1, now=NOW + 130, victims_gone=True)
    snap2 = snap2.model_copy(update={"queue": snap2.queue + (job("vip").gpus(8).priority("critical").submitted(NOW + 100).queued(),)})
    result2 = cycle(snap2)
    placed = placements(result2)
    assert "vip" not in placed or not set(placed["vip"].gpus) & set(result1.earmarks[0].gpus)
    assert placed["claim"].gpus == result1.earmarks[0].gpus


def test_every_victim_gives_the_claimant_some_of_the_gpus_it_gets():
    """A 16-GPU block job; candidates in victim order: A (4 GPUs on m0, newest), B (8 on m1), C (8 on
    m2, oldest). B and C free two whole machines, which is all the job needs; A's 4 GPUs next to a
    critical job are no use to it. Preempting A anyway loses its work for nothing."""
    m2 = mid(0, 0, 2)
    run = [running(job("A").gpus(4).priority("low")).on(M0, range(4)).started(9000),
           _guard(M0, range(4, 8)),
           running(job("B").gpus(8).priority("low")).on(M1, range(8)).started(5000),
           running(job("C").gpus(8).priority("low")).on(m2, range(8)).started(1000)]
    snap = snapshot(fleet(machines=3), running=run, queue=[job("claim").gpus(16).priority("critical").submitted(NOW)])
    result = cycle(snap)
    [earmark] = result.earmarks
    assert len(earmark.gpus) == 16
    gpus_of = {r.spec.job_id: set(r.gpus) for r in snap.running}
    useless = [v for v in preempted(result) if not gpus_of[v] & set(earmark.gpus)]
    assert not useless, f"{useless} preempted, but the claimant's earmark {sorted(earmark.gpus)} uses none of their GPUs"


def test_an_earmark_on_a_machine_that_died_is_dropped_and_the_claimant_starts_elsewhere():
    """Cycle 1 earmarks m0 for the claimant. Before cycle 2, m0 stops answering (the victim is lost
    with it) and m2 frees up: the claimant starts on m2, and nothing is placed or earmarked on m0."""
    m2 = mid(0, 0, 2)
    run = EARMARK_RUNNING + [_guard(m2, name="guard-m2")]
    snap1 = snapshot(fleet(machines=3), running=run, queue=[CRIT])
    result1 = cycle(snap1)
    assert preempted(result1) == ["low"]
    snap2 = after_preemption(snap1, result1, now=NOW + 60, victims_gone=False)
    snap2 = snap2.model_copy(update={
        "machines": tuple(m.model_copy(update={"reachable": False}) if m.id == M0 else m for m in snap2.machines),
        "running": tuple(r for r in snap2.running if r.spec.job_id != "guard-m2"),
    })
    result2 = cycle(snap2)
    assert [(r.job_id, r.graceful) for r in result2.requeues] == [("low", False)]
    assert machines_of(placements(result2)["claim"].gpus) == {m2}
    assert not result2.earmarks


# A low job that resumed 1,000 s ago from 1,000 s of saved work, 2,030 s expected: by its estimate
# it ends 30 s from now, within half the grace; with a restart expected, later.
_ENDING = running(job("ending").gpus(8).priority("low").expected(2030)).on(M0, range(8)) \
    .started(NOW - 1000).resumed_from(1000)
SOON_CASES = [
    (0.0, [], "enough GPUs are expected to free up within half the grace period"),
    (25.0, [], "enough GPUs are expected to free up within half the grace period"),
    (60.0, ["ending"], "preempting ending"),
    (300.0, ["ending"], "preempting ending"),
]
SOON_IDS = [
    "no restart expected: the claimant waits for the job about to end",
    "a short restart still ends within half the grace: it waits",
    "a restart that makes it end after half the grace, though within the whole: the claimant preempts",
    "a restart that makes it end later: the claimant preempts instead",
]


@pytest.mark.parametrize("restart,victims,reason", SOON_CASES, ids=SOON_IDS)
def test_a_claimant_waits_for_gpus_about_to_free_up_counting_the_restart_a_resumed_job_needs(restart, victims,
                                                                                               reason):
    result = cycle(snapshot(fleet(machines=2), running=[_ENDING, _guard(M1)], queue=[CRIT],
                            expected_restart_s=restart))
    assert preempted(result) == victims
    assert pending(result)["claim"].reason.startswith(reason)


# The 4 GPUs of m0 that `ending` holds end by its estimate 30 s from now; m0's other 4 are free.
_ENDING_HALF = ends_in(30, "ending", M0, range(4))


def test_a_claimant_waiting_for_gpus_about_to_free_up_keeps_the_free_ones_it_counted():
    """It waited for `ending`'s GPUs and the 4 free beside them, but a job behind it took those
    4: when `ending` ended, the claimant found too few and displaced `low` after all, whose work
    since its checkpoint was lost (a helper's review of policy.md, Preemption 1)."""
    behind = job("behind").gpus(4).priority("low").expected(7200).submitted(NOW)
    snap = snapshot(fleet(machines=2), quotas={"*": {}}, running=[_ENDING_HALF, _run("low", M1)],
                    queue=[CRIT, behind])
    result = cycle(snap)
    assert preempted(result) == [] and placements(result) == {}
    assert pending(result)["claim"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert result.reservations == ()  # a wait of seconds, not a reservation
    assert pending(result)["behind"].estimated_start is not None
    ended = after_preemption(snap, result, now=NOW + 31)
    ended = ended.model_copy(update={"running": tuple(r for r in ended.running if r.spec.job_id != "ending")})
    after = cycle(ended)
    assert preempted(after) == [] and machines_of(placements(after)["claim"].gpus) == {M0}


def test_a_job_behind_a_claimant_waiting_for_gpus_about_to_free_up_may_use_the_free_ones_it_does_not_need():
    """Only the free GPUs the claimant counted are kept: its 6 are `ending`'s 4 and 2 of the 4
    free beside them. Keeping the machine whole made the jobs behind displace others instead."""
    claim = job("claim").gpus(6).topology("machine").priority("critical").submitted(NOW)
    behind = job("behind").gpus(2).priority("low").expected(7200).submitted(NOW)
    snap = snapshot(fleet(machines=2), quotas={"*": {}}, running=[_ENDING_HALF, _run("low", M1)],
                    queue=[claim, behind])
    result = cycle(snap)
    assert preempted(result) == [] and machines_of(placements(result)["behind"].gpus) == {M0}
    assert pending(result)["claim"].reason.startswith("enough GPUs are expected to free up within half the grace")
    ended = after_preemption(snap, result, now=NOW + 31)
    ended = ended.model_copy(update={"running": tuple(r for r in ended.running if r.spec.job_id != "ending")})
    after = cycle(ended)
    assert preempted(after) == [] and machines_of(placements(after)["claim"].gpus) == {M0}


def test_the_estimate_keeps_the_free_gpus_a_waiting_claimant_counted_from_the_jobs_behind_it():
    """The estimate's walk had `behind` start now on the 4 free GPUs kept for the claimant (its
    reason said the largest free is 0), and the claimant only once `behind` had ended."""
    behind = job("behind").gpus(4).priority("low").expected(7200).submitted(NOW)
    result = cycle(snapshot(fleet(machines=2), quotas={"*": {}}, running=[_ENDING_HALF, _run("low", M1)],
                            queue=[CRIT, behind]))
    assert pending(result)["claim"].estimated_start == NOW + 30
    assert pending(result)["behind"].estimated_start > NOW + 30


def test_the_estimate_keeps_a_waiting_claimant_s_free_gpus_from_a_job_behind_it_however_short():
    """Held in the walk as a reservation is, its room let a job that would end before the
    claimant's jobs do start on it now, though admission keeps those GPUs from everyone behind
    (a grace of 300 s: the claimant waits up to 150 s, more than the 60 s job)."""
    ending = ends_in(120, "ending", M0, range(4))
    short = job("short").gpus(4).priority("low").expected(60).submitted(NOW)
    result = cycle(snapshot(fleet(machines=2), quotas={"*": {}}, running=[ending, _run("low", M1)],
                            grace_period=300, queue=[CRIT, short]))
    assert pending(result)["claim"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert pending(result)["short"].reason == "needs 4 GPUs on one machine; the largest free is 0"
    assert pending(result)["short"].estimated_start > NOW + 120


def test_claimants_sharing_one_ending_job_s_gpus_are_both_estimated_to_start_as_it_ends():
    """`ending`'s 3 GPUs make a's room and b's: each one's room held the machine against the
    other in the estimate's walk, and both were told they never start."""
    ending = filler("ending", M0, [0, 1, 2]).started(NOW - 3600 + 30)
    low = running(job("low").gpus(1).priority("low").team("x")).on(M0, [3]).started(NOW - 5000)
    result = cycle(snapshot(fleet(machines=1, gpus=4), running=[ending, low],
                            queue=[job("a").gpus(1).priority("high").submitted(NOW - 20),
                                   job("b").gpus(2).priority("high").submitted(NOW - 10)]))
    assert not result.placements and not result.preemptions
    for job_id in ("a", "b"):
        told = pending(result)[job_id]
        assert told.reason.startswith("enough GPUs are expected to free up within half the grace"), told.reason
        assert told.estimated_start == NOW + 30


def test_a_starving_job_does_not_reserve_the_machine_a_claimant_waits_for():
    """r waits for `ending`'s machine m0; s, starving, reserved that very machine, and in the
    estimate each hold kept the other off it: r was told an hour, though told it waits 30 s."""
    ending = filler("ending", M0, range(8)).started(NOW - 3600 + 30)
    low = running(job("low").gpus(8).priority("low").team("x").expected(20_000)).on(M1, range(8)).started(NOW - 5000)
    result = cycle(snapshot(fleet(machines=2), running=[ending, low], quotas={"t": {"guaranteed": 8}},
                            queue=[job("r").gpus(8).priority("high").team("t").submitted(NOW - 30),
                                   job("s").gpus(8).priority("low").team("y").submitted(NOW - 4000)]))
    assert pending(result)["r"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert [h.machines for h in result.reservations] == [(M1,)]
    assert pending(result)["r"].estimated_start == NOW + 30


def test_a_claimant_waiting_for_a_machine_of_the_reserved_pool_is_estimated_to_start_as_it_frees_up():
    """`ending` leaves m0 whole, in the pool kept for `whole`: admission lets claimant a take it
    at once (it may displace others), but the walk kept the pool from it, and told it
    15,000 s where it starts in about a minute."""
    ending = filler("ending", M0, range(4)).started(NOW - 3600 + 30)
    low = running(job("low").gpus(4).priority("low").team("x").expected(20_000)).on(M1, range(4)).started(NOW - 5000)
    queue = [job("a").gpus(2).priority("high").submitted(NOW - 20),
             job("whole").gpus(4).priority("low").team("y").submitted(NOW - 10)]
    told = pending(cycle(snapshot(fleet(machines=2, gpus=4), running=[ending, low], queue=queue,
                                  reserved_pool_fraction=0.5)))["a"]
    assert told.reason.startswith("enough GPUs are expected to free up within half the grace"), told.reason
    assert told.estimated_start == NOW + 30
    later = snapshot(fleet(machines=2, gpus=4), running=[low], queue=queue, reserved_pool_fraction=0.5, now=NOW + 31)
    assert "a" in placements(cycle(later))


def test_a_job_fits_beside_a_claimant_on_the_whole_machine_of_the_pool_it_broke():
    """a may displace `low`, so it takes 2 GPUs of m0, kept whole for `big`; m0 is whole no more,
    and b, of a's shape, fits on its other 2. b was told the last whole machines are kept, from
    the no-fit a had found before it took the pool's GPUs."""
    busy = filler("busy", M1, [0, 1, 2]).started(NOW - 100)
    low = running(job("low").gpus(4).priority("low").team("x").expected(20_000)).on(M2, range(4)).started(NOW - 5000)
    result = cycle(snapshot(fleet(machines=3, gpus=4), running=[busy, low], reserved_pool_fraction=0.5, queue=[
        job("a").gpus(2).topology("any").priority("high").submitted(NOW - 30),
        job("b").gpus(2).topology("any").priority("low").submitted(NOW - 20),
        job("big").gpus(8).topology("block").priority("low").team("y").submitted(NOW - 10)]))
    assert machines_of(placements(result)["a"].gpus) == machines_of(placements(result)["b"].gpus) == {M0}
    assert not result.preemptions


def test_gpus_about_to_free_up_are_counted_for_one_waiting_claimant_only():
    """`ending`'s 4 GPUs make the first claimant's room. The second counted the same 4, waited
    half a grace for them too, and then found them taken and displaced `low` after all."""
    first = job("first").gpus(4).priority("critical").submitted(NOW)
    second = job("second").gpus(4).priority("critical").submitted(NOW + 1)
    snap = snapshot(fleet(machines=2), quotas={"*": {}},
                    running=[_ENDING_HALF, _guard(M0, gpus=range(4, 8)), _run("low", M1)],
                    queue=[first, second])
    result = cycle(snap)
    assert pending(result)["first"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert preempted(result) == ["low"]
    assert pending(result)["second"].reason.startswith("preempting low")


def test_a_job_whose_gpus_a_claimant_waits_for_is_not_displaced_for_the_job_behind_it():
    """`a` waits for `ending`'s 3 GPUs. `b` behind it displaced `ending` (which loses its work),
    and b's earmark took a GPU of a's room: once `ending` left, b started and a, first in the
    queue, waited for b."""
    ending = running(job("ending").gpus(3).priority("low").team("x").expected(3600)).on(M0, [0, 1, 2]) \
        .started(NOW - 3600 + 30)
    snap = snapshot(fleet(machines=1, gpus=4), running=[ending, filler("busy", M0, [3]).started(NOW - 100)],
                    queue=[job("a").gpus(3).priority("high").submitted(NOW - 20),
                           job("b").gpus(1).priority("high").submitted(NOW - 10)])
    result = cycle(snap)
    assert pending(result)["a"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert preempted(result) == [] and not result.earmarks
    gone = after_preemption(snap, result, now=NOW + 40, victims_gone=True)
    gone = gone.model_copy(update={"running": tuple(r for r in gone.running if r.spec.job_id != "ending")})
    assert "a" in placements(cycle(gone))


# `a` is stopping for nobody (cancelled), its grace ending at the time given; `b` could be displaced.
@pytest.mark.parametrize("stops_at,victims", [
    (NOW + 120, []),
    (NOW + 30, []),
    (NOW + 300, ["b"]),
], ids=["a job stopping by the end of a grace period: the claimant waits for its GPUs, displacing nobody",
        "one stopping sooner: the same",
        "one stopping later than a preemption would free GPUs: the claimant displaces b"])
def test_a_claimant_waits_for_the_gpus_of_a_job_already_stopping_rather_than_displace_another(stops_at, victims):
    """A cancelled job keeps its GPUs for its grace; a claimant displaced `b` meanwhile, whose
    GPUs its grace frees no sooner."""
    stopping = running(job("a").gpus(8).priority("low")).on(M0, range(8)).started(0).draining(stops_at)
    result = cycle(snapshot(fleet(machines=2), quotas={"*": {}}, running=[stopping, _run("b", M1, priority="normal")],
                            queue=[CRIT]))
    assert preempted(result) == victims
    if not victims:
        assert pending(result)["claim"].reason.startswith("enough GPUs are expected to free up")
        assert pending(result)["claim"].estimated_start == stops_at


# v (m0's GPUs 0-3) is checkpointing for claimant `c`, its grace ending in 60 s; u (m1) could be
# displaced; w (high, 4 GPUs) waits.
@pytest.mark.parametrize("claimant_waits,promise,max_of_c", [
    (False, True, None),
    (False, False, None),
    (True, True, 2),
], ids=["c was cancelled, its promise passed back: w waits for v's GPUs, displacing nobody",
        "c was cancelled, no promise passed back: the same",
        "c's team maximum was lowered under it: its promise is dropped, and w waits for v's GPUs"])
def test_a_victim_whose_claimant_no_longer_claims_its_gpus_frees_them_for_the_next_claimant(
        claimant_waits, promise, max_of_c):
    v = running(job("v").gpus(4).priority("low")).on(M0, range(4)).started(NOW - 5000).draining(NOW + 60, for_job="c")
    u = running(job("u").gpus(4).priority("low")).on(M1, range(4)).started(NOW - 5000)
    queue = [job("w").gpus(4).priority("high").queued()]
    if claimant_waits:
        queue.append(job("c").gpus(4).priority("critical").team("x").queued())
    snap = snapshot(fleet(machines=2), running=[v, u, filler("f0", M0, range(4, 8)), filler("f1", M1, range(4, 8))],
                    queue=queue, quotas={"x": {"guaranteed": 0, "max": max_of_c}} if max_of_c else None,
                    earmarks=[Earmark(job_id="c", gpus=tuple((M0, g) for g in range(4)), expires=NOW + 200)] if promise else [],
                    max_reservations=0, reserved_pool_fraction=0.0)
    result = cycle(snap)
    assert preempted(result) == []
    assert pending(result)["w"].reason.startswith("enough GPUs are expected to free up")
    assert not result.earmarks
    later = cycle(after_preemption(snap, result, now=NOW + 2))  # the promise dropped, v still leaving
    assert preempted(later) == [], "w displaced u the next cycle, for GPUs coming free anyway"


# --- GPUs about to free up, shared out among the claimants waiting for them ---------------------

WAITS = "enough GPUs are expected to free up within half the grace period"


# m0: 4 GPUs end in 30 s, the other 4 are busy; m1: a low job anyone critical may displace.
@pytest.mark.parametrize("sizes,waiting", [
    ((2, 2, 2), ["c0", "c1"]),
    ((2, 4), ["c0"]),
    ((4, 2), ["c0"]),
], ids=["two claimants of 2 share the 4 GPUs ending; the third displaces someone",
        "a claimant of 4 finds only the 2 the first left it and displaces someone",
        "a claimant of 4 counts all 4; the next finds none left"])
def test_the_gpus_of_jobs_ending_soon_are_shared_out_among_waiting_claimants_as_far_as_they_go(sizes, waiting):
    claimants = [job(f"c{k}").gpus(n).priority("critical").submitted(NOW + k) for k, n in enumerate(sizes)]
    result = cycle(snapshot(fleet(machines=2), quotas={"*": {}},
                            running=[ends_in(30, "ending", M0, range(4)), filler("busy", M0, range(4, 8)),
                                     _run("low", M1)],
                            queue=claimants))
    told = pending(result)
    assert [c.spec().job_id for c in claimants if told[c.spec().job_id].reason.startswith(WAITS)] == waiting
    assert preempted(result) == ["low"]


def test_a_claimant_waits_for_the_machine_whose_ending_jobs_make_most_of_its_room():
    """m1's ending jobs make all 6 GPUs of its room, m0's only 4: waiting on m1 keeps none of
    the free GPUs, and the 4 free on m0 are left to the job behind."""
    claim = job("claim").gpus(6).topology("machine").priority("critical").submitted(NOW)
    behind = job("behind").gpus(4).priority("low").expected(7200).submitted(NOW)
    run = [ends_in(30, "e0", M0, range(4)), ends_in(30, "e1", M1, range(6)), filler("f1", M1, [6, 7]),
           _run("low", M2)]
    result = cycle(snapshot(fleet(machines=3), quotas={"*": {}}, running=run, queue=[claim, behind]))
    assert pending(result)["claim"].reason.startswith(WAITS) and preempted(result) == []
    assert machines_of(placements(result)["behind"].gpus) == {M0}


def test_a_claimant_waits_only_for_jobs_ending_on_machines_it_may_use():
    """The inference machine's job ends in 30 s, but a training job may not run there: it
    displaces the low job rather than wait for GPUs it could never take."""
    inference = fleet(machines=1, partition="inference", first_block=1)
    machines = [*fleet(machines=1), *inference]
    run = [_run("low", M0), ends_in(30, "serving", inference[0].id, range(8))]
    result = cycle(snapshot(machines, quotas={"*": {}}, running=run,
                            queue=[job("claim").gpus(8).priority("critical").submitted(NOW)]))
    assert preempted(result) == ["low"]


def test_a_job_expected_to_end_exactly_as_half_the_grace_ends_is_waited_for():
    result = cycle(snapshot(fleet(machines=2), quotas={"*": {}},
                            running=[ends_in(60, "ending", M0, range(8)), _run("low", M1)],
                            queue=[job("claim").gpus(8).priority("critical").submitted(NOW)]))
    assert preempted(result) == [] and pending(result)["claim"].reason.startswith(WAITS)


# A 12-GPU claimant of the whole cluster: m0's 4 ending GPUs, then free ones from the freest machines.
def test_a_claimant_of_several_machines_keeps_only_the_free_gpus_its_room_needs_beside_the_ending_ones():
    """Its 12 are m0's 4 ending, m1's 6 free and 2 of m2's 3 free: the one left on m2 goes to
    the job behind; when the jobs end, the claimant starts displacing nobody."""
    claim = job("claim").gpus(12).topology("any").priority("critical").submitted(NOW)
    behind = job("behind").gpus(1).priority("low").expected(7200).submitted(NOW)
    run = [ends_in(30, "ending", M0, range(4)), filler("f0", M0, range(4, 8)), filler("f1", M1, [0, 1]),
           filler("f2", M2, range(5)), _run("low", mid(0, 0, 3))]
    snap = snapshot(fleet(machines=4), quotas={"*": {}}, running=run, queue=[claim, behind])
    result = cycle(snap)
    assert preempted(result) == [] and pending(result)["claim"].reason.startswith(WAITS)
    assert placements(result)["behind"].gpus == ((M2, 7),)


@pytest.mark.parametrize("claim,free_on_m1", [
    (job("claim").gpus(12).topology("block"), range(4, 8)),
    (job("claim").gpus(12).topology("any"), range(4, 8)),
], ids=["a block job whose block has exactly its room once the jobs end waits for them",
        "a job of the cluster with exactly its room once the jobs end waits for them"])
def test_a_claimant_waits_for_room_that_is_exactly_its_size(claim, free_on_m1):
    """m0's 8 GPUs end in 30 s and 4 of m1's are free: 12, just what it needs."""
    run = [ends_in(30, "ending", M0, range(8)), _run("low", M1, range(4)), _run("low2", M2)]
    result = cycle(snapshot(fleet(machines=3), quotas={"*": {}}, running=run,
                            queue=[claim.priority("critical").submitted(NOW)]))
    assert preempted(result) == [] and pending(result)["claim"].reason.startswith(WAITS)


def test_the_free_gpus_a_claimant_keeps_are_first_those_beside_the_ending_jobs():
    """Its 10 are m0's 4 ending, m0's 2 free, then 4 of m1's 6: the 2 left free on m1 go to the
    job behind (kept from m1 first, m0's 2 would have been left instead)."""
    claim = job("claim").gpus(10).topology("any").priority("critical").submitted(NOW)
    behind = job("behind").gpus(2).priority("low").expected(7200).submitted(NOW)
    run = [ends_in(30, "ending", M0, range(4)), filler("f0", M0, [4, 5]), filler("f1", M1, [0, 1]), _run("low", M2)]
    result = cycle(snapshot(fleet(machines=3), quotas={"*": {}}, running=run, queue=[claim, behind]))
    assert preempted(result) == [] and pending(result)["claim"].reason.startswith(WAITS)
    assert machines_of(placements(result)["behind"].gpus) == {M1}


def test_a_claimant_of_several_machines_counts_only_the_ending_gpus_it_needs():
    """The 10-GPU claimant counts m0's 8 and 2 of m1's 4 ending: the other 2 are the room of the
    2-GPU claimant behind it, which waits too rather than displace the low job."""
    first = job("first").gpus(10).topology("any").priority("critical").submitted(NOW)
    second = job("second").gpus(2).priority("critical").submitted(NOW + 1)
    run = [ends_in(30, "e0", M0, range(8)), ends_in(30, "e1", M1, range(4)), filler("f1", M1, range(4, 8)),
           _run("low", M2)]
    result = cycle(snapshot(fleet(machines=3), quotas={"*": {}}, running=run, queue=[first, second]))
    assert preempted(result) == []
    assert pending(result)["first"].reason.startswith(WAITS) and pending(result)["second"].reason.startswith(WAITS)


def test_a_claimant_does_not_wait_for_gpus_ending_on_machines_a_reservation_holds_against_it():
    """m1's job ends in 30 s, but the starving `A` holds m0 and m1 from then: C, which would
    still run then, displaces the low job on m2 rather than wait for GPUs it may not take."""
    starving = job("A").gpus(16).topology("block").priority("low").submitted(0)
    claim = job("C").gpus(8).priority("normal").expected(36000).submitted(NOW)
    result = cycle(snapshot(fleet(machines=3), quotas={"*": {}},
                            running=[ends_in(30, "ending", M1, range(8)), _run("low", M2)], queue=[starving, claim]))
    assert [r.job_id for r in result.reservations] == ["A"]
    assert preempted(result) == ["low"]


def test_a_starving_job_that_may_displace_nobody_reserves_the_gpus_about_to_free_up():
    """A low job may displace nobody, so it was told it waits for the GPUs freeing up "instead of
    preempting", held no reservation, and a 2-hour job behind it took the free GPUs beside
    them: its start moved from about 2 h 47 min to 4 h 47 min."""
    starving = job("x").gpus(8).priority("low").expected(7200).submitted(0.0)
    behind = job("y").gpus(4).priority("low").expected(7200).submitted(5000.0)
    busy = running(job("busy").gpus(4).priority("critical").team("o").expected(36000)).on(M1, range(4)).started(0.0)
    result = cycle(snapshot(fleet(machines=2), quotas={"*": {}}, running=[_ENDING_HALF, busy],
                            queue=[starving, behind]))
    [held] = result.reservations
    assert held.job_id == "x" and held.machines == (M0,)
    assert machines_of(placements(result)["y"].gpus) == {M1}
    assert "instead of preempting" not in pending(result)["x"].reason


@pytest.mark.parametrize("running", [
    [_run("r0", M1, started=0)],
    [_run("r0", M1, gpus=[7], started=0), _guard(M1, gpus=range(7))],
], ids=["the victim holds a whole machine",
        "the victim's machine is otherwise full, so best fit with the victim gone would choose it"])
def test_a_claimant_gets_the_reserved_pool_s_free_gpus_rather_than_displace_anyone(running):
    # The reserved pool keeps m0 whole while the 8-GPU job waits; the high 1-GPU job, entitled to
    # displace r0, starts on a free GPU of m0 instead: at once, and nobody loses work.
    snap = snapshot(fleet(machines=2, gpus=8), reserved_pool_fraction=0.005, running=running,
                    queue=[job("small").gpus(1).priority("high").submitted(9000),
                           job("big").gpus(8).priority("low").submitted(9000)])
    result = cycle(snap)
    assert not result.preemptions and not result.earmarks
    assert machines_of(placements(result)["small"].gpus) == {M0}


def test_a_team_s_maximum_counts_the_gpus_promised_to_its_waiting_jobs():
    # Team t may hold 8 GPUs: once r0 is preempted for q1, nobody is displaced for q2.
    snap = snapshot(fleet(machines=2, gpus=8),
                    running=[_run("r0", M0, team="o"), _run("r1", M1, team="o")],
                    queue=[job("q1").gpus(8).priority("high").team("t").submitted(9000),
                           job("q2").gpus(8).priority("high").team("t").submitted(9001)],
                    quotas={"t": {"guaranteed": 0, "max": 8}, "o": {"guaranteed": 0}})
    result = cycle(snap)
    assert len(preempted(result)) == 1
    assert "at its maximum (0 of 8 GPUs held, 8 promised to its waiting jobs)" in pending(result)["q2"].reason


# --- a machine that takes no work (its agent owes an answer) frees nothing for anyone -----------


def test_a_job_on_a_machine_taking_no_work_is_not_preempted_for_room_it_cannot_give():
    machines = silent(fleet(machines=3), mid(0, 0, 0))
    run = [_run(f"l{i}", mid(0, 0, i), started=NOW - 1000 - 1000 * i) for i in range(3)]  # l0 the newest
    result = cycle(snapshot(machines, running=run, queue=[job("claim").gpus(16).priority("critical").submitted(NOW)]))
    assert set(preempted(result)) == {"l1", "l2"}


def test_a_claimant_does_not_wait_for_a_job_ending_on_a_machine_taking_no_work():
    machines = silent(fleet(machines=2), M0)
    run = [filler("ending", M0, range(8), expected=NOW + 30), _run("low", M1)]
    result = cycle(snapshot(machines, running=run, queue=[CRIT]))
    assert preempted(result) == ["low"]


@pytest.mark.parametrize("started", [1_000_000.0, 65462.326605751245],
                         ids=["a start whose protection's end floats add exactly",
                              "a start whose protection's end floats round down"])
def test_a_claimant_waiting_for_a_protection_to_end_is_looked_at_again_when_it_has(started):
    """The wake was written start + min_runtime, which floats may round below what the decision
    asks (now - start >= min_runtime): the cycle woke to find the job still protected, and the
    claimant waited for something else to happen (21 minutes in the case found)."""
    young = _run("young", M0, started=started)
    claim = job("claim").gpus(8).priority("critical").submitted(started + 50)
    result = cycle(snapshot(fleet(machines=1), running=[young], queue=[claim], now=started + 100))
    assert not preempted(result) and result.next_wake is not None
    assert preempted(cycle(snapshot(fleet(machines=1), running=[young], queue=[claim], now=result.next_wake))) == ["young"]


def test_a_claimant_waiting_for_jobs_expected_to_end_is_looked_at_again_as_that_half_grace_ends():
    """Estimates are wrong both ways: if the job that should have ended has not, the claimant
    displaces it then, not whenever something else happens."""
    result = cycle(snapshot(fleet(machines=2), running=[_ENDING, _guard(M1)], queue=[CRIT]))
    assert not preempted(result) and result.next_wake == NOW + 60 + 1
    later = cycle(snapshot(fleet(machines=2), running=[_ENDING, _guard(M1)], queue=[CRIT], now=NOW + 61))
    assert preempted(later) == ["ending"]


_YOUNG = _run("young", M0, team="a", started=NOW - 100)  # protected until NOW + 500 (min_runtime 600)
_OTHER = _run("other", M1, range(4), team="a", started=NOW - 50)  # protected until NOW + 550
_DRAINING = running(job("stopping").gpus(4).priority("low").team("a")).on(M1, range(4, 8)) \
    .started(NOW - 50).draining(NOW + 300)


@pytest.mark.parametrize("waiter, quotas, drain, wake", [
    ("low", None, False, None),
    ("normal", None, False, NOW + 500),
    ("low", {"a": {"guaranteed": 0}, "b": {"guaranteed": 8}}, False, NOW + 500),
    ("low", None, True, NOW + 300),
    ("normal", None, True, NOW + 300),
], ids=["only the lowest class waits: a protection ending changes nothing, and the cycle sleeps",
        "a more important class waits: the cycle wakes as the lowest class's protection ends",
        "the lowest class waits under its guarantee: the cycle wakes as the borrowed job's protection ends",
        "only the lowest class waits: the cycle wakes as a drain ends",
        "a more important class waits: the cycle wakes at the drain's end, before the protection's"])
def test_a_cycle_wakes_when_a_waiting_job_could_first_be_decided_otherwise(waiter, quotas, drain, wake):
    """A 4-GPU waiter of team b on a full cluster of jobs too young to preempt: it never starves
    (less than a machine) and no idle GPUs invite a move; what can change its fate is a drain
    ending, or the end of a protection it may break."""
    queue = [job("waiter").gpus(4).priority(waiter).team("b").submitted(NOW)]
    run = [_YOUNG, _OTHER, _DRAINING if drain else _run("another", M1, range(4, 8), team="a", started=NOW - 50)]
    result = cycle(snapshot(fleet(machines=2), running=run, queue=queue, quotas=quotas))
    assert not preempted(result) and not placements(result)
    assert result.next_wake == wake


# --- the jobs exposed to claimants of each class ------------------------------------------------------


@pytest.mark.parametrize("asked", [(3, 2, 1, 0), (0, 1, 2, 3), ("all", 2, 0, 3), (1, "all", 3, 0, 2)])
def test_the_jobs_below_a_class_are_the_same_in_whatever_order_the_classes_are_asked(asked):
    """Exposed.below takes a class's list from a wider one already found: it must hold the same
    jobs in the same order as a plain look at every running job."""
    import random

    from scheduler.preemption import Exposed

    rng = random.Random(len(asked))
    classes = ("critical", "high", "normal", "low")
    jobs = [running(job(f"j{k}").priority(rng.choice(classes))).on(mid(0, 0, k % 4), [k // 4]).build()
            for k in range(24)]
    protected = {j.spec.job_id for j in jobs if rng.random() < 0.3}
    exposed = Exposed(jobs, lambda j: j.spec.job_id not in protected)
    for rank in asked:
        if rank == "all":
            assert exposed.jobs == [j for j in jobs if j.spec.job_id not in protected]
        else:
            assert exposed.below(rank) == [j for j in jobs if j.spec.priority.rank > rank
                                           and j.spec.job_id not in protected]


def test_a_claimant_does_not_wait_for_gpus_about_to_free_up_that_an_earlier_claimant_took_this_cycle():
    """E ends in 30 s, but A (first in the queue) preempts E and F for the whole of m0: E's GPUs
    are A's. Before, B was told they would free up for it and waited a grace period to preempt Y."""
    held = [running(job("E").gpus(2).priority("low").expected(NOW + 30)).on(M0, [0, 1]).started(0),
            running(job("F").gpus(6).priority("low").expected(50000)).on(M0, range(2, 8)).started(0),
            running(job("Y").gpus(2).priority("low").expected(50000)).on(M1, [0, 1]).started(0),
            filler("c", M1, range(2, 8), expected=50000)]
    queue = [job("A").gpus(8).priority("high").submitted(NOW - 10).queued(),
             job("B").gpus(2).priority("high").submitted(NOW).queued()]
    result = cycle(snapshot(fleet(machines=2), running=held, queue=queue))
    assert sorted((p.job_id, p.for_job) for p in result.preemptions) == [("E", "A"), ("F", "A"), ("Y", "B")]


def test_gpus_a_draining_job_leaves_to_its_claimant_are_not_waited_for_by_another():
    """v leaves m0 to c in 10 s; d, behind c, would have waited for those GPUs instead of preempting L."""
    v = running(job("v").gpus(8).priority("low")).on(M0, range(8)).started(NOW - 5000).draining(NOW + 10, for_job="c")
    low = running(job("L").gpus(8).priority("low")).on(M1, range(8)).started(0)
    earmark = Earmark(job_id="c", gpus=tuple((M0, g) for g in range(8)), expires=NOW + 240)
    queue = [job("c").gpus(8).priority("high").submitted(NOW - 60), job("d").gpus(8).priority("high").submitted(NOW)]
    result = cycle(snapshot(fleet(machines=2), running=[v, low], queue=queue, earmarks=[earmark]))
    assert preempted(result) == ["L"] and [p.for_job for p in result.preemptions] == ["d"]


def test_a_lapsed_earmark_holds_nothing():
    earmark = Earmark(job_id="c", gpus=tuple((M0, g) for g in range(8)), expires=NOW - 1)
    queue = [job("x").gpus(8).priority("critical").submitted(NOW), job("c").gpus(8).priority("low").submitted(NOW)]
    result = cycle(snapshot(fleet(), queue=queue, earmarks=[earmark]))
    assert list(placements(result)) == ["x"] and not result.earmarks


def test_the_estimate_keeps_a_waiting_claimant_s_free_gpus_on_another_machine_from_the_job_behind_it():
    """The 12-GPU claimant waits for m0's 4 ending GPUs and keeps m1's 6 free and 2 of m2's 3; the
    job behind needs 2 GPUs on one machine for two hours. Admission left it m2's last GPU only,
    so it waits; the walk must not start it now on m1's free GPUs that the claimant kept."""
    claim = job("claim").gpus(12).topology("any").priority("critical").submitted(NOW)
    behind = job("behind").gpus(2).priority("low").expected(7200).submitted(NOW)
    low = running(job("low").gpus(8).priority("low")).on(mid(0, 0, 3), range(8))
    run = [ends_in(30, "ending", M0, range(4)), filler("f0", M0, range(4, 8)), filler("f1", M1, [0, 1]),
           filler("f2", M2, range(5)), low]
    result = cycle(snapshot(fleet(machines=4), quotas={"*": {}}, running=run, queue=[claim, behind]))
    assert preempted(result) == [] and pending(result)["claim"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert "behind" in pending(result)
    assert pending(result)["behind"].estimated_start > NOW + 30


def _low_ends_in(job_id, machine, gpus, in_s=30):
    """A low job of team x (anyone's victim) expected to end `in_s` seconds from now."""
    gpus = list(gpus)
    return running(job(job_id).gpus(len(gpus)).priority("low").team("x").expected(3600)).on(machine, gpus) \
        .started(NOW - 3600 + in_s)


# (name, the GPU type of: first claimant, second claimant, the job behind them). m0 (e0's) is of
# type "A", m1 (e1's) of type "B": the job behind may use only the machine of one of them.
WHOSE = [
    ("the job ending under the first claimant's room is displaced for nobody behind", ("A", "B", "A")),
    ("the job ending under the second claimant's room is displaced for nobody behind", ("B", "A", "A")),
]


@pytest.mark.parametrize("types", [w[1] for w in WHOSE], ids=[w[0] for w in WHOSE])
def test_the_jobs_every_waiting_claimant_counts_on_are_displaced_for_nobody_behind(types):
    """`first` and `second` each wait for the job ending on the machine of their
    type; `third`, behind them, may use only the machine of type A, whose ending job is the first
    claimant's in one row and the second's in the other. With that claimant's jobs forgotten, it
    displaced the job the claimant waits for and took its room."""
    machines = [m.model_copy(update={"gpu_type": "A" if m.id == M0 else "B"}) for m in fleet(machines=2, gpus=4)]
    run = [_low_ends_in("e0", M0, range(4)), _low_ends_in("e1", M1, range(4))]
    queue = [job(name).gpus(4).priority("high").gpu_type(t).submitted(NOW - 30 + 10 * k)
             for k, (name, t) in enumerate(zip(("first", "second", "third"), types))]
    result = cycle(snapshot(machines, running=run, queue=queue))
    assert pending(result)["first"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert pending(result)["second"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert preempted(result) == [] and not result.earmarks
    assert "third" in pending(result)


def test_a_job_ending_beside_a_claimant_s_room_may_still_be_displaced_for_the_job_behind():
    """`a` waits for e0 on m0. `b` needs all of m1: e1 ends there soon but leaves
    it short (the long low job holds the rest), so b displaces both. Counting e1 as a's made b
    wait with a free-able machine beside it."""
    run = [_low_ends_in("e0", M0, range(8)), _low_ends_in("e1", M1, range(4)),
           running(job("long").gpus(4).priority("low").team("x").expected(20_000)).on(M1, range(4, 8))
           .started(NOW - 5000)]
    queue = [job("a").gpus(8).priority("high").submitted(NOW - 20),
             job("b").gpus(8).priority("high").submitted(NOW - 10)]
    result = cycle(snapshot(fleet(machines=2), running=run, queue=queue))
    assert pending(result)["a"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert sorted(preempted(result)) == ["e1", "long"]
    assert pending(result)["b"].reason.startswith("preempting")


def test_a_claimant_behind_a_waiting_one_leaves_its_room_s_ending_job_to_end_on_its_own_time():
    """Were the jobs a claimant waits for taken as told to leave, `b`'s search made e0, which a waits for, one of the jobs leaving: told it ends its grace
    (minutes) rather than in 30 s, the walk told a it starts later than the 30 s it waits."""
    run = [_low_ends_in("e0", M0, [0, 1, 2]), filler("busy", M0, [3]).started(NOW - 100)]
    queue = [job("a").gpus(3).priority("high").submitted(NOW - 20),
             job("b").gpus(1).priority("high").submitted(NOW - 10)]
    result = cycle(snapshot(fleet(machines=1, gpus=4), running=run, queue=queue))
    assert pending(result)["a"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert pending(result)["a"].estimated_start == NOW + 30


def test_a_starving_job_reserves_none_of_the_machines_already_reserved_while_a_claimant_waits():
    """`a` waits for e0 on m0; s0 reserves m1 (free first); s1 reserved m1 too,
    two reservations on one machine, rather than m2."""
    run = [_low_ends_in("e0", M0, range(8)),
           filler("r1", M1, range(8), expected=NOW + 1000), filler("r2", M2, range(8), expected=NOW + 2000),
           filler("r3", mid(0, 0, 3), range(8), expected=NOW + 3000)]
    # a starves too (queued as long), so it is admitted ahead of s0 and s1, as its class says
    queue = [job("a").gpus(8).priority("high").submitted(-10),
             job("s0").gpus(8).submitted(0), job("s1").gpus(8).submitted(1)]
    result = cycle(snapshot(fleet(machines=4), running=run, queue=queue, max_reservations=2))
    assert pending(result)["a"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert [(r.job_id, r.machines) for r in result.reservations] == [("s0", (M1,)), ("s1", (M2,))]



def test_a_waiting_claimant_is_estimated_to_start_in_its_room_not_on_a_machine_a_starving_job_reserved():
    """A claimant waiting for its room is exempt from the other claimants' rooms, not from
    reservations. s, starving, is admitted first and reserves m1, free
    in 5 s; `a` waits for e0's m0, free in 250 s (grace 600 s). The walk put `a` on s's m1 at
    5 s, where the next cycle gives m1 to s (admitted first) and `a` starts on m0 at 250 s."""
    e0 = running(job("e0").gpus(8).team("x").expected(3600)).on(M0, range(8)).started(NOW - 3600 + 250)
    run = [e0, filler("f", M1, range(8), started=NOW - 3600 + 5)]
    queue = [job("s").gpus(8).submitted(0), job("a").gpus(8).priority("high").submitted(NOW - 20)]
    result = cycle(snapshot(fleet(machines=2), running=run, queue=queue, grace_period=600))
    assert [(r.job_id, r.machines, r.expected_start) for r in result.reservations] == [("s", (M1,), NOW + 5)]
    assert pending(result)["a"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert pending(result)["a"].estimated_start == NOW + 250
    # and so it is: at 5 s, s starts on m1 and `a` still waits for m0
    later = cycle(snapshot(fleet(machines=2), running=[e0], queue=queue, now=NOW + 5, grace_period=600))
    assert machines_of(placements(later)["s"].gpus) == {M1}
    assert "a" in pending(later)


def test_a_claimant_behind_another_is_not_estimated_to_start_on_the_free_gpus_that_one_keeps():
    """a waits for `e`'s 2 GPUs beside m0's 6 free ones, which it keeps; b waits for `f`'s 6 on m1.
    In the walk b started at once on a's 6 kept GPUs (rooms held nothing against each other): told
    it starts now, though admission keeps them from it."""
    low = running(job("low").gpus(2).priority("low").team("x")).on(M1, [6, 7]).started(NOW - 5000)
    result = cycle(snapshot(fleet(machines=2), running=[ends_in(30, "e", M0, [6, 7]), ends_in(30, "f", M1, range(6)), low],
                            queue=[job("a").gpus(8).priority("high").submitted(NOW - 20),
                                   job("b").gpus(6).priority("high").submitted(NOW - 10)],
                            reserved_pool_fraction=0.0))
    assert not result.placements and not result.preemptions
    assert pending(result)["a"].estimated_start == pending(result)["b"].estimated_start == NOW + 30


def test_a_claimant_waiting_for_its_room_is_not_estimated_to_start_now_on_the_reserved_pool():
    """c waits for `e` (10 s) rather than take m0, kept whole for `big`: admission asks that first.
    The walk let a claimant waiting for its room take the pool at once: told it starts now."""
    low = running(job("low").gpus(2).priority("low").team("x")).on(M1, [2, 3]).started(NOW - 5000)
    run = [ends_in(10, "e", M1, [0, 1]), low, filler("f2", M2, range(4), expected=20000),
           filler("f3", mid(0, 0, 3), range(4), expected=20000)]
    result = cycle(snapshot(fleet(machines=4, gpus=4), running=run, reserved_pool_fraction=0.5,
                            queue=[job("big").gpus(8).submitted(NOW - 100),
                                   job("c").gpus(2).priority("critical").submitted(NOW - 10)]))
    assert "c" not in placements(result)
    assert pending(result)["c"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert pending(result)["c"].estimated_start == NOW + 10


def test_a_claimant_does_not_wait_for_room_on_a_machine_reserved_for_when_it_would_still_run():
    """S reserves both machines from NOW+1000. c (990 s) would end before that if it started now,
    so it counted a room on m0, reserved, where `e` ends in 20 s; but it would start only then, and
    run past S's start. In the walk c's room held m0 against S and S's hold kept c off it: S, c and
    the job behind were all told they never start."""
    x = running(job("x").gpus(1).priority("low").team("x").expected(6000)).on(M1, [3]).started(NOW - 5000)
    result = cycle(snapshot(fleet(machines=2, gpus=4), reserved_pool_fraction=0.0,
                            running=[ends_in(20, "e", M0, [0, 1]), filler("L", M1, [0, 1, 2], expected=NOW + 1000), x],
                            queue=[job("S").gpus(8).submitted(NOW - 4000), job("c").gpus(4).expected(990).submitted(NOW - 10),
                                   job("after").gpus(1).priority("low").submitted(NOW - 5)]))
    assert [(r.job_id, r.expected_start) for r in result.reservations] == [("S", NOW + 1000)]
    assert not pending(result)["c"].reason.startswith("enough GPUs are expected to free up")
    assert all(p.estimated_start is not None for p in result.pending), [(p.job_id, p.reason) for p in result.pending]


def test_a_claimant_waiting_for_its_room_counts_against_its_team_s_maximum():
    """Team b may hold 5. a (3 GPUs) waits for `e`'s 3; b, of its team and behind it, displaced
    `low` for 3 more with the headroom a counted on: a low job lost its work for b, and when the
    room freed, a was over the maximum and waited an hour beside it."""
    low = running(job("low").gpus(8).priority("low").team("x").expected(20000)).on(M1, range(8)).started(NOW - 5000)
    snap = snapshot(fleet(machines=2), quotas={"b": {"guaranteed": 0, "max": 5}}, reserved_pool_fraction=0.0,
                    running=[ends_in(30, "e", M0, [0, 1, 2]), filler("f0", M0, range(3, 8), expected=20000), low],
                    queue=[job("a").gpus(3).priority("critical").team("b").submitted(NOW - 20),
                           job("b").gpus(3).priority("high").team("b").submitted(NOW - 10)])
    result = cycle(snap)
    assert pending(result)["a"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert preempted(result) == []
    assert pending(result)["b"].reason == "team b would pass its maximum with this job's 3 GPUs (0 of 5 GPUs held, 3 promised to its waiting jobs)"
    later = after_preemption(snap, result, now=NOW + 31, victims_gone=True)
    later = later.model_copy(update={"running": tuple(r for r in later.running if r.spec.job_id != "e")})
    assert "a" in placements(cycle(later))


def test_a_claimant_whose_earmark_broke_on_a_sick_gpu_waits_for_its_victim_s_healthy_gpus():
    """c displaced v (m0's GPUs 0-3, grace ends in 36 s); m0's GPU 0 then turns sick, and c's
    earmark is dropped. v's healthy GPUs 1-3 and m0's free GPU 7 make c's 4 in 36 s: it waits for
    them, as for a cancelled job's, where it displaced f1 (its work lost)."""
    v = running(job("v").gpus(4).priority("low").team("x")).on(M0, [0, 1, 2, 3]).started(NOW - 5000).draining(NOW + 36, "c")
    f1 = running(job("f1").gpus(8).priority("low").team("z").expected(20000)).on(M1, range(8)).started(NOW - 5000)
    earmark = Earmark(job_id="c", gpus=tuple((M0, g) for g in range(4)), expires=NOW + 300)
    result = cycle(snapshot(unhealthy(fleet(machines=2), M0, [0]), reserved_pool_fraction=0.0,
                            running=[v, filler("f0", M0, range(4, 7), expected=20000), f1],
                            queue=[job("c").gpus(4).priority("critical").submitted(NOW - 100)], earmarks=[earmark]))
    assert preempted(result) == []
    assert pending(result)["c"].reason.startswith("enough GPUs are expected to free up within half the grace")


def test_the_estimate_counts_a_waiting_claimant_s_gpus_against_its_team_s_maximum():
    """Team b may hold 5. a (4 GPUs) waits for `e`'s 3 and m0's free one; b, of its team and
    behind it, is told it would pass the maximum. The walk, without a's promise, started b at
    once on m1's 2 free GPUs and then found a over the maximum: b told now, a an hour."""
    low = running(job("low").gpus(6).priority("low").team("x").expected(20000)).on(M1, range(6)).started(NOW - 5000)
    result = cycle(snapshot(fleet(machines=2), quotas={"b": {"guaranteed": 0, "max": 5}}, reserved_pool_fraction=0.0,
                            running=[ends_in(30, "e", M0, [0, 1, 2]), filler("f0", M0, range(3, 7), expected=20000), low],
                            queue=[job("a").gpus(4).priority("critical").team("b").submitted(NOW - 20),
                                   job("b").gpus(2).priority("high").team("b").submitted(NOW - 10)]))
    assert pending(result)["a"].reason.startswith("enough GPUs are expected to free up within half the grace")
    assert pending(result)["b"].reason.startswith("team b would pass its maximum")
    assert pending(result)["a"].estimated_start == NOW + 30
    assert pending(result)["b"].estimated_start > NOW + 30
