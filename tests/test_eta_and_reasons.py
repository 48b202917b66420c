"""What a waiting job is told: its position, when it should start, whether it misses its deadline, why."""

from __future__ import annotations

import itertools

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
    pending_order,
    placements,
    preempted,
    running,
    snapshot,
)

from scheduler import in_words


M = [mid(0, 0, i) for i in range(4)]


def _ends_at(job_id, machine, gpus, end, priority="critical"):
    """A running job (critical: nobody preempts it) expected to release its GPUs at `end`."""
    gpus = list(gpus)
    spec = job(job_id).gpus(len(gpus)).priority(priority).expected(end - (NOW - 100))
    return running(spec).on(machine, gpus).started(NOW - 100)


# Four full machines, released at NOW+1000, +2000, +3000, +4000.
FULL = [_ends_at(f"r{i}", M[i], range(8), NOW + 1000 * (i + 1)) for i in range(4)]


def _identical(k):
    """k 8-GPU jobs alike in all but their id and submit order."""
    return [job(f"q{i}").gpus(8).expected(3600).submitted(NOW + i) for i in range(k)]


def test_positions_are_one_to_k_in_queue_order():
    queue = _identical(5)
    result = cycle(snapshot(fleet(machines=4), running=FULL, queue=queue))
    assert not result.placements
    assert [p.position for p in result.pending] == [1, 2, 3, 4, 5]
    assert pending_order(result) == ["q0", "q1", "q2", "q3", "q4"]


def test_etas_increase_along_the_queue_for_identical_jobs_behind_a_full_cluster():
    result = cycle(snapshot(fleet(machines=4), running=FULL, queue=_identical(6)))
    etas = [pending(result)[f"q{i}"].estimated_start for i in range(6)]
    assert etas[:4] == [NOW + 1000, NOW + 2000, NOW + 3000, NOW + 4000]
    assert etas[4:] == [NOW + 1000 + 3600, NOW + 2000 + 3600]
    assert all(a < b for a, b in itertools.pairwise(etas)), etas


def test_etas_are_never_before_now():
    overdue = [running(job(f"o{i}").gpus(8).priority("critical").expected(100)).on(M[i], range(8)).started(0)
               for i in range(4)]
    result = cycle(snapshot(fleet(machines=4), running=overdue, queue=_identical(6)))
    for p in result.pending:
        assert p.estimated_start is not None and p.estimated_start >= NOW


def test_a_job_that_can_never_fit_has_no_eta():
    result = cycle(snapshot(fleet(machines=2), queue=[job("huge").gpus(24).topology("block").submitted(NOW)]))
    p = pending(result)["huge"]
    assert p.estimated_start is None
    assert p.reason == "needs 24 GPUs in one block; the most free in a block is 16"


# --- the restart a resumed job is expected to need ---------------------------------------------------

def _critical_until(end, *, resumed=False, preempted=False):
    """A critical job (nobody displaces it) on the one machine that started 100 s ago and is
    expected to end at `end`; a resumed one had done 500 s before it."""
    done = 500.0 if resumed else 0.0
    r = running(job("r").gpus(8).priority("critical").expected(end - (NOW - 100) + done)).on(M[0], range(8))
    r = r.started(NOW - 100).resumed_from(done)
    return r.preempted_at(NOW - 5000) if preempted else r


RESTART_CASES = [
    (0.0, _critical_until(NOW + 1000, resumed=True), NOW + 1000),
    (300.0, _critical_until(NOW + 1000), NOW + 1000),
    (300.0, _critical_until(NOW + 1000, resumed=True), NOW + 1300),
    (300.0, _critical_until(NOW + 1000, preempted=True), NOW + 1300),
]
RESTART_IDS = [
    "no restart expected: a resumed job ends at its estimate",
    "a first attempt pays no restart",
    "an attempt resumed from a checkpoint ends its restart later",
    "an attempt after a preemption ends its restart later",
]


@pytest.mark.parametrize("restart,run,expected", RESTART_CASES, ids=RESTART_IDS)
def test_a_resumed_running_job_is_expected_to_give_its_gpus_back_a_restart_later(restart, run, expected):
    result = cycle(snapshot(fleet(machines=1), running=[run], queue=[job("q").gpus(8).submitted(NOW)],
                            expected_restart_s=restart))
    assert pending(result)["q"].estimated_start == expected


