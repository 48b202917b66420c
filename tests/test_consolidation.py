"""Consolidation: small jobs move into idle gaps so a waiting gang job gets one machine or block."""

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
    unreachable,
)

M0, M1 = mid(0, 0, 0), mid(0, 0, 1)
WAITED = NOW - 600  # past the consolidation wait (300 s)


def _mover(job_id="m", machine=M0, gpus=(4,), *, priority="low", started=0.0, checkpoints=True, preempted=()):
    b = job(job_id).gpus(len(gpus)).priority(priority)
    if not checkpoints:
        b = b.no_checkpoint()
    r = running(b).on(machine, gpus).started(started)
    return r.preempted_at(*preempted) if preempted else r


def _claimant(n=4, since=WAITED, priority="low"):
    return job("gang").gpus(n).priority(priority).submitted(since)


def _scattered(mover, claimant=None, **config):
    """M0: 4 GPUs of critical work, the mover on GPU 4, GPUs 5-7 free. M1: 6 GPUs busy, 6-7 free.
    The 4-GPU claimant fits on neither machine: 3 and 2 GPUs are free."""
    run = [filler("f0", M0, range(4)), mover, filler("f1", M1, range(6))]
    return snapshot(fleet(machines=2), running=run, queue=[claimant or _claimant()], **config)


CASES = [
    (_scattered(_mover()), ["m"]),
    (_scattered(_mover(checkpoints=False, started=NOW - 700)), []),
    (_scattered(_mover(priority="normal")), []),
    (_scattered(_mover(priority="high"), _claimant(priority="high")), ["m"]),
    (_scattered(_mover(started=NOW - 100)), []),
    (_scattered(_mover(preempted=(NOW - 2000, NOW - 1000))), []),
    (_scattered(_mover(), _claimant(since=NOW - 100)), []),
    (_scattered(_mover(), max_consolidations=0), []),
    (snapshot(fleet(machines=2), queue=[_claimant()],
              running=[filler("f0", M0, range(3)), _mover(gpus=(3, 4, 5)), filler("f1", M1, range(6))]), []),
]
IDS = [
    "a gang job stuck behind scattered free GPUs gets a machine cleared by moving a small job into a gap",
    "a job that cannot checkpoint is never moved",
    "a more important job is never moved for a less important one",
    "a job of the gang job's own class is moved, whatever the class",
    "a job within its minimum runtime is not moved",
    "a job preempted twice in the last hour is not moved",
    "nothing moves before the gang job has waited the consolidation wait",
    "max_consolidations=0 turns moves off",
    "nothing moves when the mover would not fit anywhere else",
]


@pytest.mark.parametrize("snap, moved", CASES, ids=IDS)
def test_who_is_moved(snap, moved):
    result = cycle(snap)
    assert preempted(result) == moved
    assert "gang" not in placements(result)
    if moved:
        assert "moving m" in pending(result)["gang"].reason


def test_the_mover_gets_a_gap_elsewhere_and_the_gang_job_the_cleared_machine():
    result = cycle(_scattered(_mover()))
    (move,) = result.preemptions
    assert move.moved_to == ((M1, 6),)
    assert move.for_job == "gang" and "restarts at once" in move.reason
    earmarks = {e.job_id: e.gpus for e in result.earmarks}
    assert earmarks["gang"] == tuple((M0, g) for g in (4, 5, 6, 7))
    assert earmarks["m"] == ((M1, 6),)


def test_once_the_mover_has_checkpointed_both_start_where_they_were_promised():
    snap = _scattered(_mover())
    after = cycle(after_preemption(snap, cycle(snap), now=NOW + 60, victims_gone=True))
    placed = placements(after)
    assert placed["gang"].gpus == tuple((M0, g) for g in (4, 5, 6, 7))
    assert placed["m"].gpus == ((M1, 6),)


def test_while_the_mover_checkpoints_nobody_takes_the_gap_it_will_restart_in():
    snap = _scattered(_mover())
    nxt = after_preemption(snap, cycle(snap), now=NOW + 30, victims_gone=False)
    late = job("late").gpus(1).priority("critical").submitted(NOW + 30).queued()
    result = cycle(nxt.model_copy(update={"queue": nxt.queue + (late,)}))
    assert placements(result)["late"].gpus == ((M1, 7),)
    assert {e.job_id: e.gpus for e in result.earmarks}["m"] == ((M1, 6),)
    assert "gang" in pending(result)


