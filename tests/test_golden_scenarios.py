"""Golden scenarios: a few stories told over one or more cycles, end to end through run_cycle."""

from __future__ import annotations

import pytest
from builders import (
    NOW,
    after_preemption,
    cycle,
    filler,
    fleet,
    job,
    machines_of,
    mid,
    pending,
    placements,
    preempted,
    running,
    snapshot,
)

from scheduler.models import RunningJob

M = [mid(0, 0, i) for i in range(8)]


def _free_per_machine(snap, result=None):
    used: dict[str, int] = {}
    for r in snap.running:
        for m, _ in r.gpus:
            used[m] = used.get(m, 0) + 1
    if result is not None:
        for p in result.placements:
            for m, _ in p.gpus:
                used[m] = used.get(m, 0) + 1
    return {m.id: m.gpus - used.get(m.id, 0) for m in snap.machines}


def _start(snap, result):
    """The next snapshot: this cycle's placements are running, the rest still queued."""
    placed = placements(result)
    started = [RunningJob(spec=q.spec, submit_time=q.submit_time, gpus=placed[q.spec.job_id].gpus, started_at=snap.now)
               for q in snap.queue if q.spec.job_id in placed]
    return snap.model_copy(update={"running": snap.running + tuple(started),
                                   "queue": tuple(q for q in snap.queue if q.spec.job_id not in placed)})


# --- 1. the fragmentation trap -----------------------------------------------------------------------------


def test_fragmentation_trap_many_machines_with_two_free_gpus_cannot_host_an_8_gpu_job():
    run = [filler(f"f{i}", M[i], range(6)) for i in range(6)]
    result = cycle(snapshot(fleet(machines=6), running=run, queue=[job("eight").gpus(8).submitted(NOW)]))
    assert not result.placements, "12 GPUs are free, but no machine has 8"
    assert pending(result)["eight"].reason == "needs 8 GPUs on one machine; the largest free is 2"


@pytest.mark.parametrize(
    "stream,whole_after",
    [(6, 3), (9, 2)],
    ids=[
        "six 2-GPU jobs fill the partly used machines exactly and leave all three whole machines whole",
        "nine 2-GPU jobs break only one whole machine, and the 8-GPU job still fits",
    ],
)
def test_fragmentation_trap_is_avoided_by_filling_partly_used_machines_first(stream, whole_after):
    """m0 has 2 free, m1 4, m2 6, m3-m5 are whole. 2-GPU jobs arrive one per cycle, then an 8-GPU job."""
    run = [filler("f0", M[0], range(6)), filler("f1", M[1], range(4)), filler("f2", M[2], range(2))]
    snap = snapshot(fleet(machines=6), running=run)
    for i in range(stream):
        snap = snap.model_copy(update={"now": NOW + 10 * i,
                                       "queue": snap.queue + (job(f"s{i}").gpus(2).submitted(NOW + 10 * i).queued(),)})
        result = cycle(snap)
        assert set(placements(result)) == {f"s{i}"}
        snap = _start(snap, result)
    free = _free_per_machine(snap)
    assert sum(1 for f in free.values() if f == 8) == whole_after, free
    assert free[M[0]] == free[M[1]] == free[M[2]] == 0, "partly used machines fill first"

    snap = snap.model_copy(update={"now": NOW + 1000, "queue": (job("eight").gpus(8).submitted(NOW + 1000).queued(),)})
    result = cycle(snap)
    [p] = result.placements
    assert p.job_id == "eight"
    assert len(machines_of(p.gpus)) == 1


def test_fragmentation_trap_a_batch_of_small_jobs_in_one_cycle_also_packs_tightly():
    run = [filler("f0", M[0], range(6)), filler("f1", M[1], range(4)), filler("f2", M[2], range(2))]
    queue = [job(f"s{i}").gpus(2).submitted(NOW + i) for i in range(6)] + [job("eight").gpus(8).submitted(NOW + 10)]
    snap = snapshot(fleet(machines=5), running=run, queue=queue)
    result = cycle(snap)
    assert set(placements(result)) == {f"s{i}" for i in range(6)} | {"eight"}
    small_machines = set().union(*(machines_of(placements(result)[f"s{i}"].gpus) for i in range(6)))
    assert small_machines == {M[0], M[1], M[2]}
    assert machines_of(placements(result)["eight"].gpus) == {M[3]}


# --- 2. a team under its guarantee reclaims borrowed capacity --------------------------------------------------