def test_a_queued_job_that_will_resume_holds_its_gpus_a_restart_longer_in_the_walk():
    """q1 resumes with 3,000 s of work left and a 300 s restart; q2, behind it, starts after both."""
    q1 = job("q1").gpus(8).expected(3600).submitted(NOW - 10).queued(progress=600)
    q2 = job("q2").gpus(8).expected(3600).submitted(NOW)
    result = cycle(snapshot(fleet(machines=1), running=FULL[:1], queue=[q1, q2], expected_restart_s=300.0))
    assert pending(result)["q1"].estimated_start == NOW + 1000
    assert pending(result)["q2"].estimated_start == NOW + 1000 + 3000 + 300


# --- the walk follows admission as what teams hold changes ----------------------------------------

# One machine, held by a team within its guarantee (so nobody may reclaim it) until NOW+1000.
ONE_FULL = [filler("f", M[0], range(8), team="ops", expected=1100, started=NOW - 100)]
# Three machines released one by one, at NOW+1000, +2000 and +3000.
THREE_FULL = [filler(f"f{i}", M[i], range(8), team="ops", expected=1100 + 1000 * i, started=NOW - 100)
              for i in range(3)]


def _owed_and_borrowing(owed: int):
    """`owed` low jobs (running 10,000 s) of a team owed 8 GPUs, behind (in class order) a high job
    (running 3,600 s) of a team owed none."""
    queue = [job("borrower").gpus(8).priority("high").team("big").submitted(NOW)]
    queue += [job(f"owed{i}").gpus(8).priority("low").team("owed").expected(10_000).submitted(NOW + 1 + i)
              for i in range(owed)]
    return queue


WALK_CASES = [
    (1, ONE_FULL, _owed_and_borrowing(1), {"owed0": NOW + 1000, "borrower": NOW + 11_000}),
    (2, THREE_FULL[:2], _owed_and_borrowing(2), {"owed0": NOW + 1000, "borrower": NOW + 2000, "owed1": NOW + 5600}),
    (3, THREE_FULL,
     [job("x1").gpus(8).team("x").expected(10_000).submitted(NOW),
      job("x2").gpus(8).team("x").expected(10_000).submitted(NOW + 1),
      job("y1").gpus(8).team("y").expected(10_000).submitted(NOW + 2)],
     {"x1": NOW + 1000, "y1": NOW + 2000, "x2": NOW + 3000}),
]
WALK_QUOTAS = {"ops": {"guaranteed": 24}, "owed": {"guaranteed": 8}, "big": {"guaranteed": 0},
               "x": {"guaranteed": 16}, "y": {"guaranteed": 16}}
WALK_IDS = [
    "a job its team's guarantee covers is estimated to start before a more important borrower",
    "once the walk fills a team's guarantee, its next job waits its turn among the borrowers",
    "as the walk starts a team's jobs, the team further below its guarantee goes first",
]


@pytest.mark.parametrize("machines,run,queue,starts", WALK_CASES, ids=WALK_IDS)
def test_the_walk_orders_jobs_as_admission_will(machines, run, queue, starts):
    result = cycle(snapshot(fleet(machines=machines), running=run, queue=queue, quotas=WALK_QUOTAS))
    assert not result.placements and not result.preemptions
    assert {job_id: p.estimated_start for job_id, p in pending(result).items()} == starts


def test_estimating_only_some_jobs_gives_them_the_start_a_full_walk_gives():
    """The simulator asks only for the jobs that just arrived; the walk stops once they have theirs."""
    snap = snapshot(fleet(machines=4), running=FULL, queue=_identical(6))
    full = pending(cycle(snap))
    some = pending(cycle(snap.model_copy(update={"estimate_only": frozenset({"q2"})})))
    assert some["q2"].estimated_start == full["q2"].estimated_start == NOW + 3000
    assert [some[f"q{i}"].estimated_start for i in (3, 4, 5)] == [None, None, None]
    assert [p.position for p in some.values()] == [p.position for p in full.values()]


# First 8-GPU job starts at NOW+1000 and runs 3600 s: it ends at NOW+4600.
DEADLINE_CASES = [
    (None, None),
    (NOW + 4600, False),
    (NOW + 4599, True),
    (NOW + 100_000, False),
    (NOW - 1, True),
]
DEADLINE_IDS = [
    "a job without a deadline hint has misses_deadline None",
    "a job expected to end exactly at its deadline does not miss it",
    "a job expected to end one second after its deadline misses it",
    "a job with a distant deadline does not miss it",
    "a job whose deadline has already passed misses it",
]