def test_a_mover_whose_old_machine_is_lost_while_it_checkpoints_keeps_the_gap_it_restarts_in():
    """M0 stops answering during the move: the mover is requeued from there, and the GPU it was
    moving to stays earmarked for it (the gang job's, on M0, lapse with the machine)."""
    snap = _scattered(_mover())
    nxt = after_preemption(snap, cycle(snap), now=NOW + 30, victims_gone=False)
    result = cycle(nxt.model_copy(update={"machines": tuple(unreachable(list(nxt.machines), M0))}))
    assert "m" in {r.job_id for r in result.requeues}
    assert {e.job_id: e.gpus for e in result.earmarks} == {"m": ((M1, 6),)}


def test_a_block_job_gets_a_block_cleared_by_moving_a_job_to_another_block():
    """b0 has 14 free GPUs and a 2-GPU low job; the 16-GPU block job needs all of b0. The mover
    fits in b1's only gap."""
    b0m0, b0m1, b1m0, b1m1 = mid(0, 0, 0), mid(0, 0, 1), mid(1, 0, 0), mid(1, 0, 1)
    run = [_mover(machine=b0m1, gpus=(0, 1)), filler("f2", b1m0, range(6)), filler("f3", b1m1, range(8))]
    claimant = job("gang").gpus(16).topology("block").priority("low").submitted(WAITED)
    result = cycle(snapshot(fleet(blocks=2, machines=2), running=run, queue=[claimant]))
    (move,) = result.preemptions
    assert move.job_id == "m" and move.moved_to == ((b1m0, 6), (b1m0, 7))
    gang = {e.job_id: e.gpus for e in result.earmarks}["gang"]
    assert {m for m, _ in gang} == {b0m0, b0m1} and len(gang) == 16


def test_no_mover_lands_on_machines_held_for_a_starving_job():
    # H (16 GPUs) has starved: it holds block b0 from +1000 s. The short claimant C may clear b1/m0
    # by moving M, but M, with 40,000 s to go, must not land on b0, or H could not start there;
    # with nowhere else to go, M stays.
    b1 = mid(1, 0, 0)
    machines = fleet(machines=2, gpus=8) + fleet(machines=1, gpus=8, first_block=1)
    run = [running(job("M").gpus(2).expected(50_000)).on(b1, [0, 1]).started(0),
           filler("f0", b1, [2, 3], expected=50_000),
           filler("f1", M0, range(5), expected=NOW + 1000), filler("f2", M1, range(5), expected=NOW + 1000)]
    result = cycle(snapshot(machines, running=run, queue=[job("H").gpus(16).submitted(NOW - 4000),
                                                          job("C").gpus(6).expected(300).submitted(NOW - 600)]))
    landed = {m for p in result.preemptions for m, _ in p.moved_to}
    assert not landed & {M0, M1}, landed


def test_a_job_that_has_waited_long_enough_is_moved_for_though_a_like_job_just_requeued_went_first():
    """R, requeued 10 s ago, sorts first (it was submitted earlier) and may not have jobs moved
    for it yet; J, alike in all but how long it has waited, may, and is not given R's answer."""
    requeued = job("R").gpus(6).priority("low").submitted(NOW - 1000).queued(
        since=NOW - 10, progress=500, preemptions=[NOW - 10])
    waited = _claimant(n=6).queued()
    run = [filler("f0", M0, range(4)), _mover("m", M1, range(4))]
    snap = snapshot(fleet(machines=2), running=run, queue=[requeued, waited])
    assert preempted(cycle(snap)) == ["m"]


def test_a_gang_job_with_scattered_room_is_looked_at_again_when_it_reaches_the_consolidation_wait():
    early = cycle(_scattered(_mover(), _claimant(since=NOW - 100)))
    assert not preempted(early) and early.next_wake == NOW + 200
    assert preempted(cycle(_scattered(_mover(), _claimant(since=NOW - 100)).model_copy(
        update={"now": NOW + 200}))) == ["m"]


@pytest.mark.parametrize("low_claimant_too", [False, True], ids=["the high claimant alone",
                                                                 "a low claimant of its shape looked first"])
