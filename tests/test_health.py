"""Health: jobs on dead machines leave at once, jobs on a sick GPU leave gracefully; only bad GPUs go."""

from __future__ import annotations

import pytest
from builders import (
    NOW,
    cycle,
    fleet,
    job,
    machines_of,
    mid,
    pending,
    placements,
    running,
    silent,
    snapshot,
    unhealthy,
    unreachable,
)

M0, M1 = mid(0, 0, 0), mid(0, 0, 1)


def _on(job_id, *where):
    """A running job on (machine, gpus) pairs."""
    n = sum(len(list(g)) for _, g in where)
    b = running(job(job_id).gpus(n))
    for machine, gpus in where:
        b = b.on(machine, gpus)
    return b


REQUEUE_CASES = [
    (unreachable(fleet(machines=2), M0), [_on("j", (M0, range(4)))], {"j": False}),
    (unhealthy(fleet(machines=2), M0, [2]), [_on("j", (M0, range(4)))], {"j": True}),
    (unhealthy(fleet(machines=2), M0, [6]), [_on("j", (M0, range(4)))], {}),
    (unreachable(fleet(machines=2), M1), [_on("j", (M0, range(8)), (M1, range(8)))], {"j": False}),
    (unhealthy(fleet(machines=2), M1, [0]), [_on("j", (M0, range(8)), (M1, range(8)))], {"j": True}),
    (unreachable(unhealthy(fleet(machines=2), M0, [0]), M1), [_on("j", (M0, range(8)), (M1, range(8)))], {"j": False}),
    (fleet(machines=1), [_on("j", (M1, range(2)))], {"j": False}),
    (unhealthy(fleet(machines=2), M0, [0]), [_on("j", (M0, range(2))).draining(NOW + 60, "x")], {}),
    (unreachable(fleet(machines=2), M0), [_on("j", (M0, range(2))).draining(NOW + 60, "x")], {"j": False}),
    (unhealthy(fleet(machines=1), M0, [0, 5]), [_on("a", (M0, [0])), _on("b", (M0, [1, 2])), _on("c", (M0, [5, 7]))],
     {"a": True, "c": True}),
]
REQUEUE_IDS = [
    "a job on an unreachable machine is requeued at once, not gracefully",
    "a job on an unhealthy GPU of a reachable machine is requeued gracefully",
    "a job on healthy GPUs of a machine with another unhealthy GPU keeps running",
    "a gang with one machine unreachable is requeued at once",
    "a gang with one unhealthy GPU is requeued gracefully",
    "a gang on an unreachable machine and a sick GPU is requeued at once (the worse wins)",
    "a job on a machine missing from the snapshot is requeued at once",
    "a draining job on a sick GPU is not asked to leave again",
    "a draining job on an unreachable machine is still gone",
    "each job on a sick GPU is requeued, its neighbours on healthy GPUs are not",
]


@pytest.mark.parametrize("machines,run,expected", REQUEUE_CASES, ids=REQUEUE_IDS)
def test_requeues(machines, run, expected):
    result = cycle(snapshot(machines, running=run))
    got = {r.job_id: r.graceful for r in result.requeues}
    assert got == expected
    for r in result.requeues:
        assert ("unreachable" in r.reason) == (not r.graceful), r.reason
        assert ("unhealthy" in r.reason) == r.graceful, r.reason


def test_only_the_sick_gpu_leaves_the_inventory():
    """GPU 3 of m0 is sick and m1 is full: a 7-GPU job starts on m0's other seven GPUs."""
    machines = unhealthy(fleet(machines=2), M0, [3])
    result = cycle(snapshot(machines, running=[_on("full", (M1, range(8)))], queue=[job("seven").gpus(7).submitted(NOW)]))
    assert sorted(placements(result)["seven"].gpus) == [(M0, g) for g in (0, 1, 2, 4, 5, 6, 7)]