@pytest.mark.parametrize("deadline,misses", DEADLINE_CASES, ids=DEADLINE_IDS)
def test_deadline_misses(deadline, misses):
    q = job("q").gpus(8).expected(3600).deadline(deadline).submitted(NOW)
    result = cycle(snapshot(fleet(machines=4), running=FULL, queue=[q]))
    p = pending(result)["q"]
    assert p.estimated_start == NOW + 1000
    assert p.misses_deadline is misses


def test_a_job_that_can_never_start_misses_its_deadline():
    q = job("huge").gpus(24).topology("block").deadline(NOW + 10**9).submitted(NOW)
    result = cycle(snapshot(fleet(machines=2), queue=[q]))
    assert pending(result)["huge"].misses_deadline is True


def test_remaining_work_counts_for_the_deadline():
    """A resumed job with 600 s of 3600 left ends at NOW+1600, in time for a NOW+2000 deadline."""
    q = job("q").gpus(8).expected(3600).deadline(NOW + 2000).submitted(NOW).queued(progress=3000)
    result = cycle(snapshot(fleet(machines=4), running=FULL, queue=[q]))
    assert pending(result)["q"].misses_deadline is False


# --- reasons, in words ------------------------------------------------------------------------------------

REASON_CASES = [
    (fleet(machines=2), [filler("f0", M[0], range(2)), filler("f1", M[1], range(2))],
     [job("j").gpus(8)], {}, "needs 8 GPUs on one machine; the largest free is 6"),
    (fleet(blocks=2, machines=1), [], [job("j").gpus(12)], {},
     "needs 12 GPUs in one block; the most free in a block is 8"),
    (fleet(machines=2), [filler("f0", M[0], range(8))], [job("j").gpus(9).topology("any")], {},
     "needs 9 GPUs; 8 are free"),
    (fleet(machines=2), [filler("f0", M[0], range(4), team="vision")], [job("j").gpus(4).team("vision")],
     {"vision": {"guaranteed": 4, "max": 6}}, "team vision would pass its maximum with this job's 4 GPUs (4 of 6 GPUs held)"),
    (fleet(machines=2), [filler("f0", M[0], range(6), team="vision")], [job("j").gpus(4).team("vision")],
     {"vision": {"guaranteed": 4, "max": 6}}, "team vision is at its maximum (6 of 6 GPUs held)"),
    (fleet(machines=2), [], [job("j").gpus(8).team("vision")], {"vision": {"guaranteed": 4, "max": 4}},
     "asks for 8 GPUs, more than team vision's maximum of 4: it cannot start until the maximum is raised "
     "(gpusched quota set) or it is cancelled"),
    (fleet(machines=2), [], [job("j").gpus(1).gpu_type("A100")], {},
     "no machine in this cluster matches training jobs, GPU type A100"),
    (fleet(machines=2), [running(job("low").gpus(8).priority("low")).on(M[0], range(8)), filler("f1", M[1], range(8))],
     [job("j").gpus(8).priority("critical")], {},
     "preempting low; starts when they have checkpointed (grace 120 s)"),
    (fleet(machines=1), [filler("f0", M[0], range(8))], [job("j").gpus(1)], {},
     "needs 1 GPU on one machine; the largest free is 0"),
    (fleet(machines=1), [running(job("low").gpus(8).priority("low")).on(M[0], range(8)).draining(NOW + 45, "j")],
     [job("j").gpus(8).priority("critical")], {},
     "waiting for 1 preempted job(s) to checkpoint and release their GPUs (grace ends in 45 s)"),
    (fleet(machines=1), [running(job("low").gpus(8).priority("low")).on(M[0], range(8)).started(NOW - 30)],
     [job("j").gpus(8).priority("critical")], {},
     "needs 8 GPUs on one machine; the largest free is 0; "
     "1 job it could displace is protected from preemption for 9.5 min more"),
    (fleet(machines=2), [running(job("new").gpus(8).priority("low")).on(M[0], range(8)).started(NOW - 30),
                         running(job("twice").gpus(8).priority("low")).on(M[1], range(8)).started(NOW - 900)
                         .preempted_at(NOW - 3500, NOW - 3300)],
     [job("j").gpus(8).priority("critical")], {},
     "needs 8 GPUs on one machine; the largest free is 0; "
     "2 jobs it could displace are protected from preemption, the first for 100 s more"),
    (fleet(machines=1), [running(job("old").gpus(8).priority("low").no_checkpoint()).on(M[0], range(8))
                         .started(NOW - 5000)],
     [job("j").gpus(8).priority("critical")], {},
     "needs 8 GPUs on one machine; the largest free is 0; 1 job it could displace is protected from preemption"),
    (fleet(machines=1), [running(job("peer").gpus(8).priority("critical")).on(M[0], range(8)).started(NOW - 30)],
     [job("j").gpus(8).priority("critical")], {},
     "needs 8 GPUs on one machine; the largest free is 0"),
]
REASON_IDS = [
    "a machine job: how many GPUs are free on the best machine",
    "a block job: how many GPUs are free in the best block",
    "an 'any' job: how many GPUs are free at all",
    "over its maximum with this job: the team, what it holds and its maximum, not 'at its maximum'",
    "at its maximum: the team, what it holds and its maximum",
    "bigger than a maximum lowered since it was accepted: not 'at its maximum', but what to do",
    "no matching hardware: what it asked for",
    "a claimant: whom it preempts and the grace period",
    "one GPU: said in the singular",
    "a claimant whose victims drain: when their grace ends, from now",
    "a claimant whose only victim has not run its minimum: for how long it is protected",
    "a claimant whose victims are protected for different reasons: how many, and when the first is free",
    "a claimant whose victim cannot checkpoint and ran too long: protected with no end",
    "a job of the same class is not a victim: no protection to speak of",
]