def test_a_claimant_that_may_move_a_job_moves_it_whoever_of_its_shape_could_not(low_claimant_too):
    """L (low, covered by its team's guarantee, so admitted first) may move nobody of class high;
    H (high) may move m. Before, L's "no moves" stood for every job of its shape: H waited."""
    held = [filler("f0", M0, range(4)),
            running(job("m").gpus(1).priority("high").team("x")).on(M0, [4]).started(0),
            filler("f1", M1, range(6))]
    queue = [job("H").gpus(4).priority("high").team("b").submitted(NOW - 600).queued()]
    if low_claimant_too:
        queue.append(job("L").gpus(4).priority("low").team("g").submitted(NOW - 700).queued())
    quotas = {"g": {"guaranteed": 8}, "x": {"guaranteed": 1}, "ops": {"guaranteed": 100}, "*": {"guaranteed": 0}}
    result = cycle(snapshot(fleet(machines=2), running=held, queue=queue, quotas=quotas))
    assert [(p.job_id, p.for_job) for p in result.preemptions] == [("m", "H")]


# --- which job is moved, and only as many as needed (mutation testing found these rules untested) -----------

M2, M3, M4 = mid(0, 0, 2), mid(0, 0, 3), mid(0, 0, 4)


def _saved(job_id, machine, gpus, priority="low", checkpointed=NOW - 100):
    return running(job(job_id).gpus(len(gpus)).priority(priority)).on(machine, gpus).checkpointed(checkpointed)


MOVE_CASES = [
    (2, [filler("f0", M0, range(3)), _saved("A", M0, [3], "normal"), _saved("B", M0, [4]), filler("f1", M1, range(6))],
     _claimant(priority="high"), {"max_preemption_searches": 0}, ["B"]),
    (2, [filler("f0", M0, range(3)), _saved("A", M0, [3], checkpointed=NOW - 1000),
         _saved("B", M0, [4], checkpointed=NOW - 10), filler("f1", M1, range(6))], _claimant(), {}, ["B"]),
    (3, [filler("f0", M0, range(4)), _saved("X", M0, [4], checkpointed=NOW - 1000),
         filler("f1", M1, range(4)), _saved("Y", M1, [4, 5], checkpointed=NOW - 10), filler("f2", M2, range(5))],
     _claimant(), {}, ["X"]),
    (3, [filler("f0", M0, range(4)), _saved("X", M0, [4, 5], checkpointed=NOW - 1000),
         filler("f1", M1, range(4)), _saved("Y", M1, [4, 5], checkpointed=NOW - 10), filler("f2", M2, range(6))],
     _claimant(), {}, ["Y"]),
    (2, [filler("f0", M0, range(3)), _saved("X", M0, [3, 4], checkpointed=NOW - 10),
         _saved("Y", M0, [5], checkpointed=NOW - 1000), filler("f1", M1, range(6))], _claimant(), {}, ["X"]),
    (2, [filler("f0", M0, range(3)), _saved("Y", M0, [3, 4], checkpointed=NOW - 1000),
         _saved("X", M0, [7], checkpointed=NOW - 10), filler("f1", M1, range(5))], _claimant(), {}, ["Y"]),
    (2, [filler("f0", M0, range(4)), _saved("m", M0, [4]), filler("f1", M1, range(6), expected=NOW + 10)],
     _claimant(), {}, []),
]
MOVE_IDS = [
    "the lowest class is moved first (the high gang kept from preempting, so that it moves)",
    "of one class, the job with the least work at risk is moved first",
    "the machine that needs the fewest GPUs moved is cleared",
    "of machines alike, the one with less work at risk is cleared",
    "only as many movers as needed, so that one landing gap is enough",
    "a job the gang does not need moved is left alone",
    "no move when GPUs free up on their own within half the grace",
]


@pytest.mark.parametrize("machines, run, claimant, settings, moved", MOVE_CASES, ids=MOVE_IDS)
def test_which_job_is_moved_for_a_gang(machines, run, claimant, settings, moved):
    assert preempted(cycle(snapshot(fleet(machines=machines), running=run, queue=[claimant], **settings))) == moved


def test_a_job_moved_for_one_gang_is_not_moved_again_for_a_second_in_the_same_cycle():
    """Both gangs were promised all of m0, and each of its jobs was told to move twice."""
    run = [_saved("X", M0, [0, 1, 2, 3], checkpointed=NOW - 10), _saved("Y", M0, [4, 5, 6, 7], checkpointed=NOW - 10)]
    run += [filler(f"f{k}", m, range(4)) for k, m in enumerate([M1, M2, M3, M4])]
    gangs = [job(g).gpus(8).priority("low").submitted(WAITED) for g in ("g1", "g2")]
    result = cycle(snapshot(fleet(machines=5), running=run, queue=gangs))
    moved = preempted(result)
    assert len(moved) == len(set(moved)), moved
    promised = [slot for e in result.earmarks for slot in e.gpus]
    assert len(promised) == len(set(promised)), result.earmarks