def test_a_job_leaving_gracefully_keeps_its_gpus_until_it_has_left():
    """GPU 3 of m0 is sick under job j (GPUs 0-3); its healthy GPUs 0-2 are not given away yet."""
    machines = unhealthy(fleet(machines=1), M0, [3])
    result = cycle(snapshot(machines, running=[_on("j", (M0, range(4)))],
                            queue=[job("big").gpus(7).submitted(NOW), job("four").gpus(4).submitted(NOW + 1)]))
    assert [r.job_id for r in result.requeues] == ["j"]
    placed = placements(result)
    assert "big" not in placed
    assert "needs 7 GPUs on one machine; the largest free is 4" == pending(result)["big"].reason
    assert sorted(placed["four"].gpus) == [(M0, g) for g in range(4, 8)]


def test_a_job_leaving_gracefully_is_not_also_preempted():
    machines = unhealthy(fleet(machines=1), M0, [0])
    run = [running(job("low").gpus(8).priority("low")).on(M0, range(8))]
    result = cycle(snapshot(machines, running=run, queue=[job("crit").gpus(7).priority("critical").submitted(NOW)]))
    assert [(r.job_id, r.graceful) for r in result.requeues] == [("low", True)]
    assert not result.preemptions


def test_unreachable_machines_reasons_count_only_usable_gpus():
    machines = unreachable(fleet(machines=2), M1)
    result = cycle(snapshot(machines, running=[_on("r", (M0, range(4)))], queue=[job("eight").gpus(8).submitted(NOW)]))
    assert pending(result)["eight"].reason == "needs 8 GPUs on one machine; the largest free is 4"
    assert not machines_of(g for p in result.placements for g in p.gpus) & {M1}


def test_a_gang_lost_with_one_machine_keeps_its_gpus_on_the_others_until_it_has_left():
    """Gang g spans m0 and m1; m1 stops answering. g's GPUs on m0 stay held in this cycle (its
    allocation ends only once its workflow has stopped it: placing there would double-book
    them), and the waiting job is told it should start at once, when they come back."""
    machines = unreachable(fleet(machines=2), M1)
    result = cycle(snapshot(machines, running=[_on("g", (M0, range(8)), (M1, range(8)))],
                            queue=[job("next").gpus(8).submitted(NOW)]))
    assert [(r.job_id, r.graceful) for r in result.requeues] == [("g", False)]
    assert "next" not in placements(result)
    assert pending(result)["next"].estimated_start == NOW


# --- a machine whose agent owes an answer takes no work -----------------------------------------


def test_a_machine_taking_no_work_keeps_its_jobs_and_gets_no_new_one():
    """m0's agent missed a job's heartbeat: m0 is empty but for r, and gets nothing; the waiting
    job takes m1, the fullest machine that fits being out of bounds."""
    machines = silent(fleet(machines=2), M0)
    result = cycle(snapshot(machines, running=[_on("r", (M0, range(2))), _on("m1", (M1, range(2)))],
                            queue=[job("four").gpus(4).submitted(NOW)]))
    assert not result.requeues and not result.preemptions
    assert machines_of(placements(result)["four"].gpus) == {M1}


def test_an_empty_machine_taking_no_work_is_not_where_a_whole_machine_job_goes_back_to():
    """A dead agent's machine is empty (its jobs were requeued) but still reachable until its
    timeout; the job requeued from it waits instead of being placed there again, where nobody
    would pick it up."""
    result = cycle(snapshot(silent(fleet(machines=1), M0), queue=[job("back").gpus(8).submitted(NOW)]))
    assert not result.placements
    assert pending(result)["back"].reason == ("needs 8 GPUs on one machine; the largest free is 0; 1 machine it may "
                                              "use takes no work now (cordoned, drained, or its agent owes an answer)")


def test_gpus_a_preemption_frees_on_a_machine_taking_no_work_do_not_count():
    """Preempting the low job on m0 would free GPUs nobody may use yet: no preemption."""
    run = [running(job("low").gpus(8).priority("low")).on(M0, range(8)).started(NOW - 5000)]
    result = cycle(snapshot(silent(fleet(machines=1), M0), running=run,
                            queue=[job("crit").gpus(8).priority("critical").submitted(NOW)]))
    assert not result.preemptions and not result.placements


def test_a_machine_taking_work_again_is_used_again():
    machines = silent(fleet(machines=1), M0)
    result = cycle(snapshot([m.model_copy(update={"takes_work": True}) for m in machines],
                            queue=[job("back").gpus(8).submitted(NOW)]))
    assert machines_of(placements(result)["back"].gpus) == {M0}