@pytest.mark.parametrize("machines,run,queue,quotas,reason", REASON_CASES, ids=REASON_IDS)
def test_reason_texts(machines, run, queue, quotas, reason):
    result = cycle(snapshot(machines, running=run, queue=[q.submitted(NOW) for q in queue], quotas=quotas))
    assert "j" not in placements(result)
    assert pending(result)["j"].reason == reason


def test_a_starving_small_job_kept_off_the_reserved_pool_is_told_so():
    """m0 is the last whole machine, kept for a queued 16-GPU job that needs two (a reserve of 2
    of the 3 machines). A 2-GPU job that has waited past the starvation threshold still cannot
    have it; its reason must not say 'the largest free is 8' (which would let it fit) but that
    whole machines are kept."""
    run = [filler("f1", M[1], range(8)), filler("f2", M[2], range(8))]
    queue = [job("big").gpus(16).submitted(NOW), job("small").gpus(2).submitted(0)]
    result = cycle(snapshot(fleet(machines=3), running=run, queue=queue, reserved_pool_fraction=0.5))
    assert "small" not in placements(result)
    reason = pending(result)["small"].reason
    assert "the largest free is 8" not in reason, reason
    assert "whole machine" in reason, reason


def test_a_job_kept_off_the_reserved_pool_is_not_told_it_starts_now():
    """m0 is the last whole machine, kept for a queued 16-GPU job that needs two (a reserve of 2
    of the 3 machines); m1 and m2 are full until NOW+720. The 2-GPU job cannot start now, so an
    ETA of 'now' would be wrong: it can start once the big job has started."""
    run = [filler("f1", M[1], range(8)), filler("f2", M[2], range(8))]  # overdue: expected to end at NOW+720
    queue = [job("big").gpus(16).submitted(NOW), job("small").gpus(2).submitted(NOW)]
    result = cycle(snapshot(fleet(machines=3), running=run, queue=queue, reserved_pool_fraction=0.5))
    assert "small" not in placements(result)
    p = pending(result)["small"]
    assert p.reason == "the last whole machines are kept for jobs that need a whole machine"
    assert p.estimated_start is not None and p.estimated_start > NOW, p.estimated_start


