"""The running jobs' expected ends, kept per cluster between cycles, are always those worked out
from nothing: each job's end by its estimate (a restart added if it resumed; never in the past;
a draining job's at the end of its grace) and the machines it frees, in the order of the jobs."""

from __future__ import annotations

import random

import pytest
from builders import NOW, fleet, job, mid, running

from scheduler.capacity import Capacity
from scheduler.models import RunningJob

MACHINES = fleet(blocks=2, racks=1, machines=4)


def _job(k: int, rng: random.Random) -> RunningJob:
    machine = mid(rng.randrange(2), 0, rng.randrange(4))
    gpus = sorted(rng.sample(range(8), rng.choice((1, 2, 4))))
    b = running(job(f"j{k}").gpus(len(gpus)).expected(rng.choice((600.0, 3600.0, 7200.0)))).on(machine, gpus)
    b = b.started(NOW - rng.choice((100.0, 1000.0, 5000.0, 9000.0)))
    if rng.random() < 0.2:
        b = b.resumed_from(300.0)
    if rng.random() < 0.1:
        b = b.draining(NOW + 60.0)
    return b.build()


def _from_nothing(cap: Capacity, jobs: list[RunningJob], now: float, restart: float):
    out = []
    for j in jobs:
        end = j.estimated_end + restart if restart and j.resumed and not j.draining else j.estimated_end
        if j.draining or end <= now:
            end = j.expected_end(now)
        out.append((end, j, j.gpus, cap.machines_of(j), j.spec.num_gpus))
    return out


@pytest.mark.parametrize("restart", [0.0, 120.0])
def test_the_ends_kept_between_cycles_equal_ends_worked_out_from_nothing(restart):
    from scheduler.expected_ends import expected_ends

    rng = random.Random(int(restart))
    pool = [_job(k, rng) for k in range(60)]
    jobs = pool[:20]
    now = NOW
    for step in range(30):
        cap = Capacity(MACHINES)
        assert expected_ends(cap.layout, jobs, now, restart) == _from_nothing(cap, jobs, now, restart)
        # A few jobs end and start (sometimes none, sometimes most), and time moves on.
        ended = set(rng.sample(range(len(jobs)), min(len(jobs), rng.choice((0, 1, 3, len(jobs) * 3 // 4)))))
        jobs = [j for k, j in enumerate(jobs) if k not in ended]
        jobs += rng.sample([j for j in pool if j not in jobs], rng.randint(0, 3))
        if step % 7 == 0:
            rng.shuffle(jobs)
        now += rng.choice((0.0, 30.0, 600.0))
    # Another restart allowed: worked out afresh, not taken from what was kept.
    cap = Capacity(MACHINES)
    assert expected_ends(cap.layout, jobs, now, restart + 1) == _from_nothing(cap, jobs, now, restart + 1)


def _resumed():
    return running(job("r").gpus(8).expected(3600)).on(mid(0, 0, 0), range(8)).started(NOW - 100).resumed_from(300.0).build()


def test_the_ends_kept_from_the_last_cycle_follow_a_new_expected_restart():
    from scheduler.expected_ends import expected_ends

    cap, jobs = Capacity(fleet()), [_resumed()]
    expected_ends(cap.layout, jobs, NOW, 0.0)
    [(end, *_)] = expected_ends(cap.layout, jobs, NOW, 120.0)
    assert end == jobs[0].estimated_end + 120.0


def test_the_ends_kept_from_the_last_cycle_follow_a_new_layout_of_the_machines():
    from scheduler.expected_ends import expected_ends

    machines = fleet(machines=2)
    jobs = [running(job("r").gpus(8)).on(mid(0, 0, 1), range(8)).started(NOW - 100).build()]
    expected_ends(Capacity(machines).layout, jobs, NOW, 0.0)
    cap = Capacity(machines[::-1])
    [(_, _, _, where, _)] = expected_ends(cap.layout, jobs, NOW, 0.0)
    assert where == cap.machines_of(jobs[0])