def test_reclaim_story_preempt_and_earmark_then_start_on_the_earmarked_gpus():
    """Team b (guarantee 8) borrowed the whole 3-machine cluster. Team a (guarantee 16, holds 0)
    submits an 8-GPU job. Cycle 1 preempts b's most recently started job and earmarks its GPUs;
    cycle 2, with the victim gone and the earmark passed back, starts a's job exactly there, even
    though a high-class job of team c arrived in between."""
    run = [running(job(f"b{i}").team("b").gpus(8)).on(M[i], range(8)).started(100 * (i + 1)) for i in range(3)]
    quotas = {"a": {"guaranteed": 16}, "b": {"guaranteed": 8}, "c": {"guaranteed": 0}}
    snap1 = snapshot(fleet(machines=3), running=run, quotas=quotas, grace_period=120,
                     queue=[job("a1").team("a").gpus(8).submitted(NOW)])

    result1 = cycle(snap1)
    assert not result1.placements
    assert [(p.job_id, p.for_job, p.grace_period) for p in result1.preemptions] == [("b2", "a1", 120)]
    assert "reclaims" in result1.preemptions[0].reason
    [earmark] = result1.earmarks
    assert earmark.job_id == "a1"
    assert sorted(earmark.gpus) == [(M[2], g) for g in range(8)]

    snap2 = after_preemption(snap1, result1, now=NOW + 125, victims_gone=True)
    snap2 = snap2.model_copy(update={"queue": snap2.queue + (
        job("c1").team("c").gpus(8).priority("high").submitted(NOW + 100).queued(),)})
    result2 = cycle(snap2)
    placed = placements(result2)
    assert placed["a1"].gpus == earmark.gpus
    assert "c1" not in placed or not set(placed["c1"].gpus) & set(earmark.gpus)
    assert not [e for e in result2.earmarks if e.job_id == "a1"]


def test_reclaim_story_the_claimant_waits_while_the_victim_drains():
    run = [running(job(f"b{i}").team("b").gpus(8)).on(M[i], range(8)).started(100 * (i + 1)) for i in range(2)]
    quotas = {"a": {"guaranteed": 8}, "b": {"guaranteed": 0}}
    snap1 = snapshot(fleet(machines=2), running=run, quotas=quotas, queue=[job("a1").team("a").gpus(8).submitted(NOW)])
    result1 = cycle(snap1)
    assert preempted(result1) == ["b1"]
    snap2 = after_preemption(snap1, result1, now=NOW + 60, victims_gone=False)
    result2 = cycle(snap2)
    assert not result2.placements and not result2.preemptions
    assert [e.gpus for e in result2.earmarks] == [result1.earmarks[0].gpus]
    assert "waiting for 1 preempted job(s)" in pending(result2)["a1"].reason


# --- 3. thrash protection ------------------------------------------------------------------------------------


def _victims(now, *, with_other):
    """'twice' was preempted at NOW-3000 and NOW-1000 and has run since NOW-700 (past the minimum
    runtime); it is the most recently started low job, so without protection it would go first."""
    run = [running(job("twice").gpus(8).priority("low")).on(M[0], range(8)).started(NOW - 700)
           .preempted_at(NOW - 3000, NOW - 1000)]
    if with_other:
        run.append(running(job("other").gpus(8).priority("low")).on(M[1], range(8)).started(0))
    else:
        run.append(filler("guard", M[1], range(8)))
    return snapshot(fleet(machines=2), running=run, now=now, queue=[job("crit").gpus(8).priority("critical").submitted(NOW)])


def test_thrash_a_job_preempted_twice_within_the_hour_is_spared_for_another_victim():
    result = cycle(_victims(NOW, with_other=True))
    assert preempted(result) == ["other"]
    assert sorted(result.earmarks[0].gpus) == [(M[1], g) for g in range(8)]


def test_thrash_when_the_protected_job_is_the_only_candidate_nothing_is_preempted():
    result = cycle(_victims(NOW, with_other=False))
    assert not result.preemptions and not result.earmarks
    assert "crit" in pending(result)
    # The window is inclusive (no more than two preemptions in any closed hour): the protection
    # ends just after the hour.
    assert result.next_wake == NOW + 601, "the cycle should wake when the protection ends"


def test_thrash_after_the_hour_the_job_can_be_preempted_again():
    result = cycle(_victims(NOW + 601, with_other=False))
    assert preempted(result) == ["twice"]
    [p] = result.preemptions
    assert p.for_job == "crit"