def test_a_job_admitted_again_once_the_reserved_pool_is_served_keeps_its_place_in_the_queue():
    """m0, the last whole machine, is kept for the 8-GPU job, so the 1-GPU job ahead of it is kept
    off; once the big job has taken m0, the small one is admitted again (the pool is served), after
    the job queued behind it. Both wait, and are told so in queue order (found by the property
    test: the one admitted again came last)."""
    run = [filler("f1", M[1], range(8)), filler("f2", M[2], range(8))]
    queue = [job("ahead").gpus(1).submitted(NOW - 2), job("big").gpus(8).submitted(NOW - 1),
             job("behind").gpus(1).submitted(NOW)]
    # Both teams within their guarantees: all admitted in the first pass (nobody borrows, so
    # nobody is admitted in a second one), and nobody may be displaced.
    quotas = {"t": {"guaranteed": 64}, "ops": {"guaranteed": 64}}
    result = cycle(snapshot(fleet(machines=3), running=run, queue=queue, quotas=quotas, reserved_pool_fraction=0.5))
    assert list(placements(result)) == ["big"]
    assert [p.job_id for p in sorted(result.pending, key=lambda p: p.position)] == ["ahead", "behind"]


def test_a_job_kept_off_a_machine_both_reserved_and_kept_whole_is_told_both():
    """m0 is free, and both the reservation of the starving 16-GPU job and the last whole machine
    the reserved pool keeps for an 8-GPU job (which the reservation keeps out too: it would not
    end before it). Either alone would leave the 2-GPU job no room either; the room in words
    ("the largest free is 8") would say it fits."""
    run = [_ends_at(f"r{i}", M[i], range(8), NOW + 600 * i) for i in (1, 2, 3)]
    queue = [job("big").gpus(16).topology("block").submitted(0),
             job("eight").gpus(8).submitted(NOW), job("j").gpus(2).expected(3600).submitted(NOW)]
    result = cycle(snapshot(fleet(machines=4), running=run, queue=queue))
    assert "j" not in placements(result) and "eight" not in placements(result)
    assert M[0] in result.reservations[0].machines
    assert pending(result)["j"].reason == ("behind the reservation of job big, and the last whole machines are "
                                           "kept for jobs that need a whole machine")



def test_a_job_that_fits_both_on_reserved_machines_and_on_those_kept_whole_is_told_both():
    """`j` fits on the H100 machine h0 that `big` holds, and on the A100 machines the pool keeps
    whole for `sixteen`: either alone keeps it out. It was told only of the reservation."""
    h0, h1, a1 = mid(0, 0, 0), mid(0, 0, 1), mid(1, 0, 1)
    machines = (fleet(machines=2, gpu_type="H100") + fleet(machines=2, gpu_type="A100", first_block=1)
                + fleet(machines=1, gpu_type="A100", first_block=2))
    run = [filler("h0", h0, [0, 1], expected=700).started(NOW - 100),
           filler("h1", h1, range(8), expected=1300).started(NOW - 100),
           filler("a1", a1, range(8), expected=90000).started(NOW - 100)]
    queue = [job("big").gpus(16).gpu_type("H100").topology("block").submitted(0), job("j").gpus(2).submitted(NOW - 2),
             job("sixteen").gpus(16).gpu_type("A100").topology("block").submitted(NOW - 1)]
    result = cycle(snapshot(machines, running=run, queue=queue, reserved_pool_fraction=0.5))
    assert placements(result) == {}
    assert pending(result)["j"].reason == ("behind the reservation of job big, and the last whole machines are "
                                           "kept for jobs that need a whole machine")


def test_a_job_is_told_the_reservation_that_keeps_it_out_not_one_on_machines_it_cannot_use():
    """X1 holds the A100 machine, X2 the H100 ones; Z may use only H100s, and was told it waits
    behind X1."""
    a0, h0, h1 = mid(0, 0, 0), mid(1, 0, 0), mid(1, 0, 1)
    machines = fleet(gpu_type="A100") + fleet(machines=2, first_block=1, gpu_type="H100")
    run = [filler("fa", a0, range(8), expected=NOW + 600), filler("fh0", h0, range(4), expected=NOW + 600),
           filler("fh1", h1, range(8), expected=NOW + 1200)]
    queue = [job("X1").gpus(8).gpu_type("A100").submitted(0), job("X2").gpus(8).gpu_type("H100").submitted(1),
             job("Z").gpus(4).gpu_type("H100").submitted(2)]
    result = cycle(snapshot(machines, running=run, queue=queue, starvation_threshold=0, max_reservations=2,
                            reserved_pool_fraction=0))
    assert pending(result)["Z"].reason == "behind the reservation of job X2"

WORDS_CASES = [
    (in_words.from_now(NOW + 45, NOW), "in 45 s"),
    (in_words.from_now(NOW + 1000, NOW), "in 16.7 min"),
    (in_words.from_now(NOW + 9000, NOW), "in 2.5 h"),
    (in_words.from_now(NOW, NOW), "now"),
    (in_words.from_now(NOW - 5, NOW), "now"),
    (in_words.gpus(1), "1 GPU"),
    (in_words.gpus(0), "0 GPUs"),
]
WORDS_IDS = [
    "under two minutes: in seconds",
    "under two hours: in minutes",
    "under three days: in hours",
    "a time that has come: now",
    "a time that has passed: still now",
    "one GPU: singular",
    "no GPUs: plural",
]


@pytest.mark.parametrize("said,expected", WORDS_CASES, ids=WORDS_IDS)
def test_times_and_counts_in_reasons_read_as_words(said, expected):
    assert said == expected


# --- earmarked GPUs: promised, so the walk gives them to nobody else ---------------------------


def _claim(extra_queue=()):
    """H (8 GPUs, high) preempts L off machine 0, whose other 4 GPUs are free; machine 1 is
    held for 20,000 s. No reserved pool: on two machines it would keep one whole for H."""
    low = running(job("L").gpus(4).priority("low").team("x").expected(90000)).on(M[0], range(4)).started(0)
    snap = snapshot(fleet(machines=2), running=[low, filler("F", M[1], range(8), expected=NOW + 20000)],
                    queue=[job("H").gpus(8).priority("high").expected(3600).submitted(NOW), *extra_queue],
                    reserved_pool_fraction=0)
    return snap, cycle(snap)


def test_a_job_that_preempts_is_estimated_to_start_as_its_victims_grace_ends():
    snap, result = _claim()
    assert preempted(result) == ["L"]
    assert pending(result)["H"].estimated_start == NOW + 120
    draining = cycle(after_preemption(snap, result, now=NOW + 10, victims_gone=False))
    assert pending(draining)["H"].estimated_start == NOW + 120


def test_the_gpus_earmarked_for_a_claimant_are_not_estimated_to_go_to_the_next_job():
    snap, result = _claim([job("J").gpus(4).priority("low").team("y").expected(600).submitted(NOW + 1)])
    assert preempted(result) == ["L"]
    # Not on L's GPUs as its grace ends (they are H's), but once H has run its hour.
    assert pending(result)["J"].estimated_start == NOW + 120 + 3600


def test_a_job_whose_teams_maximum_is_promised_to_its_claimant_is_estimated_to_start_after_the_claimant():
    """The walk counted what a team holds without the GPUs earmarked for its claimant (admission
    counts both): D was told its team is at its maximum, and estimated to start now."""
    low = running(job("L").gpus(8).priority("low").team("x").expected(90000)).on(M[0], range(8)).started(0)
    queue = [job("C").gpus(8).priority("high").team("hi").expected(3600).submitted(NOW - 100),
             job("D").gpus(4).priority("high").team("hi").expected(3600).submitted(NOW - 50)]
    result = cycle(snapshot(fleet(machines=2), running=[low, filler("F", M[1], range(4), expected=NOW + 20000)],
                            queue=queue, quotas={"hi": {"max": 8}}, reserved_pool_fraction=0))
    assert preempted(result) == ["L"]
    assert "at its maximum" in pending(result)["D"].reason
    assert pending(result)["D"].estimated_start == NOW + 120 + 3600


def test_a_moved_jobs_new_gpus_are_estimated_back_when_it_has_run_out_its_estimate_there():
    """G (6 GPUs) has waited long enough to have `a` moved off machine 0 onto machine 1's free
    half; `a` has outrun its estimate, so it is expected to need a fifth of it again (1,000 s)."""
    a = running(job("a").gpus(4).expected(5000)).on(M[0], range(4)).started(0)
    b = running(job("b").gpus(4).expected(90000)).on(M[1], range(4)).started(0)
    queue = [job("G").gpus(6).expected(3600).submitted(NOW - 100),
             job("K").gpus(4).priority("low").expected(600).submitted(NOW)]
    result = cycle(snapshot(fleet(machines=2), running=[a, b], queue=queue, now=NOW + 200, reserved_pool_fraction=0))
    assert [(p.job_id, {m for m, _ in p.moved_to}) for p in result.preemptions] == [("a", {M[1]})]
    assert pending(result)["G"].estimated_start == NOW + 200 + 120
    assert pending(result)["K"].estimated_start == NOW + 200 + 120 + 1000


def test_a_moved_job_counts_to_its_team_until_it_has_run_out_its_estimate_on_its_new_gpus():
    """As the move above, with `a`'s team at its maximum: the walk gave the team's count back as
    `a` left its old GPUs, and K, of the same team, was estimated to start then, beside it."""
    a = running(job("a").gpus(4).team("hi").expected(5000)).on(M[0], range(4)).started(0)
    b = running(job("b").gpus(4).expected(90000)).on(M[1], range(4)).started(0)
    queue = [job("G").gpus(6).expected(3600).submitted(NOW - 100),
             job("K").gpus(2).team("hi").priority("low").expected(600).submitted(NOW)]
    result = cycle(snapshot(fleet(machines=2), running=[a, b], queue=queue, now=NOW + 200, reserved_pool_fraction=0,
                            quotas={"hi": {"max": 4}}))
    assert [(p.job_id, {m for m, _ in p.moved_to}) for p in result.preemptions] == [("a", {M[1]})]
    assert pending(result)["K"].estimated_start == NOW + 200 + 120 + 1000


def test_the_walk_keeps_the_reserved_pool_only_while_a_job_it_is_kept_for_still_waits():
    """With the reserved pool on (two machines keep one whole for 8-GPU H), H starts on its
    earmark as L leaves; J then fits once H's machine is free, where no later cycle keeps a
    machine whole any more (nobody it would be kept for waits)."""
    snap, result = _claim([job("J").gpus(4).priority("low").team("y").expected(600).submitted(NOW + 1)])
    snap = snap.model_copy(update={"config": snap.config.model_copy(update={"reserved_pool_fraction": 0.5})})
    result = cycle(snap)
    assert preempted(result) == ["L"]
    assert pending(result)["J"].estimated_start == NOW + 120 + 3600


def test_the_walk_keeps_no_pool_for_a_job_bigger_than_its_teams_maximum():
    """The pool was kept in the walk for big_b, which its team's maximum keeps out for good, so
    the critical 6-GPU job that starts once big ends was told it never would ("unknown")."""
    queue = [job("small").gpus(6).priority("critical").expected(60).submitted(NOW),
             job("big_b").gpus(8).team("b").submitted(NOW - 2000),
             job("big").gpus(8).expected(600).submitted(NOW - 2000)]
    result = cycle(snapshot(fleet(machines=1), queue=queue, quotas={"b": {"max": 4}}))
    assert list(placements(result)) == ["big"]
    assert pending(result)["small"].estimated_start == NOW + 600


def test_no_whole_machine_is_kept_idle_for_a_job_promised_gpus_elsewhere():
    """C preempted L and holds an earmark on L's machine; the reserved pool was still kept for
    C, so m1 stood idle and J was told it was kept "for jobs that need a whole machine" and
    that it started now, starting in fact only after C had."""
    from builders import Earmark

    victim = (running(job("L").gpus(8).priority("low").team("x")).on(mid(0, 0, 0), range(8)).started(0)
              .preempted_at(NOW - 35).draining(NOW + 85, for_job="C"))
    earmark = Earmark(job_id="C", gpus=tuple((mid(0, 0, 0), g) for g in range(8)), expires=NOW + 300)
    queue = [job("C").gpus(8).priority("high").submitted(NOW - 100), job("J").gpus(6).team("y").submitted(NOW - 50)]
    result = cycle(snapshot(fleet(machines=2), running=[victim], queue=queue, earmarks=[earmark]))
    assert list(placements(result)) == ["J"]


def test_the_walk_keeps_the_cycles_reservations_a_job_behind_one_waits_and_the_holder_starts_on_time():
    """m0 is half free until NOW+1000, m1 full until NOW+3000; the starving 8-GPU job holds m0. A
    2-GPU job queued ahead of it that would run past NOW+1000 is kept behind that reservation: its
    estimate is not 'now' (it was, the walk applying a hold only to the jobs queued after its
    holder, while its reason said otherwise), and the holder starts as its reservation says."""
    from test_reservation import BASE_RUNNING, STARVING

    result = cycle(snapshot(fleet(machines=2), running=BASE_RUNNING,
                            queue=[STARVING, job("long").gpus(2).expected(5000).submitted(NOW - 100_000)]))
    [hold] = result.reservations
    p = pending(result)
    assert p["long"].reason == "behind the reservation of job starving"
    assert p["long"].estimated_start == NOW + 3000  # m1, once it is free
    assert p["starving"].estimated_start == hold.expected_start == NOW + 1000


def test_a_victim_that_loses_a_machine_in_its_grace_gives_its_claimants_gpus_back_once():
    """v (8 GPUs over m0 and m1) drains for c, whose earmark is m0; then m1 stops answering. The
    walk gives v's GPUs back at once, but not c's earmark, which comes back when c's run ends:
    counted free twice, w and c were both told m0 now, and with more jobs the walk held more free
    GPUs than m0 has (IndexError, every cycle while v was in the snapshot)."""
    from builders import unreachable

    from scheduler.models import Earmark

    v = (running(job("v").gpus(8).priority("low").topology("block"))
         .on(mid(0, 0, 0), range(4)).on(mid(0, 0, 1), range(4)).started(NOW - 5000)
         .preempted_at(NOW - 60).draining(NOW + 60, for_job="c"))
    queue = [job("c").gpus(4).priority("high").expected(600).submitted(NOW - 100),
             job("w").gpus(4).expected(20_000).submitted(NOW - 50),
             job("x").gpus(4).expected(19_500).submitted(NOW - 40),
             job("y").gpus(4).expected(3600).submitted(NOW - 30)]
    earmark = Earmark(job_id="c", gpus=tuple((mid(0, 0, 0), g) for g in range(4)), expires=NOW + 240)
    result = cycle(snapshot(unreachable(fleet(machines=2, gpus=4), mid(0, 0, 1)), running=[v], queue=queue,
                            earmarks=[earmark], quotas={"t": {"guaranteed": 0}}))
    starts = {j: p.estimated_start for j, p in pending(result).items()}
    assert starts == {"c": NOW, "w": NOW + 600, "x": NOW + 600 + 20_000, "y": NOW + 600 + 20_000 + 19_500}


def test_a_reservation_holder_behind_a_job_of_its_own_team_and_shape_is_estimated_to_start_on_it():
    """x (high) and h (low, starving, holding m0's reservation) are one team's jobs of one shape.
    Admission takes h first (a starving job, in its first pass); the walk kept x at the head of
    their lane, where h's reservation keeps it out, and never tried h: both were told they cannot
    start at all."""
    from builders import filler

    busy = filler("busy", mid(), range(4), started=NOW - 2600, expected=3600)  # ends at NOW+1000
    queue = [job("x").gpus(4).priority("high").submitted(NOW), job("h").gpus(4).priority("low").submitted(NOW - 3600)]
    result = cycle(snapshot(fleet(machines=1, gpus=4), running=[busy], queue=queue,
                            quotas={"t": {"guaranteed": 0}, "ops": {"guaranteed": 0}}))
    [hold] = result.reservations
    starts = {j: p.estimated_start for j, p in pending(result).items()}
    assert (hold.job_id, starts) == ("h", {"h": NOW + 1000, "x": NOW + 1000 + 3600})


def _two_victims_of_c():
    v1 = running(job("v1").gpus(4).priority("low")).on(M[0], range(4)).started(NOW - 5000).draining(NOW + 100, for_job="c")
    v2 = running(job("v2").gpus(4).priority("low")).on(M[0], range(4, 8)).started(NOW - 5000).draining(NOW + 500, for_job="c")
    return [v1, v2]


def test_a_claimant_is_estimated_to_start_when_the_last_of_its_victims_has_left():
    from scheduler.models import Earmark

    earmark = Earmark(job_id="c", gpus=tuple((M[0], g) for g in range(8)), expires=NOW + 600)
    result = cycle(snapshot(fleet(), running=_two_victims_of_c(), queue=[job("c").gpus(8).priority("high").submitted(NOW)],
                            earmarks=[earmark]))
    assert pending(result)["c"].estimated_start == NOW + 500


def test_a_claimant_waiting_for_victims_is_told_when_the_last_grace_ends():
    result = cycle(snapshot(fleet(), running=_two_victims_of_c(), queue=[job("c").gpus(8).priority("high").submitted(NOW)]))
    assert f"grace ends {in_words.from_now(NOW + 500, NOW)}" in pending(result)["c"].reason
